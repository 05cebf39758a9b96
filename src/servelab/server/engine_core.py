"""The engine-core process: owns the LLMEngine and runs its step loop.

Started by the API process as ``python -m servelab.server.engine_core`` with a CoreConfig (JSON)
on stdin. Contract:
- It connects to the API's two ZeroMQ channels, builds the engine, warms it up, then
  sends ``Ready`` (or ``StartupFailed`` and exits 1).
- The loop drains every pending input without blocking, then runs one ``engine.step()``
  while any request is unfinished. It blocks on input only when the engine is idle: it
  never waits on HTTP work, and HTTP work never waits on a step.
- Each iteration that did anything sends one ``StepBatch``: the outputs of the step,
  its StepRecord, the engine stats, and timing of the IPC and of the loop itself.
- A failed ``add_request`` becomes an error output for that request; a failed step is
  fatal (exit 1), because the engine's state is then unknown. The API process sees
  the exit and fails the in-flight requests.
- After work, at most every ``_TRIM_PERIOD_S``, it hands freed heap pages back to the OS
  (``malloc_trim``, 0.1-2 ms): each new prefill row count frees activations and oneDNN
  primitives of a new size, and glibc would keep that heap (docs/design/server.md, "Soak").
- It exits when told (``Shutdown``) or when the API process is gone.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from servelab.model import kernel_build
from servelab.server import ipc
from servelab.server.heap import MALLOC_TRIM, keep_step_buffers

log = logging.getLogger("servelab.server.engine_core")

_IDLE_POLL_MS = 500  # how often an idle core checks that the API process is still there
_STALL_POLL_MS = 10  # retry period when requests are unfinished but none could be scheduled
_WARMUP_PROMPT_TOKENS = 32
_WARMUP_OUTPUT_TOKENS = 4
_TRIM_PERIOD_S = 10.0


def build_engine(cfg: ipc.CoreConfig, engine_cls: type | None = None) -> Any:
    """The real engine (``engine_cls``, default LLMEngine): load the model with
    ``cfg.torch_threads`` torch threads."""
    import torch

    torch.set_num_threads(cfg.torch_threads)
    # The core is one Python thread driving torch; a second inter-op pool only competes for CPUs.
    torch.set_num_interop_threads(1)
    keep_step_buffers()
    from servelab.engine.engine_config import EngineConfig
    from servelab.model.build import build_engine as build_model_engine

    return build_model_engine(
        cfg.model,
        EngineConfig(**cfg.engine),
        device=cfg.device,
        engine_cls=engine_cls,
        quantization=cfg.quantization,
    )


def _load_factory(spec: str) -> Any:
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def _cpu_kernels() -> str:
    """``kernel_build.isa()`` where the model layer loaded servelab's CPU kernels in this
    process; "" for a simulated engine or a build that failed."""
    kernels = sys.modules.get("servelab.model.cpu_kernels")
    return kernel_build.isa() if kernels is not None and kernels.available() else ""


def stats_dict(engine: Any) -> dict[str, Any]:
    """The engine's EngineStats as a dict (what StepBatch and Ready carry)."""
    return dataclasses.asdict(engine.stats())


def _to_wire(out: Any) -> ipc.Output:
    reason = out.finish_reason.value if out.finish_reason is not None else None
    timeline = out.timeline.to_dict() if out.finished else None
    return ipc.Output(
        request_id=out.request_id,
        new_token_ids=list(out.new_token_ids),
        new_text=out.new_text,
        finished=out.finished,
        finish_reason=reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        timeline=timeline,
        error=out.timeline.error if out.finished and reason == "error" else None,
    )


