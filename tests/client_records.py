"""A hypothesis strategy of client records, for checking the analysis against plain
reference versions of it on random runs: sends, token chunks, failures, classes and
unfinished requests drawn at random, with ties on purpose.

``dyadic=True`` draws every time as a multiple of 1/16 s, so that sums of durations are
exact whatever their order; with arbitrary floats two orders of one sum may differ in the
last bit.
"""

from __future__ import annotations

import hypothesis.strategies as st

from servelab.vocab import ClientRecord

T0 = 1000.0


def _seconds(dyadic: bool, hi: float) -> st.SearchStrategy[float]:
    if dyadic:
        return st.integers(0, int(hi * 16)).map(lambda k: k / 16)
    return st.floats(0.0, hi, allow_nan=False, allow_infinity=False)


@st.composite
def client_records(draw: st.DrawFn, max_size: int = 40, dyadic: bool = False) -> list:
    """Between 0 and ``max_size`` records sent over ~200 s."""
    n = draw(st.integers(0, max_size))
    out = []
    for i in range(n):
        intended = T0 + draw(_seconds(dyadic, 200.0))
        send = intended + draw(_seconds(dyadic, 2.0))
        n_chunks = draw(st.integers(0, 12))
        t = send + draw(_seconds(dyadic, 20.0))
        times = []
        for _ in range(n_chunks):
            times.append(t)
            t += draw(_seconds(dyadic, 3.0))
        tokens = [draw(st.integers(1, 3)) for _ in times]
        error = draw(st.sampled_from([None, None, None, "timeout: read", "http 500: boom"]))
        finished = draw(st.booleans()) or error is None
        done = (times[-1] if times else send) + draw(_seconds(dyadic, 1.0)) if finished else None
        out.append(
            ClientRecord(
                request_id=f"r{i}",
                workload_class=draw(st.sampled_from(["chat", "rag"])),
                intended_send=intended,
                actual_send=send,
                input_tokens=draw(st.sampled_from([1, 16, 200, 300, 1200, 5000])),
                output_tokens=sum(tokens),
                chunk_times=times,
                chunk_tokens=tokens,
                done=done,
                error=error,
                cached_tokens=draw(st.sampled_from([None, 0, 16])),
            )
        )
    return out
