"""servelab's CPU kernels agree with torch: the linear product and paged attention."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from servelab.model import cpu_kernels, kernel_build

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built here")


# 8-32 rows take the broadcast tiles on AVX-512 (16 or 32 lanes of rows: 16, 17 and 32 are
# their edges), fewer the dot-product tiles.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 32])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (53, 37), (192, 576)])
def test_linear_matches_torch(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = (torch.randn(s, generator=g) for s in ((m, k), (n, k), (n,)))
    torch.testing.assert_close(cpu_kernels.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu_kernels.linear(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-4)
    res = torch.randn(m, n, generator=g)
    want = res + x @ w.T
    got = cpu_kernels.linear(x, w, residual=res.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("n_q", "n_kv", "d"), [(9, 3, 64), (4, 4, 16), (8, 1, 32), (12, 2, 64), (8, 2, 64), (4, 2, 128)]
)
def test_paged_attention_matches_sdpa(
    prefill: bool, threads: int, n_q: int, n_kv: int, d: int
) -> None:
    """Sequences of different lengths, blocks scattered through the pool, several query
    tokens for one sequence (drafts), a whole prompt and a chunk over cached context (runs
    that span several 16-token tiles and key blocks): each query sees exactly its causal
    prefix, in both kernels."""
    if prefill and not cpu_kernels.prefill_attention_available():
        pytest.skip("the tiled prefill kernel is built for AVX-512 only")
    cpu_kernels.set_num_threads(threads)
    g = torch.Generator().manual_seed(n_q * 100 + d)
    bs, num_blocks = 4, 64
    k_cache = torch.randn(num_blocks, bs, n_kv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, n_kv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # (context length incl. new tokens, queries)
    seqs = [(1, 1), (13, 1), (22, 5), (40, 1), (37, 37), (90, 53)]
    tables, rows, seq, pos, refs = [], [], [], [], []
    width = max(-(-c // bs) for c, _ in seqs)
    q = torch.randn(sum(n for _, n in seqs), n_q + n_kv, d, generator=g)[:, :n_q]  # strided
    t = 0
    for i, (ctx, n) in enumerate(seqs):
        table = [perm.pop() for _ in range(-(-ctx // bs))]
        tables.append(table + [0] * (width - len(table)))
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
        keys = k_cache.view(-1, n_kv, d)[slots].transpose(0, 1)  # [n_kv, ctx, d]
        vals = v_cache.view(-1, n_kv, d)[slots].transpose(0, 1)
        for j in range(n):
            p = ctx - n + j
            rows.append(t)
            seq.append(i)
            pos.append(p)
            ref = F.scaled_dot_product_attention(
                q[t].unsqueeze(1), keys[:, : p + 1], vals[:, : p + 1], enable_gqa=True
            )
            refs.append(ref.squeeze(1))
            t += 1
    out = torch.full((t, n_q, d), float("nan"))
    as_int = {"dtype": torch.int32}
    cpu_kernels.paged_attention(
        q, k_cache, v_cache, out, torch.tensor(rows, **as_int), torch.tensor(seq, **as_int),
        torch.tensor(pos, **as_int), torch.tensor(tables, **as_int), prefill=prefill,
    )  # fmt: skip
    torch.testing.assert_close(out, torch.stack(refs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_glue_kernels_match_torch(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """RMSNorm (strided rows), SwiGLU and RoPE + cache store: kernel vs torch path."""
    from servelab.model import ops
    from servelab.model.rope import rope_table
    from servelab.modelcore.config import ModelConfig

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2, 72, generator=g)[:, 1]  # rows 144 floats apart
    w = torch.randn(72, generator=g)
    torch.testing.assert_close(
        cpu_kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (72,), w, 1e-5), rtol=1e-5, atol=1e-5
    )
    gu = torch.randn(rows, 2 * 44, generator=g) * 4
    ref = F.silu(gu[:, :44]) * gu[:, 44:]
    torch.testing.assert_close(cpu_kernels.silu_mul(gu), ref, rtol=1e-5, atol=1e-5)

    n_q, n_kv, d = 6, 2, 32
    cfg = ModelConfig("llama", 100, n_q * d, 64, 1, n_q, n_kv, d, max_position_embeddings=256)
    rotary = ops.Rotary(rope_table(cfg, 256, "cpu"), torch.randint(0, 256, (rows,), generator=g))
    slots = torch.randperm(64, generator=g)[:rows]
    qkv = torch.randn(rows, (n_q + 2 * n_kv) * d, generator=g)
    results = []
    for on in (True, False):
        monkeypatch.setattr(cpu_kernels, "enabled", on)
        kv = (torch.zeros(16, 4, n_kv, d), torch.zeros(16, 4, n_kv, d))
        q, k, v = ops.rotate_and_store(qkv.clone(), n_q, n_kv, rotary, kv, slots)
        results.append((q, k, v, *kv))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_isa_can_be_forced_to_avx2_and_refuses_unknown_names(monkeypatch) -> None:
    monkeypatch.setenv("SERVELAB_CPU_ISA", "avx2")
    assert kernel_build.isa() == "avx2"
    # Narrower than the CPU has is taken; wider is not (it would fault on its first use).
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: "flags : avx2 fma f16c avx512f")
    monkeypatch.setenv("SERVELAB_CPU_ISA", "avx512vnni")
    assert kernel_build.isa() == "avx512"
    monkeypatch.setenv("SERVELAB_CPU_ISA", "avx512")
    assert kernel_build.isa() == "avx512"
    # bf16 dots need AVX512-BF16 with BW and VL beside VNNI; forced down, VNNI stays.
    zen4 = "flags : avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16"
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: zen4)
    monkeypatch.delenv("SERVELAB_CPU_ISA")
    assert kernel_build.isa() == "avx512bf16"
    monkeypatch.setenv("SERVELAB_CPU_ISA", "avx512vnni")
    assert kernel_build.isa() == "avx512vnni"
    monkeypatch.setattr(kernel_build, "_cpu_flags", lambda: zen4.replace(" avx512vl", ""))
    monkeypatch.delenv("SERVELAB_CPU_ISA")
    assert kernel_build.isa() == "avx512vnni"
    monkeypatch.setenv("SERVELAB_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="SERVELAB_CPU_ISA='sse9'"):
        kernel_build.isa()


@pytest.mark.skipif(kernel_build.isa() == "avx2", reason="the suite already runs the AVX2 build")
def test_the_avx2_build_passes_the_kernel_tests_too() -> None:
    # The suite runs the widest build this CPU has; CPUs without AVX-512 run the AVX2 one,
    # so its products are checked here against the same references.
    here = Path(__file__).parent
    files = [str(here / "test_cpu_kernels.py"), str(here / "test_quant_kernels.py")]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        env={**os.environ, "SERVELAB_CPU_ISA": "avx2"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    # one "." per passed test; this test itself is the one skip (the child builds AVX2)
    assert r.stdout.count(".") > 50 and r.stdout.count("s") >= 1