class EngineCore:
    """The step loop around one engine (see the module docstring for the contract).

    Hooks for subclasses (the disaggregated workers): ``decode_input`` reads the input
    channel, ``_handle`` dispatches a message, ``extra_sockets`` wake an idle loop,
    ``idle_poll_ms`` bounds an idle wait, ``service`` runs once per iteration before the
    step (True if it did something), ``after_batch`` runs after the iteration's batch was
    sent, and ``ready_message`` is what announces the core.
    """

    decode_input = staticmethod(ipc.decode_input)

    def __init__(
        self, engine: Any, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.clock = time.monotonic
        self.busy = 0.0
        self.idle = 0.0
        self._stop = False
        self._pending: list[ipc.Output] = []  # outputs of rejected adds and of aborts
        self._add_delays: list[float] = []
        self._added_total = 0  # adds handled, accepted or not: lets the API count in-flight adds
        self._stepped = False  # a step ran since the last heap trim
        self._last_trim = float("-inf")

    def warm_up(self) -> None:
        """Run one short greedy request so first-request costs are paid before `ready`."""
        from servelab.engine.sampling_params import SamplingParams

        n = max(
            1, min(_WARMUP_PROMPT_TOKENS, self.engine.config.max_model_len - _WARMUP_OUTPUT_TOKENS)
        )
        params = SamplingParams(max_tokens=_WARMUP_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
        self.engine.add_request("servelab-warmup", prompt_token_ids=[0] * n, sampling_params=params)
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.reset_prefix_cache()

    def info(self, cfg: ipc.CoreConfig) -> ipc.CoreInfo:
        c = self.engine.config
        return ipc.CoreInfo(
            model=cfg.model,
            max_model_len=c.max_model_len,
            num_kv_blocks=c.num_kv_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            enable_chunked_prefill=c.enable_chunked_prefill,
            enable_prefix_caching=c.enable_prefix_caching,
            device=cfg.device or "auto",
            torch_threads=cfg.torch_threads,
            pid=os.getpid(),
            quantization=cfg.quantization,
            cpu_kernels=_cpu_kernels(),
            engine_config=dataclasses.asdict(c),
        )

    def ready_message(self, cfg: ipc.CoreConfig) -> Any:
        return ipc.Ready(self.info(cfg), stats_dict(self.engine))

    def extra_sockets(self) -> list[zmq.Socket]:
        return []

    def idle_poll_ms(self) -> int:
        return _IDLE_POLL_MS

    def service(self) -> bool:
        return False

    def after_batch(self) -> None:
        return None

    def run(self) -> None:
        poller = zmq.Poller()
        for sock in [self.inputs, *self.extra_sockets()]:
            poller.register(sock, zmq.POLLIN)
        stalled = False  # the last step ran nothing: wait for input rather than spin
        while not self._stop:
            if stalled or not self.engine.has_unfinished():
                t0 = self.clock()
                poller.poll(_STALL_POLL_MS if stalled else self.idle_poll_ms())
                self.idle += self.clock() - t0
                if os.getppid() != self.parent_pid:
                    log.warning("engine core: the API process is gone; exiting")
                    return
            t0 = self.clock()
            handled = self._drain_inputs()
            if self._stop:
                break
            handled = self.service() or handled
            outputs: list[ipc.Output] = []
            record = None
            if self.engine.has_unfinished():
                result = self.engine.step()
                outputs = [_to_wire(o) for o in result.outputs]
                record = result.record.to_dict() if result.record is not None else None
            stalled = record is None and not outputs and self.engine.has_unfinished()
            if handled or outputs or record is not None:
                self._send_batch(outputs, record)
            self.after_batch()
            self._stepped = self._stepped or record is not None
            self._trim_heap()
            self.busy += self.clock() - t0

    def _trim_heap(self) -> None:
        now = self.clock()
        if MALLOC_TRIM is not None and self._stepped and now - self._last_trim >= _TRIM_PERIOD_S:
            MALLOC_TRIM(0)
            self._stepped = False
            self._last_trim = now

    def _drain_inputs(self) -> bool:
        handled = False
        while True:
            try:
                data = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled = True
            self._handle(self.decode_input(data))

    def _handle(self, msg: ipc.InputMessage) -> None:
        if isinstance(msg, ipc.AddRequest):
            self._add(msg)
        elif isinstance(msg, ipc.Abort):
            for rid in msg.request_ids:
                if self.engine.abort(rid):
                    self._pending.append(self._aborted(rid))
        elif isinstance(msg, ipc.UtilityCall):
            self._utility(msg)
        elif isinstance(msg, ipc.Shutdown):
            self._stop = True

    def _add(self, msg: ipc.AddRequest) -> None:
        from servelab.engine.sampling_params import SamplingParams

        self._added_total += 1
        try:
            self.engine.add_request(
                msg.request_id,
                prompt_token_ids=msg.prompt_token_ids,
                sampling_params=SamplingParams(**msg.sampling),
                priority=msg.priority,
                arrival_time=msg.arrival_time,
            )
        except Exception as e:  # one bad request must not take the core down
            if not isinstance(e, ValueError):
                log.exception("engine core: add_request(%s) failed", msg.request_id)
            self._pending.append(
                ipc.Output(
                    msg.request_id,
                    [],
                    "",
                    True,
                    "error",
                    len(msg.prompt_token_ids),
                    0,
                    error=str(e),
                    error_status=400 if isinstance(e, ValueError) else 500,
                )
            )
            return
        self._add_delays.append(self.clock() - msg.arrival_time)

    def _aborted(self, request_id: str) -> ipc.Output:
        """The final output of an aborted request, so its timeline reaches /v1/timelines."""
        tl = self.engine.get_timeline(request_id)
        return ipc.Output(
            request_id, [], "", True, "abort", tl.prompt_tokens, tl.output_tokens, tl.to_dict()
        )

    def _utility(self, msg: ipc.UtilityCall) -> None:
        allowed = {"reset_prefix_cache": self.engine.reset_prefix_cache}
        fn = allowed.get(msg.method)
        if fn is None:
            reply = ipc.UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")
        else:
            try:
                reply = ipc.UtilityResult(msg.call_id, result=fn())
            except Exception as e:
                log.exception("engine core: %s failed", msg.method)
                reply = ipc.UtilityResult(msg.call_id, error=str(e))
        self.outputs.send(ipc.encode(reply))

    def _send_batch(self, outputs: list[ipc.Output], record: dict[str, Any] | None) -> None:
        if self._pending:
            outputs = self._pending + outputs
            self._pending = []
        batch = ipc.StepBatch(
            outputs=outputs,
            record=record,
            stats=stats_dict(self.engine),
            add_delays=self._add_delays,
            added_total=self._added_total,
            busy=self.busy,
            idle=self.idle,
            sent_at=time.monotonic(),
        )
        self._add_delays = []
        self.outputs.send(ipc.encode(batch))


def main() -> int:
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=ipc.CoreConfig)
    return run_core(cfg, EngineCore)


def run_core(cfg: ipc.CoreConfig, make_core: Callable[..., EngineCore]) -> int:
    """Connect, build the engine, warm up, announce, run the loop; return the exit status.

    ``make_core(engine, inputs, outputs, parent_pid)`` builds the loop (EngineCore or a
    subclass)."""
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # Ctrl-C reaches the whole process group; the API process decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_pid = os.getppid()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    outputs = ctx.socket(zmq.PUSH)
    inputs.setsockopt(zmq.LINGER, 0)
    # Long enough to deliver a StartupFailed; an exit with the API gone waits at most this.
    outputs.setsockopt(zmq.LINGER, 2000)
    inputs.connect(cfg.inputs_addr)
    outputs.connect(cfg.outputs_addr)
    try:
        log.info("engine core: loading %s (%d torch threads)", cfg.model, cfg.torch_threads)
        t0 = time.monotonic()
        engine = _load_factory(cfg.engine_factory)(cfg)
        core = make_core(engine, inputs, outputs, parent_pid)
        c = engine.config
        log.info(
            "engine core: model ready in %.1f s; KV pool %d blocks x %d tokens "
            "(%d tokens), max_model_len %d",
            time.monotonic() - t0,
            c.num_kv_blocks,
            c.block_size,
            c.num_kv_blocks * c.block_size,
            c.max_model_len,
        )
        t0 = time.monotonic()
        core.warm_up()
        log.info("engine core: warm-up done in %.2f s", time.monotonic() - t0)
        outputs.send(ipc.encode(core.ready_message(cfg)))
    except Exception as e:  # noqa: BLE001 -- every start-up failure goes back to the API
        log.debug("engine core: start-up failed\n%s", traceback.format_exc())
        outputs.send(ipc.encode(ipc.StartupFailed(f"{type(e).__name__}: {e}")))
        ctx.destroy()
        return 1
    try:
        core.run()
    except Exception:
        log.exception("engine core: the step loop failed; exiting")
        return 1
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
