"""The engine of a disaggregated worker: ``LLMEngine`` plus both halves of a KV hand-off.

``DisaggEngine`` adds to the engine, without changing its policy:

- **Prefill role.** ``step()`` runs the engine's step, then *parks* every request that just
  sampled its first token and is not finished: it leaves the scheduler's running list (so it
  never decodes here and is never preempted) but keeps its KV blocks and its detokenizer.
  ``take_parked()`` lists the newly parked requests; ``send_kv`` reads a parked request's
  blocks, hands them to a transport with their prefix-cache chain hashes, and then forgets the
  request and frees its blocks, whether or not the transport accepted them.
- **Decode role.** ``reserve_import`` validates a request exactly as ``add_request`` does and
  allocates its prompt's blocks (leading blocks this pool already caches are reused, not
  transferred), usually while the prefill worker is still computing it; ``commit_import``
  checks the transferred blocks' hashes, writes them, registers them in the prefix cache,
  adopts the prefill side's timeline and first token, and puts the request in the running
  list with that token pending, as if it had been prefilled here. The detokenizer is brought
  to the prefill side's state by replaying the first token, and seeded sampling continues at
  output index 1, so the output equals colocated serving.
- ``abort`` frees a parked request or a reservation like any other request.

Block accounting: a parked request or a reservation holds its blocks until sent, committed,
aborted or expired; once no request is unfinished, parked or reserved, every block has
reference count 0 (the engine's invariant).

It is a subclass that reaches the engine through its public hooks only: ``get_request``,
``detokenizer``, ``end_request``, ``forget_request``, the KV cache's ``chain_hashes`` and
``Scheduler.adopt_decoding``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from servelab.engine.engine import EngineStepResult, LLMEngine
from servelab.engine.engine_stats import EngineStats
from servelab.engine.kv.kv_cache_plain import KVCache
from servelab.engine.request import Request
from servelab.engine.sampling_params import SamplingParams
from servelab.server.disagg.wire import (
    Imported,
    ImportKV,
    KVHeader,
    Parked,
    Refused,
    Reserved,
    Sent,
)
from servelab.vocab import COLOCATED, FinishReason, Phase, RequestTimeline


class TransferError(RuntimeError):
    """A KV transfer could not be made; the message says why and what to do."""


@dataclass
class _Reservation:
    skip_blocks: int
    num_blocks: int  # blocks covering the prompt
    deadline: float


def chain_hashes(kv: KVCache, request_id: str, token_ids: list[int], n: int) -> list[int]:
    """The prefix cache's chain hashes of the first ``n`` full blocks of ``token_ids``.

    The KV cache's own function (the fast one memoises it per request), so both sides of a transfer
    agree with the cache that registers the blocks. Python hashes of int tuples do not depend
    on PYTHONHASHSEED, so they agree across processes of the same Python build.
    """
    return list(kv.chain_hashes(request_id, token_ids, n))


class DisaggEngine(LLMEngine):
    """An engine that can hand requests off after prefill, or take them over for decode.

    ``role`` is "colocated" (plain engine, e.g. during warm-up), "prefill" or "decode".
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.role = COLOCATED
        self._parked: dict[str, float] = {}  # request id -> when it was parked
        self._new_parked: list[str] = []
        self._reserved: dict[str, _Reservation] = {}

    # ---- both roles ----

    def abort(self, request_id: str) -> bool:
        self._parked.pop(request_id, None)
        self._reserved.pop(request_id, None)
        return super().abort(request_id)

    def stats(self) -> EngineStats:
        """The engine's stats, with parked and reserved requests counted as running: they
        hold KV blocks, so an engine reporting no running request holds no block."""
        st = super().stats()
        return dataclasses.replace(
            st, num_running=st.num_running + self.num_parked + self.num_reserved
        )

    def is_parked(self, request_id: str) -> bool:
        return request_id in self._parked

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def _held(self, request_id: str) -> Request:
        """A request this worker holds; KeyError if it is gone (aborted, expired)."""
        req = self.get_request(request_id)
        if req is None:
            raise KeyError(request_id)
        return req

    def fail_request(self, request_id: str, error: str) -> None:
        """End a parked or reserved request with ERROR (blocks freed, timeline kept)."""
        self._parked.pop(request_id, None)
        self._reserved.pop(request_id, None)
        req = self.get_request(request_id)
        if req is not None:
            req.timeline.error = error
            self.end_request(request_id, FinishReason.ERROR)

    def _move_blocks(self) -> Any:
        ex = self.executor
        if not (hasattr(ex, "read_blocks") and hasattr(ex, "write_blocks")):
            raise TransferError(
                f"{type(ex).__name__} cannot read or write KV blocks; disaggregated serving "
                "needs an executor with read_blocks/write_blocks (the torch model runner)"
            )
        return ex

    # ---- prefill role ----

    def step(self) -> EngineStepResult:
        result = super().step()
        if self.role == "prefill":
            for out in result.outputs:
                if not out.finished and out.new_token_ids:
                    self._park(out.request_id)
        return result

    def _park(self, request_id: str) -> None:
        req = self._held(request_id)
        self.scheduler.running.remove(req)
        self._parked[request_id] = self.clock()
        self._new_parked.append(request_id)

    def take_parked(self) -> list[Parked]:
        """The requests parked since the last call (still parked), with their hand-off data."""
        out = []
        for rid in self._new_parked:
            if rid not in self._parked:
                continue  # aborted in the meantime
            req = self._held(rid)
            out.append(
                Parked(
                    request_id=rid,
                    first_token=req.output_token_ids[0],
                    num_blocks=self.kv_cache.blocks_needed(req.num_prompt_tokens),
                    parked_at=self._parked[rid],
                    timeline=req.timeline.to_dict(),
                )
            )
        self._new_parked = []
        return out

    def send_kv(
        self,
        request_id: str,
        skip_blocks: int,
        send: Any,
        worker_index: int = 0,
        decode_worker: int = 0,
    ) -> Sent:
        """Send a parked request's blocks ``[skip_blocks:]``: ``send(header, blocks) -> bytes``.

        The request is forgotten and its blocks freed afterwards, also when ``send`` raises
        (TransferError propagates). Raises TransferError for a request that is not parked.
        """
        if request_id not in self._parked:
            raise TransferError(
                f"request {request_id!r} is not parked on this prefill worker (aborted?)"
            )
        try:
            start = self.clock()
            req = self._held(request_id)
            kv = self.kv_cache
            prompt = req.prompt_token_ids
            n = kv.blocks_needed(len(prompt))
            if not 0 <= skip_blocks < n:
                raise TransferError(
                    f"request {request_id!r}: cannot skip {skip_blocks} of its {n} blocks"
                )
            full = len(prompt) // kv.block_size
            hashes = chain_hashes(kv, request_id, prompt, full)[skip_blocks:]
            blocks = self._move_blocks().read_blocks(kv.block_table(request_id)[skip_blocks:n])
            header = KVHeader(
                request_id=request_id,
                first_token=req.output_token_ids[0],
                timeline=req.timeline.to_dict(),
                prefill_worker=worker_index,
                skip_blocks=skip_blocks,
                num_blocks=len(blocks),
                block_hashes=hashes,
                dtype=str(blocks[0].dtype).removeprefix("torch."),
                block_shape=list(blocks[0].shape),
                nbytes=sum(b.numel() * b.element_size() for b in blocks),
                sent_at=start,
            )
            nbytes = send(header, blocks)
            return Sent(request_id, decode_worker, nbytes, len(blocks), start, self.clock())
        finally:
            self._release(request_id)

    def _release(self, request_id: str) -> None:
        """Forget a handed-off request and free its blocks (its timeline lives on elsewhere)."""
        self._parked.pop(request_id, None)
        req = self._held(request_id)
        self.forget_request(request_id)
        req.phase = Phase.FINISHED

    # ---- decode role ----

    def reserve_import(self, msg: ImportKV, deadline: float) -> Reserved | Refused:
        """Get ready to take a request over: validate it and allocate its prompt's blocks.

        Refused with ``retry=True`` when the pool lacks room now (counting one block of
        growth per running request and the ``max_num_seqs`` cap); ``retry=False`` when the
        request itself is invalid here.
        """
        rid = msg.request_id
        try:
            self.add_request(
                rid,
                prompt_token_ids=msg.prompt_token_ids,
                sampling_params=SamplingParams(**msg.sampling),
                priority=msg.priority,
                arrival_time=msg.arrival_time,
            )
        except (TypeError, ValueError) as e:
            return Refused(rid, retry=False, error=str(e))
        req = self._held(rid)
        self.scheduler.waiting.remove(req)
        kv = self.kv_cache
        prompt = req.prompt_token_ids
        need = kv.blocks_needed(len(prompt))
        hit = kv.lookup(rid, prompt)
        revived = sum(1 for b in hit.blocks if kv.ref_count(b) == 0)
        take = need - len(hit.blocks) + revived
        busy = len(self.scheduler.running) + len(self._reserved)
        if (
            busy >= self.config.max_num_seqs
            or kv.num_free_blocks - take < len(self.scheduler.running)
            or not kv.allocate(rid, len(prompt), hit)
        ):
            self._forget_unadmitted(rid)
            return Refused(
                rid,
                retry=True,
                error=f"no room: {kv.num_free_blocks} free blocks, {busy} sequences",
            )
        self._reserved[rid] = _Reservation(len(hit.blocks), need, deadline)
        return Reserved(rid, len(hit.blocks), need)

    def _forget_unadmitted(self, request_id: str) -> None:
        self.forget_request(request_id)

    def commit_import(self, header: KVHeader, blocks: list[Any], received: float) -> Imported:
        """Write a reserved request's transferred blocks and start decoding it.

        Raises TransferError (after ending the request with ERROR and freeing its blocks)
        when the payload does not match the reservation or the hashes disagree, and
        KeyError for a request with no reservation (aborted or expired: ignore the payload).
        The request's timeline becomes the prefill side's (in the header), continued here.
        """
        rid = header.request_id
        res = self._reserved[rid]
        req = self._held(rid)
        kv = self.kv_cache
        prompt = req.prompt_token_ids
        full = len(prompt) // kv.block_size
        expected = chain_hashes(kv, rid, prompt, full)[res.skip_blocks :]
        problem = None
        if header.skip_blocks != res.skip_blocks or len(blocks) != res.num_blocks - res.skip_blocks:
            problem = (
                f"got blocks [{header.skip_blocks}:+{len(blocks)}], reserved "
                f"[{res.skip_blocks}:{res.num_blocks}]"
            )
        elif header.block_hashes != expected:
            problem = (
                "block hashes differ from this worker's (the blocks belong to other tokens, or "
                "the workers run different Python builds)"
            )
        if problem is not None:
            error = f"KV transfer of request {rid!r} rejected: {problem}"
            self.fail_request(rid, error)
            raise TransferError(error)
        table = kv.block_table(rid)
        self._move_blocks().write_blocks(table[res.skip_blocks : res.num_blocks], blocks)
        del self._reserved[rid]
        req.timeline = RequestTimeline.from_dict(header.timeline)
        req.timeline.decode_replica = self.replica
        first = header.first_token
        req.token_ids.append(first)
        detok = self.detokenizer(rid)
        if detok is not None:  # reach the prefill side's state; its text was sent from there
            detok.add(first, 1 >= req.sampling_params.min_tokens)
            detok.take(final=False)
        req.num_computed_tokens = len(prompt)
        kv.cache_blocks(rid, req.token_ids, len(prompt))
        self.scheduler.adopt_decoding(req)
        return Imported(rid, header.nbytes, len(blocks), received, self.clock())

    def expire_reservations(self, now: float) -> list[tuple[str, str]]:
        """End reservations whose transfer did not arrive by their deadline: (id, error)."""
        expired = [rid for rid, r in self._reserved.items() if r.deadline <= now]
        out = []
        for rid in expired:
            error = (
                f"the KV blocks of request {rid!r} did not arrive while its blocks were "
                "reserved (--kv-handoff-timeout + --kv-transfer-timeout); the prefill worker "
                "may be overloaded or gone"
            )
            self.fail_request(rid, error)
            out.append((rid, error))
        return out
