"""Run benchmark clients as subprocesses and read back what each one reported per request.

Each client (servelab's own ``servelab bench`` and the peers installed by ``install.sh``:
``vllm bench serve``, GuideLLM, AIPerf) gets the same job: ``requests`` requests of about
``prompt_tokens`` (200 by default) prompt tokens and exactly ``tokens`` output tokens on
``/v1/completions``, ``streams`` in flight, streamed; the peers draw their synthetic prompts from
the job's ``seed`` (servelab's own client takes its lengths from ``fixed.yaml``). Its
per-request output file (never its printed summary) gives, for every request, the
id the server knows it by, the TTFT it reported and, where it records per-chunk times, its
inter-chunk gaps. The caller joins these with the server's own timelines.

How each client's request ids reach the server: servelab and AIPerf send ``X-Request-Id``
(recorded as ``request_id`` / ``metadata.x_request_id``); ``vllm bench serve`` sends
``x-request-id = prefix + index`` and keeps its per-request lists in that order; GuideLLM sends no
id but records the ``id`` of the stream's chunks (``response_id``), which the test server sets
to its own id for the request.

The peers need a tokenizer to build prompts and must not download one: ``local_tokenizer``
exports the default model's tokenizer once and lays it out as a Hugging Face cache entry, because
AIPerf in offline mode resolves a tokenizer only through the cache (a plain directory path
fails there); the other clients are given the snapshot directory itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servelab.rundir import read_records, server_id

INPUT_TOKENS = 200
WORKLOAD = Path(__file__).with_name("fixed.yaml")  # servelab's side of the same shape
VLLM_LAUNCHER = Path(__file__).with_name("vllm_bench_serve.py")
TOKENIZER_REPO = "local/smollm2-135m"
_SNAPSHOT = "0" * 40  # a commit id is all the cache layout asks of a snapshot
# Each peer's per-request output file in its output folder.
VLLM_RESULT = "vllm.json"
GUIDELLM_RESULT = "benchmarks.json"
AIPERF_RESULT = "profile_export.jsonl"  # --export-level records


@dataclass(kw_only=True)
class Job:
    url: str
    streams: int
    requests: int
    tokens: int
    tag: str  # unique per job: request-id prefix and output folder
    prompt_tokens: int = INPUT_TOKENS
    model: str = "test-model"  # the name the server serves (vLLM refuses any other)
    seed: int = 0  # the client's own, for its synthetic prompts


@dataclass
class Tokenizer:
    path: Path  # a directory with tokenizer.json
    hf_cache: Path  # HF_HUB_CACHE in which TOKENIZER_REPO resolves to ``path``


@dataclass
class Reported:
    request_id: str  # the server's id for the request (its timeline key)
    ttft: float  # seconds, as the client reported it
    itls: list[float] | None  # the client's per-chunk gaps; None where it keeps none


@dataclass(kw_only=True)
class Client:
    name: str
    exe: Path
    command: Callable[[Job, Tokenizer, Path], list[str]]
    read: Callable[[Job, Path], list[Reported]]
    note: str = ""  # what a result from this client cannot show
    result: str = ""  # its per-request output in its folder, as `servelab import` reads it
    ready: Path | None = None  # present once it is installed and runs (default: exe)


class ClientFailed(Exception):
    pass


def local_tokenizer(cache_root: Path) -> Tokenizer:
    """The default model's tokenizer as a local HF cache entry (exported once, weights dropped)."""
    repo = cache_root.absolute() / "hub" / f"models--{TOKENIZER_REPO.replace('/', '--')}"
    snap = repo / "snapshots" / _SNAPSHOT
    if not (snap / "tokenizer.json").exists():
        servelab = Path(sys.executable).with_name("servelab")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "model"
            done = subprocess.run(
                [str(servelab), "export-hf", "--model", "smollm2-135m", str(out)],
                check=False,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise ClientFailed(f"servelab export-hf failed: {done.stderr.strip()[-300:]}")
            snap.mkdir(parents=True, exist_ok=True)
            for f in out.iterdir():
                if f.suffix == ".json":  # tokenizer and configs; not the 500 MB of weights
                    shutil.copy(f, snap / f.name)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)
    return Tokenizer(snap, repo.parent)


