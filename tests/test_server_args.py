"""`servelab serve` flags: parsing and validation (no process is started)."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import typer
from typer.testing import CliRunner

from servelab.cli import app
from servelab.server import server_args
from servelab.server.server_args import API_KEY_ENV, ServerArgs
from servelab.units import parse_size_gb


@pytest.mark.parametrize(
    ("text", "gb"),
    [
        ("2", 2.0),
        ("2G", 2.0),
        ("1.5GB", 1.5),
        ("512M", 0.512),
        ("512MiB", 0.536870912),
        ("1 GiB", 1.073741824),
    ],
)
def test_kv_cache_memory_sizes(text: str, gb: float) -> None:
    assert parse_size_gb(text) == pytest.approx(gb)


@pytest.mark.parametrize("text", ["", "0", "-1G", "2X", "2iB", "2b", "lots"])
def test_bad_kv_cache_memory_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        parse_size_gb(text)


def test_flags_map_onto_the_engine_config() -> None:
    args = ServerArgs(
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=1024,
        block_size=32,
        num_gpu_blocks_override=100,
        kv_cache_memory="512M",
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        max_queue=5,
    )
    args.validate()
    cfg = args.engine_config()
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size) == (
        512,
        8,
        1024,
        32,
    )
    assert (cfg.num_kv_blocks, cfg.kv_cache_memory_gb, cfg.max_queue) == (100, 0.512, 5)
    assert not cfg.enable_chunked_prefill and not cfg.enable_prefix_caching
    assert ServerArgs(model="m", served_model_name=None).model_name == "m"
    assert "secret" not in repr(ServerArgs(api_key="secret"))


def test_the_engine_config_is_built_once_per_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """validate builds it (checking it and a --simulate target on it); every later caller
    (the serve command, the core's or the workers' config) gets that same object."""
    built = []
    settings = server_args.config_settings
    monkeypatch.setattr(server_args, "config_settings", lambda f: built.append(f) or settings(f))
    args = ServerArgs(max_num_seqs=8, simulate="h100:llama-3.1-8b")
    args.validate()
    cfg = args.engine_config()
    assert args.engine_config() is cfg and cfg.max_num_seqs == 8 and len(built) == 1
    copy = dataclasses.replace(args, max_num_seqs=4)  # another serve's flags, its own config
    assert copy.engine_config().max_num_seqs == 4 and args.engine_config() is cfg


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--port", "-1"], "--port"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--threads", "0"], "--threads"),
        (["--max-queue", "-2"], "--max-queue"),
        (["--device", "tpu"], "--device"),
        (["--log-level", "loud"], "--log-level"),
        (["--header-timeout", "0"], "--header-timeout"),
        (["--keep-alive-timeout", "-1"], "--keep-alive-timeout"),
        (["--model", "no-such-model"], "known names are"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["serve", *flags])
    assert result.exit_code == 2
    assert needle in result.output


def test_serve_options_are_the_server_args_fields_one_for_one() -> None:
    params = typer.main.get_command(app).commands["serve"].params
    fields = dataclasses.fields(ServerArgs)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        assert p.opts == [f"--{f.name.replace('_', '-')}"]
        assert p.default == f.default and p.help == f.metadata["help"]
    flags = {p.name: p for p in params}
    assert flags["enable_prefix_caching"].secondary_opts == ["--no-enable-prefix-caching"]
    assert flags["disaggregated"].secondary_opts == []
    assert flags["api_key"].envvar == API_KEY_ENV


def test_serve_flags_parse_into_server_args(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[ServerArgs] = []
    monkeypatch.setattr("servelab.server.main.run_server", lambda args: served.append(args) or 0)
    flags = ["--port", "0", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    flags += ["--kv-cache-memory", "512M", "--disaggregated", "--kv-transport", "socket"]
    result = CliRunner().invoke(app, ["serve", *flags], env={API_KEY_ENV: ""})
    assert result.exit_code == 0, result.output
    assert served == [
        ServerArgs(
            port=0,
            max_num_seqs=8,
            enable_prefix_caching=False,
            kv_cache_memory="512M",
            disaggregated=True,
            kv_transport="socket",
        )
    ]
    assert served[0].api_key is None  # an empty key in the environment is no key


def test_a_runs_whole_engine_config_relaunches_as_serve_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What `tune --verify` does with a run's manifest: every recorded engine config field
    becomes a `servelab serve` flag that parses, and means the same config."""
    from servelab.analyze.tuning.candidates import serve_flags
    from servelab.engine.engine_config import EngineConfig

    recorded = dataclasses.asdict(EngineConfig(num_kv_blocks=300, max_num_seqs=8))
    served: list[ServerArgs] = []
    monkeypatch.setattr("servelab.server.main.run_server", lambda args: served.append(args) or 0)
    argv = ["serve", *shlex.split(serve_flags(recorded))]
    result = CliRunner().invoke(app, argv, env={API_KEY_ENV: ""})
    assert result.exit_code == 0, result.output
    assert served[0].num_gpu_blocks_override == 300 and served[0].max_num_seqs == 8
