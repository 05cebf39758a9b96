"""One engine-flag spelling everywhere: the renaming table, the one tokenizer and what the
server, the bench's record, the run directory and the simulator each read from it."""

from __future__ import annotations

import dataclasses

import pytest

from servelab.engine.engine_config import EngineConfig
from servelab.engine_flags import RENAMED, config_settings, read_flags, split_flags
from servelab.server.server_args import ServerArgs
from servelab.sim.engine_args import DEPLOYMENT_KEYS, parse_engine_args, respell

SERVE = (
    "--max-num-seqs 8 --no-enable-prefix-caching --num-gpu-blocks-override 100 "
    "--kv-cache-memory 512M"
)
OLD = "max_num_seqs=8,enable_prefix_caching=false num_gpu_blocks_override=100 kv_cache_memory=512M"
SETTINGS = {
    "max_num_seqs": 8,
    "enable_prefix_caching": False,
    "num_kv_blocks": 100,
    "kv_cache_memory_gb": 0.512,
}


def test_one_spelling_means_the_same_to_server_bench_run_directory_and_simulator():
    served = ServerArgs(
        max_num_seqs=8,
        enable_prefix_caching=False,
        num_gpu_blocks_override=100,
        kv_cache_memory="512M",
    ).engine_config()
    recorded = read_flags(SERVE)  # the bench's manifest keeps the flags as given
    assert recorded == {
        "max_num_seqs": 8,
        "enable_prefix_caching": False,
        "num_gpu_blocks_override": 100,
        "kv_cache_memory": "512M",
    }
    assert config_settings(recorded) == SETTINGS  # how a format-1 run's config is read
    assert parse_engine_args(SERVE) == SETTINGS  # the simulator's --engine-args
    assert {k: getattr(served, k) for k in SETTINGS} == SETTINGS


def test_every_renamed_flag_sets_a_config_field_or_a_deployment_knob():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert all(key in fields or key in DEPLOYMENT_KEYS for key, _ in RENAMED.values())
    server_flags = {f.name for f in dataclasses.fields(ServerArgs)}
    assert {"num_gpu_blocks_override", "kv_cache_memory"} <= server_flags


def test_the_old_key_value_spelling_reads_the_same_and_respells_to_flags():
    assert parse_engine_args(OLD) == SETTINGS
    assert respell(OLD) == SERVE
    assert respell(SERVE) is None
    assert respell("--max-num-seqs=8 tp=2 tensor_parallel_size=4") == (
        "--max-num-seqs 8 --tp 2 --tensor-parallel-size 4"
    )
    assert parse_engine_args("tp=2 --tensor-parallel-size 4") == {"tp": 4}


def test_the_bench_record_is_lenient():
    text = "stray --threads 2 --disaggregated --kv-transport=socket --x 1.5 --no-thing"
    assert read_flags(text) == {
        "threads": 2,
        "disaggregated": True,
        "kv_transport": "socket",
        "x": 1.5,
        "thing": False,
    }
    assert read_flags("") == read_flags(None) == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("--max-num-sequences 3", "unknown engine arg '--max-num-sequences'"),
        ("--no-such-switch", "unknown engine arg '--no-such-switch'"),
        ("--max-num-seqs", "needs a value"),
        ("128", "write --flag value"),
    ],
)
def test_the_strict_reading_names_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        split_flags(text, known={"max_num_seqs", "enable_prefix_caching"})
