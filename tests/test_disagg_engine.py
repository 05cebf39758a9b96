"""The KV hand-off inside one process: a prefill and a decode ``DisaggEngine`` on the tiny
random Llama, moving blocks through the real transports (shared memory and TCP).

Checks that the hand-off is invisible in the output (greedy, seeded sampling, stop strings),
that the KV blocks arrive bit for bit, that the decode side's prefix cache works on
transferred blocks, and that every failure path frees the blocks on both sides.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from servelab.engine.engine_config import EngineConfig
from servelab.engine.sampling_params import SamplingParams
from servelab.model.llm import LLM
from servelab.model.loader import LoadedModel, load_model
from servelab.model.torch_runner import TorchModelRunner
from servelab.server.disagg import shm
from servelab.server.disagg.transport import Received, make_receiver, make_sender
from servelab.server.disagg.wire import (
    ImportKV,
    Parked,
    Refused,
    Reserved,
    decode_header,
)
from servelab.server.disagg.worker_engine import DisaggEngine, TransferError
from servelab.vocab import FinishReason

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefill computes the prompt; decode produces one token per step.",
    "A paged KV cache stores keys and values in fixed-size blocks. " * 3,
    "Hello world!",
    "Numbers like 12345 and 3.14159 are split into digits.",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), device="cpu")


def engine(loaded: LoadedModel, role: str = "colocated", **cfg: Any) -> DisaggEngine:
    cfg.setdefault("block_size", 4)
    cfg.setdefault("num_kv_blocks", 256)
    runner = TorchModelRunner(loaded, device="cpu", num_threads=1, seed=0)
    e = DisaggEngine(runner, EngineConfig(**cfg), tokenizer=loaded.tokenizer)
    e.role = role
    return e


class Pair:
    """A prefill and a decode engine joined by a transport, driven step by step here."""

    def __init__(self, loaded: LoadedModel, transport: str, kv_dir: Path, **cfg: Any) -> None:
        p_cfg, d_cfg = cfg.pop("prefill", {}), cfg.pop("decode", {})
        self.p = engine(loaded, "prefill", **{**cfg, **p_cfg})
        self.d = engine(loaded, "decode", **{**cfg, **d_cfg})
        self.ctx = zmq.Context()
        self.session = uuid.uuid4().hex[:8]
        self.receiver = make_receiver(
            transport, self.ctx, host="127.0.0.1", kv_dir=str(kv_dir), name="d0"
        )
        self.sender = make_sender(transport, self.ctx, session=self.session, worker=0, timeout=5.0)
        self.tokens: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.finished: dict[str, Any] = {}
        self.reserved: dict[str, Reserved] = {}

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.ctx.destroy(linger=0)

    def add(self, rid: str, prompt: list[int], sp: SamplingParams) -> None:
        self.p.add_request(rid, prompt_token_ids=prompt, sampling_params=sp)
        self.tokens[rid], self.texts[rid] = [], ""

    def _collect(self, outputs: list[Any]) -> None:
        for out in outputs:
            self.tokens[out.request_id] += out.new_token_ids
            self.texts[out.request_id] += out.new_text
            if out.finished:
                self.finished[out.request_id] = out

    def prefill(self) -> list[Parked]:
        """Step the prefill engine until every request is parked or finished."""
        parked = []
        while self.p.has_unfinished():
            self._collect(self.p.step().outputs)
            parked += self.p.take_parked()
        return parked

    def reserve(self, parked: Parked, sp: SamplingParams) -> Reserved | Refused:
        prompt = self.p.get_request(parked.request_id).prompt_token_ids
        msg = ImportKV(parked.request_id, prompt, sp.__dict__, 0, parked.timeline["arrival"], 0)
        return self.d.reserve_import(msg, deadline=1e18)

    def send(self, rid: str, skip: int) -> None:
        self.p.send_kv(rid, skip, lambda h, b: self.sender.send(self.receiver.address, h, b))

    def receive(self) -> Received:
        assert self.receiver.socket.poll(10_000), "no KV payload arrived"
        got = self.receiver.receive()
        assert len(got) == 1
        return got[0]

    def hand_off(self, parked: Parked, sp: SamplingParams) -> Reserved:
        res = self.reserve(parked, sp)
        assert isinstance(res, Reserved), res
        self.send(parked.request_id, res.skip_blocks)
        payload = self.receive()
        try:
            assert payload.error is None
            self.d.commit_import(payload.header, payload.blocks, payload.received_at)
        finally:
            payload.release()
        return res

    def decode(self) -> None:
        while self.d.has_unfinished():
            self._collect(self.d.step().outputs)

    def run(self, prompts: list[list[int]], sps: list[SamplingParams]) -> dict[str, Reserved]:
        for i, (prompt, sp) in enumerate(zip(prompts, sps)):
            self.add(f"r{i}", prompt, sp)
        done = {}
        for parked in self.prefill():
            done[parked.request_id] = self.hand_off(parked, sps[int(parked.request_id[1:])])
        self.decode()
        return done

    def assert_clean(self) -> None:
        for e in (self.p, self.d):
            assert e.stats().kv_blocks_used == 0
            assert e.num_parked == 0 and e.num_reserved == 0
            e.kv_cache.check_invariants()
        assert not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{self.session}-*"))


@pytest.fixture(params=["shm", "socket"])
def pair_factory(
    request: pytest.FixtureRequest, tiny: LoadedModel, tmp_path: Path
) -> Iterator[Any]:
    made: list[Pair] = []

    def make(**cfg: Any) -> Pair:
        made.append(Pair(tiny, request.param, tmp_path, **cfg))
        return made[-1]

    yield make
    for p in made:
        p.close()


def colocated(
    loaded: LoadedModel, prompts: list[list[int]], sps: list[SamplingParams], **cfg: Any
) -> list[Any]:
    return LLM.from_engine(engine(loaded, **cfg)).generate(prompts, sps)


def test_greedy_tokens_and_text_equal_colocated(tiny: LoadedModel, pair_factory: Any) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in TEXTS]
    sps = [GREEDY] * len(prompts)
    pair = pair_factory(max_num_batched_tokens=16)  # chunked prefill on the prefill side
    pair.run(prompts, sps)
    ref = colocated(tiny, prompts, sps)
    for i, r in enumerate(ref):
        assert pair.tokens[f"r{i}"] == r.token_ids
        assert pair.texts[f"r{i}"] == r.text
        tl = pair.finished[f"r{i}"].timeline
        assert tl.output_tokens == 12 and len(tl.token_times) == 12
        assert tl.first_token is not None and tl.chunks  # the prefill side's record continues
    pair.assert_clean()


def test_seeded_sampling_and_stop_strings_equal_colocated(
    tiny: LoadedModel, pair_factory: Any
) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in TEXTS[:3]]
    ref_text = colocated(tiny, prompts[:1], [GREEDY])[0].text
    stop = ref_text[len(ref_text) // 2 : len(ref_text) // 2 + 2]
    sps = [
        SamplingParams(max_tokens=10, temperature=0.9, seed=7),
        SamplingParams(max_tokens=10, temperature=0.8, top_k=20, seed=3, min_tokens=4),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]),
    ]
    prompts = [prompts[1], prompts[2], prompts[0]]
    pair = pair_factory()
    pair.run(prompts, sps)
    for i, r in enumerate(colocated(tiny, prompts, sps)):
        assert pair.tokens[f"r{i}"] == r.token_ids
        assert pair.texts[f"r{i}"] == r.text
        assert pair.finished[f"r{i}"].finish_reason == r.finish_reason
    assert pair.finished["r2"].finish_reason is FinishReason.STOP
    pair.assert_clean()


def test_speculative_decoding_on_the_decode_side_keeps_the_output(
    tiny: LoadedModel, pair_factory: Any
) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in TEXTS]
    sps = [GREEDY] * len(prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    pair = pair_factory(speculative_config=spec)
    pair.run(prompts, sps)
    for i, r in enumerate(colocated(tiny, prompts, sps)):
        assert pair.tokens[f"r{i}"] == r.token_ids
    assert sum(s.spec_proposed for s in pair.d.step_records) > 0  # it did speculate
    pair.assert_clean()


def test_large_prompt_kv_arrives_exactly(tiny: LoadedModel, pair_factory: Any) -> None:
    prompt = (tiny.tokenizer.encode(" ".join(TEXTS)) * 40)[:1500]
    pair = pair_factory(block_size=16, num_kv_blocks=200, max_num_batched_tokens=512)
    pair.add("big", prompt, GREEDY)
    (parked,) = pair.prefill()
    assert parked.num_blocks == 94  # ceil(1500 / 16): the last block is partial
    p_blocks = pair.p.executor.read_blocks(pair.p.kv_cache.block_table("big")[:94])
    res = pair.reserve(parked, GREEDY)
    assert isinstance(res, Reserved) and res.skip_blocks == 0
    pair.send("big", 0)
    assert pair.p.stats().kv_blocks_used == 0  # sent and freed on the prefill side
    payload = pair.receive()
    assert payload.header.nbytes == 94 * p_blocks[0].numel() * 4
    pair.d.commit_import(payload.header, payload.blocks, payload.received_at)
    payload.release()
    d_blocks = pair.d.executor.read_blocks(pair.d.kv_cache.block_table("big")[:94])
    assert all(torch.equal(a, b) for a, b in zip(p_blocks[:-1], d_blocks[:-1]))
    tail = 1500 - 93 * 16
    assert torch.equal(p_blocks[-1][:, :, :tail], d_blocks[-1][:, :, :tail])
    pair.decode()
    ref = colocated(tiny, [prompt], [GREEDY], block_size=16, num_kv_blocks=200)
    assert pair.tokens["big"] == ref[0].token_ids
    pair.assert_clean()


def test_shared_prefix_hits_the_decode_side_cache(tiny: LoadedModel, pair_factory: Any) -> None:
    system = tiny.tokenizer.encode("A paged KV cache stores keys and values in blocks. " * 2)
    prompts = [system + tiny.tokenizer.encode(t) for t in TEXTS[:2]]
    pair = pair_factory()
    pair.add("first", prompts[0], GREEDY)
    (parked,) = pair.prefill()
    first = pair.hand_off(parked, GREEDY)
    pair.decode()
    pair.add("second", prompts[1], GREEDY)
    (parked,) = pair.prefill()
    second = pair.hand_off(parked, GREEDY)
    pair.decode()
    assert first.skip_blocks == 0
    assert second.skip_blocks == len(system) // 4  # every full block of the shared prefix
    assert pair.d.stats().prefix_cache_hits == second.skip_blocks * 4
    assert pair.tokens["second"] == colocated(tiny, prompts[1:], [GREEDY])[0].token_ids
    pair.assert_clean()


def test_aborts_free_blocks_on_both_sides(tiny: LoadedModel, pair_factory: Any) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in TEXTS[:3]]
    pair = pair_factory()
    for i, p in enumerate(prompts):
        pair.add(f"r{i}", p, GREEDY)
    parked = pair.prefill()
    assert pair.p.num_parked == 3 and pair.p.stats().kv_blocks_used > 0
    # r0: aborted while parked on the prefill side
    assert pair.p.abort("r0")
    # r1: aborted on the decode side between reservation and payload; the payload is ignored
    assert isinstance(pair.reserve(parked[1], GREEDY), Reserved)
    assert pair.d.abort("r1")
    pair.send("r1", 0)
    payload = pair.receive()
    with pytest.raises(KeyError):
        pair.d.commit_import(payload.header, payload.blocks, payload.received_at)
    payload.release()
    # r2: aborted while decoding
    pair.hand_off(parked[2], GREEDY)
    pair._collect(pair.d.step().outputs)
    assert pair.d.abort("r2")
    pair.assert_clean()


def test_failed_transfers_end_the_request_and_free_blocks(
    tiny: LoadedModel, pair_factory: Any
) -> None:
    prompts = [tiny.tokenizer.encode(t) for t in TEXTS[:3]]
    pair = pair_factory()
    for i, p in enumerate(prompts):
        pair.add(f"r{i}", p, GREEDY)
    parked = pair.prefill()
    # r0: the payload never comes; the reservation expires
    msg = pair.reserve(parked[0], GREEDY)
    assert isinstance(msg, Reserved)
    pair.d._reserved["r0"].deadline = 0.0
    (expired,) = pair.d.expire_reservations(now=1.0)
    assert expired[0] == "r0" and "did not arrive" in expired[1]
    assert pair.d.get_timeline("r0").finish_reason is FinishReason.ERROR
    pair.p.abort("r0")  # what the router does on the other side
    # r1: the blocks belong to other tokens (hash mismatch)
    assert isinstance(pair.reserve(parked[1], GREEDY), Reserved)
    pair.send("r1", 0)
    payload = pair.receive()
    payload.header.block_hashes = [h + 1 for h in payload.header.block_hashes]
    with pytest.raises(TransferError, match="hashes differ"):
        pair.d.commit_import(payload.header, payload.blocks, payload.received_at)
    payload.release()

    # r2: the transport refuses; the prefill side frees its blocks anyway
    def broken(header: Any, blocks: Any) -> int:
        raise TransferError("link down")

    with pytest.raises(TransferError, match="link down"):
        pair.p.send_kv("r2", 0, broken)
    with pytest.raises(TransferError, match="not parked"):
        pair.p.send_kv("r2", 0, broken)
    pair.assert_clean()


def test_full_decode_pool_refuses_then_accepts(tiny: LoadedModel, pair_factory: Any) -> None:
    prompt = tiny.tokenizer.encode(TEXTS[2])  # 21 blocks of 4
    pair = pair_factory(decode={"num_kv_blocks": 24}, max_num_batched_tokens=64)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pair.add("a", prompt, sp)
    pair.add("b", prompt[::-1], sp)  # no shared prefix: needs 21 blocks of its own
    pa, pb = pair.prefill()
    pair.hand_off(pa, sp)
    refused = pair.reserve(pb, sp)
    assert isinstance(refused, Refused) and refused.retry and "no room" in refused.error
    assert pair.d.get_request("b") is None and pair.p.num_parked == 1  # nothing dropped
    pair.decode()  # "a" finishes and frees its blocks (cached, evictable)
    pair.hand_off(pb, sp)
    pair.decode()
    assert set(pair.finished) == {"a", "b"}
    pair.assert_clean()


def test_invalid_import_is_refused_without_retry(tiny: LoadedModel, pair_factory: Any) -> None:
    pair = pair_factory(decode={"max_model_len": 20})
    pair.add("long", tiny.tokenizer.encode(TEXTS[2]), GREEDY)
    (parked,) = pair.prefill()
    refused = pair.reserve(parked, GREEDY)
    assert isinstance(refused, Refused) and not refused.retry and "max_model_len" in refused.error
    pair.p.abort("long")
    pair.assert_clean()


def test_shm_sender_removes_segments_nobody_read(tmp_path: Path) -> None:
    ctx = zmq.Context()
    session = uuid.uuid4().hex[:8]
    receiver = make_receiver("shm", ctx, host="", kv_dir=str(tmp_path), name="d9")
    sender = make_sender("shm", ctx, session=session, worker=3, timeout=0.0)
    try:
        from servelab.server.disagg.wire import KVHeader

        blocks = [torch.arange(12, dtype=torch.float32).view(3, 4)] * 2
        header = KVHeader("x", 7, {}, 3, 0, 2, [], "float32", [3, 4], 96, 0.0)
        sender.send(receiver.address, header, blocks)
        (segment,) = shm.SHM_DIR.glob(f"{shm.PREFIX}{session}-3-*")
        sender.housekeeping(now=float("inf"))
        assert not segment.exists()
        assert receiver.socket.poll(5000)
        (got,) = receiver.receive()  # the receiver comes too late: a clear error, no crash
        assert got.error is not None and "unreadable" in got.error
    finally:
        sender.close()
        receiver.close()
        ctx.destroy(linger=0)
    assert shm.remove_session(session) == 0
    assert os.path.isdir(shm.SHM_DIR)


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_a_busy_link_backlogs_transfers_instead_of_failing_them(
    transport: str, tmp_path: Path
) -> None:
    """More transfers than ZeroMQ queues (one step can park that many) all arrive, in order,
    once the receiver is there; a backlog older than the transfer timeout is dropped."""
    from servelab.server.disagg.transport import _SEND_HWM
    from servelab.server.disagg.wire import KVHeader

    ctx = zmq.Context()
    session = uuid.uuid4().hex[:8]
    n = _SEND_HWM + 36
    blocks = [torch.arange(12, dtype=torch.float32).view(3, 4)] * 2
    # The receiver is not there yet, so nothing leaves ZeroMQ's queue: a socket bound later
    # stands in for a receiver that is slow to read (ZeroMQ carries both transports' frames
    # the same way over ipc:// and tcp://).
    address = f"ipc://{tmp_path}/kv-late"

    def header(rid: str, seq: int) -> KVHeader:
        return KVHeader(rid, seq, {}, 3, 0, 2, [], "float32", [3, 4], 96, 0.0)

    sender = make_sender(transport, ctx, session=session, worker=0, timeout=60.0)
    try:
        for i in range(n):
            sender.send(address, header(f"r{i}", i), blocks)
        assert sender.backlog == n - _SEND_HWM
        receiver = ctx.socket(zmq.PULL)
        receiver.bind(address)
        got: list[str] = []
        deadline = time.monotonic() + 30
        while len(got) < n and time.monotonic() < deadline:
            sender.housekeeping(time.monotonic())
            if receiver.poll(10):
                got.append(decode_header(receiver.recv_multipart()[0]).request_id)
        assert got == [f"r{i}" for i in range(n)] and sender.backlog == 0
        receiver.close(linger=0)
        # A receiver that never reads: past the timeout, the backlog is let go.
        late = f"ipc://{tmp_path}/kv-never"
        for i in range(n):
            sender.send(late, header(f"x{i}", i), blocks)
        assert sender.backlog == n - _SEND_HWM
        sender.housekeeping(now=float("inf"))
        assert sender.backlog == 0
    finally:
        sender.close()
        ctx.destroy(linger=0)
    shm.remove_session(session)
