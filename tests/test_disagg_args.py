"""`servelab serve --disaggregated` flags and the CPU split between workers (no process)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from servelab.cli import app
from servelab.server.disagg.cpus import WorkerCPUs, describe, split_cpus
from servelab.server.server_args import ServerArgs


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--prefill-workers", "2"], "only apply with --disaggregated"),
        (["--kv-transport", "socket"], "--kv-transport only apply"),
        (["--disaggregated", "--decode-workers", "0"], "--decode-workers must be at least 1"),
        (["--disaggregated", "--kv-transport", "rdma"], "use shm (one host) or socket"),
        (["--disaggregated", "--kv-transfer-timeout", "0"], "--kv-transfer-timeout must be"),
    ],
)
def test_bad_disaggregated_flags_exit_2_with_a_message(flags: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, ["serve", *flags])
    assert result.exit_code == 2
    assert needle in result.output


def test_disaggregated_flags_validate() -> None:
    args = ServerArgs(
        disaggregated=True, prefill_workers=2, decode_workers=3, kv_transport="socket"
    )
    args.validate()
    assert args.engine_config() == ServerArgs().engine_config()  # each worker's own config


def test_cpus_pinned_when_every_worker_gets_its_own() -> None:
    # CPU 0 stays with the API process; 7 spare CPUs for 3 workers: 2 each, one left over.
    plan = split_cpus(list(range(8)), 3)
    assert plan == [WorkerCPUs([1, 2], 2), WorkerCPUs([3, 4], 2), WorkerCPUs([5, 6], 2)]
    assert split_cpus([4, 5, 6], 2, threads=1) == [WorkerCPUs([5], 1), WorkerCPUs([6], 1)]


def test_cpus_shared_when_there_are_too_few() -> None:
    # This machine: 2 CPUs for 1 prefill + 1 decode worker and the API process.
    plan = split_cpus([0, 1], 2)
    assert plan == [WorkerCPUs(None, 1), WorkerCPUs(None, 1)]
    assert describe(plan, ["prefill-0", "decode-0"]) == (
        "prefill-0: 1 thread(s) on shared CPUs; decode-0: 1 thread(s) on shared CPUs"
    )
    with pytest.raises(ValueError):
        split_cpus([0, 1], 0)