def run_client(
    client: Client, job: Job, tok: Tokenizer, out: Path, cpu: int | None, timeout: float = 600
) -> tuple[list[Reported], str]:
    """Run one client to the end; its requests and a note (empty if nothing to say).

    Raises ClientFailed with the reason when it does not run or leaves nothing readable.
    """
    if not (client.ready or client.exe).exists():
        raise ClientFailed("not installed (see benchmarks/peers/install.sh)")
    out = out.absolute()  # the client runs in it, and is given paths inside it
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [str(client.exe), *client.command(job, tok, out)]
    if cpu is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": str(tok.hf_cache),
        "TOKENIZERS_PARALLELISM": "false",
        "NO_COLOR": "1",
    }
    (out / "command.txt").write_text(" ".join(cmd) + "\n")
    with open(out / "output.log", "wb") as log:
        try:
            rc = subprocess.run(
                cmd,
                check=False,
                cwd=out,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            raise ClientFailed(
                f"did not finish in {timeout:.0f} s (see {out}/output.log)"
            ) from None
    note = client.note
    if rc == 3 and client.name == "servelab":
        note = "marked its own run invalid: " + _servelab_invalid_reason(out)
    elif rc != 0:
        raise ClientFailed(f"exit code {rc}: {_last_line(out / 'output.log')}")
    try:
        reported = client.read(job, out)
    except (OSError, KeyError, ValueError, IndexError) as e:
        raise ClientFailed(f"its output could not be read ({type(e).__name__}: {e})") from e
    if not reported:
        raise ClientFailed(f"reported no successful request (see {out}/output.log)")
    return reported, note


def _last_line(path: Path) -> str:
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


def _servelab_invalid_reason(out: Path) -> str:
    manifest = json.loads((out / "run" / "manifest.json").read_text())
    return str(manifest.get("invalid_reason"))


# ---------------------------------------------------------------- servelab bench


def _servelab_cmd(job: Job, tok: Tokenizer, out: Path) -> list[str]:
    return [
        "bench",
        "--url", job.url,
        "--workload", str(WORKLOAD),
        "--tokenizer", str(tok.path),
        "--concurrency", str(job.streams),
        "--requests", str(job.requests),
        "--out", str(out / "run"),
        "--quiet",
    ]  # fmt: skip


def _servelab_read(job: Job, out: Path) -> list[Reported]:
    return [
        Reported(server_id(r), r.ttft, r.itls)
        for r in read_records(out / "run" / "requests.jsonl")
        if r.ok and r.ttft is not None
    ]


# ---------------------------------------------------------------- vllm bench serve


def _vllm_cmd(job: Job, tok: Tokenizer, out: Path) -> list[str]:
    return [
        str(VLLM_LAUNCHER),
        "--backend", "openai",
        "--base-url", job.url,
        "--endpoint", "/v1/completions",
        "--model", job.model,
        "--tokenizer", str(tok.path),
        "--dataset-name", "random",
        "--random-input-len", str(job.prompt_tokens),
        "--random-output-len", str(job.tokens),
        "--ignore-eos",
        "--num-prompts", str(job.requests),
        "--max-concurrency", str(job.streams),
        "--request-rate", "inf",
        "--request-id-prefix", f"{job.tag}-",
        "--seed", str(job.seed),
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(out),
        "--result-filename", VLLM_RESULT,
    ]  # fmt: skip


def _vllm_read(job: Job, out: Path) -> list[Reported]:
    d = json.loads((out / VLLM_RESULT).read_text())
    # outputs are in request order, and request i was sent with id prefix + i
    return [
        Reported(f"{job.tag}-{i}", ttft, itl)
        for i, (ttft, itl, err) in enumerate(zip(d["ttfts"], d["itls"], d["errors"]))
        if not err and ttft
    ]


# ---------------------------------------------------------------- GuideLLM


def _guidellm_cmd(job: Job, tok: Tokenizer, out: Path) -> list[str]:
    return [
        "run",
        "--backend",
        f"kind=openai_http,target={job.url},model={job.model},request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={job.streams}",
        "--constraint", f"kind=max_requests,count={job.requests}",
        "--tokenizer", f"kind=hf_auto,model={tok.path}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={job.prompt_tokens},output_tokens={job.tokens}",
        "--seed", f"kind=static,value={job.seed}",
        "--output", f"kind=json,path={out / GUIDELLM_RESULT}",
        "--disable-console-interactive",
    ]  # fmt: skip


def _guidellm_read(job: Job, out: Path) -> list[Reported]:
    d = json.loads((out / GUIDELLM_RESULT).read_text())
    return [
        Reported(r["response_id"], r["time_to_first_token_ms"] / 1e3, None)
        for r in d["benchmarks"][0]["requests"]["successful"]
        if r.get("response_id") and r.get("time_to_first_token_ms") is not None
    ]


# ---------------------------------------------------------------- AIPerf


def _aiperf_cmd(job: Job, tok: Tokenizer, out: Path) -> list[str]:
    return [
        "profile",
        "--model", job.model,
        "--url", job.url,
        "--endpoint-type", "completions",
        "--streaming",
        "--tokenizer", TOKENIZER_REPO,
        "--synthetic-input-tokens-mean", str(job.prompt_tokens),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(job.tokens),
        "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--concurrency", str(job.streams),
        "--request-count", str(job.requests),
        "--random-seed", str(job.seed),
        "--artifact-dir", str(out),
        "--export-level", "records",
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]  # fmt: skip


def _aiperf_read(job: Job, out: Path) -> list[Reported]:
    res = []
    for line in (out / AIPERF_RESULT).read_text().splitlines():
        d = json.loads(line)
        m = d["metrics"]
        if "time_to_first_token" not in m:  # a failed request
            continue
        gaps = m.get("inter_chunk_latency", {}).get("value")
        res.append(
            Reported(
                d["metadata"]["x_request_id"],
                _ms(m["time_to_first_token"]) / 1e3,
                [g / 1e3 for g in gaps] if gaps is not None else None,
            )
        )
    return res


def _ms(metric: dict) -> float:
    if metric["unit"] != "ms":
        raise ValueError(f"unexpected unit {metric['unit']!r}")
    return float(metric["value"])


def clients(peers_dir: Path) -> list[Client]:
    """servelab first, then the peers, each from its venv under ``peers_dir``."""

    def peer(name: str, exe: str, **kw: Any) -> Client:
        # install.sh marks a venv once the peer's command has run from it
        venv = peers_dir.absolute() / name  # absolute: each client runs in its output folder
        return Client(name=name, exe=venv / "bin" / exe, ready=venv / "INSTALLED", **kw)

    return [
        Client(
            name="servelab",
            exe=Path(sys.executable).with_name("servelab"),
            command=_servelab_cmd,
            read=_servelab_read,
        ),
        peer("vllm", "python", command=_vllm_cmd, read=_vllm_read, result=VLLM_RESULT),
        peer(
            "guidellm",
            "guidellm",
            command=_guidellm_cmd,
            read=_guidellm_read,
            note="keeps only first and last token times: no ITL",
            result=GUIDELLM_RESULT,
        ),
        peer("aiperf", "aiperf", command=_aiperf_cmd, read=_aiperf_read, result=AIPERF_RESULT),
    ]
