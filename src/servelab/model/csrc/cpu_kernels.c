// Decode-shaped CPU kernels (fp32, AVX2 + FMA, OpenMP), called through ctypes.
//
// Why they exist: decode multiplies a few rows by every weight, so each step should cost
// one streaming read of the weights. OpenBLAS's GEMV gets ~14 GB/s here and its GEMM for
// 2-32 rows is several times slower than that; attention over a paged cache through
// torch needs a gather of every block per layer. These kernels read each weight and each
// cached K/V row once per step, straight from where it lives.
//
// Contracts (all arrays row-major, fp32 unless said):
// sl_linear: y[m, n] = x[m, k] . w[n, k]^T (+ b[n] when b != NULL); add != 0 adds to y.
// sl_paged_attention: for each of N query tokens t, the batch row rows[t] of q (row stride
//   q_stride floats, heads contiguous) attends causally to positions 0..pos[t] of sequence
//   seq[t], whose block table is tables[seq[t] * table_stride ...]; K/V of position p live
//   at cache[(table[p / bs] * bs + p % bs) * n_kv * d + h * d ...]. The result goes to row
//   rows[t] of out ([rows, n_q, d], contiguous).
// sl_qlinear: sl_linear with w in GGUF blocks (Q8_0 or Q4_1, see below), or those blocks
//   interleaved by 16 rows (kinds 3 and 4, built with -DSL_VNNI); sl_dequantize writes
//   such a matrix out as fp32; sl_int8_dot says whether kinds 3 and 4 are built, and
//   sl_bf16_dot whether kind 6 (bf16, interleaved by 16 rows) is.
// sl_decoder_stack: every decoder layer of a few-token batch in one call (see its comment).
//
// Built with -DSL_AVX512 (kernel_build.isa(): CPUs with AVX-512F), the fp32 tiles and the
// dequantisation of quantised blocks run in 16 lanes; the rest is the AVX2 code either way.
// -DSL_VNNI (with AVX512-VNNI) adds the integer-dot products of interleaved blocks;
// -DSL_BF16 (with AVX512-BF16) the bf16 products of bf16 weights interleaved by 16 rows.
//
// Each kernel's body is a function with an orphaned `omp for`: called from sl_<name> it
// runs in that call's own parallel region; called from sl_decoder_stack it shares the
// stack's one region, so a layer costs barriers between phases instead of thread wake-ups.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The horizontal sums of four vectors, as lanes 0-3: three hadds and one add instead of
// four separate reductions (with k = 576 those were ~20% of a 4 x 3 tile's time).
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#ifdef SL_AVX512
// The two 8-lane halves of a 16-lane vector, added (AVX-512F only: no DQ extract).
static inline __m256 fold16(__m512 v) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}
#endif

// One tile: R (2 or 4) input rows against C weight rows, R * C accumulators held in
// registers (always inlined with constant R and C, so the arrays become registers).
static inline __attribute__((always_inline)) void tile(const float *x, int64_t k,
                                                        const float *w, float *y, int64_t ldy,
                                                        const int R, const int C, int add) {
    __m256 acc[4][4];
    int64_t i = 0;
#ifdef SL_AVX512
    // 16 lanes a step where the CPU has them (twice the FMAs of AVX2 on cores with 512-bit
    // FMA units), then the accumulators fold to 8 lanes for the AVX2 tail and the sums.
    __m512 acc16[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc16[r][c] = _mm512_setzero_ps();
    for (; i + 16 <= k; i += 16) {
        __m512 wv[4];
        // The next tile's weight rows into L2, as in bcast_tile (a 4-row product over 393 MB
        // of weights: 25 ms without, 18 ms with).
        for (int c = 0; c < C; c++)
            _mm_prefetch((const char *)(w + (C + c) * k + i), _MM_HINT_T1);
        for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_ps(w + c * k + i);
        for (int r = 0; r < R; r++) {
            __m512 u = _mm512_loadu_ps(x + r * k + i);
            for (int c = 0; c < C; c++) acc16[r][c] = _mm512_fmadd_ps(wv[c], u, acc16[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = fold16(acc16[r][c]);
#else
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
#endif
    for (; i + 8 <= k; i += 8) {
        __m256 wv[4];
        for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + c * k + i);
        for (int r = 0; r < R; r++) {
            __m256 u = _mm256_loadu_ps(x + r * k + i);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(wv[c], u, acc[r][c]);
        }
    }
    if (i == k && C == 4) {  // a row's four outputs are adjacent in y
        for (int r = 0; r < R; r++) {
            __m128 s = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
            float *yr = y + r * ldy;
            _mm_storeu_ps(yr, add ? _mm_add_ps(_mm_loadu_ps(yr), s) : s);
        }
        return;
    }
    if (i == k && R == 4) {  // a column's four outputs, ldy apart
        for (int c = 0; c < C; c++) {
            float s[4];
            _mm_storeu_ps(s, hsum4(acc[0][c], acc[1][c], acc[2][c], acc[3][c]));
            for (int r = 0; r < 4; r++) y[r * ldy + c] = add ? y[r * ldy + c] + s[r] : s[r];
        }
        return;
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = hsum(acc[r][c]);
            for (int64_t j = i; j < k; j++) s += x[r * k + j] * w[c * k + j];
            y[r * ldy + c] = add ? y[r * ldy + c] + s : s;
        }
}

// x . w over k: for one input row the product is bandwidth-bound, and walking one weight
// row at a time keeps the read a single sequential stream (4-row tiles interleave four:
// 4-9% less bandwidth over a 450 MB matrix here). Four accumulators cover the FMA latency.
static inline float dot(const float *x, const float *w, int64_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) s += x[i] * w[i];
    return s;
}

// Weight rows [j0, j1) against all m input rows: 4-row input tiles against 3 weight rows
// (12 accumulators), then pairs of rows against 4 weight rows, a last row one weight row at
// a time (dot). add: y += x.w^T.
static void linear_block(const float *x, const float *w, float *y, int64_t m, int64_t n,
                         int64_t k, int64_t j0, int64_t j1, int add) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
        int64_t j = j0;
        for (; j + 3 <= j1; j += 3) tile(x + r * k, k, w + j * k, y + r * n + j, n, 4, 3, add);
        for (; j < j1; j++) tile(x + r * k, k, w + j * k, y + r * n + j, n, 4, 1, add);
    }
    for (; r < m; r += (m - r >= 2 ? 2 : 1)) {
        const int R = m - r >= 2 ? 2 : 1;
        int64_t j = j0;
        if (R == 2) {
            for (; j + 4 <= j1; j += 4) tile(x + r * k, k, w + j * k, y + r * n + j, n, 2, 4, add);
            for (; j < j1; j++) tile(x + r * k, k, w + j * k, y + r * n + j, n, 2, 1, add);
        } else {
            for (; j < j1; j++) {
                float d = dot(x + r * k, w + j * k, k);
                y[r * n + j] = add ? y[r * n + j] + d : d;
            }
        }
    }
}

#ifdef SL_AVX512
// ---- 8 to 32 rows: the inputs transposed, each weight broadcast -------------------------
// The tiles above reduce along k inside each vector, so every FMA needs a vector of x and
// one of w: from 8 rows on, twelve accumulators' operand loads (x from L2: 32 rows of k =
// 1536 are 196 KB) bounded a 32-row product to ~110 GFLOP/s. Here the m input rows are
// transposed once per product (xt[i][r], padded to 16 or 32 lanes) and each weight is
// broadcast against them: an FMA then needs one vector load per 16 rows, shared by C weight
// rows, and one 4-byte broadcast, so the FMA units and not the loads set the pace.
enum { XT_MIN_ROWS = 8, XT_MAX_ROWS = 32 };

// x[m, k] as xt[k, mp] (mp = m rounded up to 16, the extra rows zero), or NULL where m is
// outside [XT_MIN_ROWS, XT_MAX_ROWS]. Each team member makes its own copy (m * k floats,
// small beside the product) so that no barrier is needed; the caller frees it.
static float *transposed(const float *x, int64_t m, int64_t k, int64_t *mp) {
    if (m < XT_MIN_ROWS || m > XT_MAX_ROWS) return NULL;
    *mp = (m + 15) / 16 * 16;
    float *xt = malloc(sizeof(float) * *mp * k);
    for (int64_t i = 0; i < k; i++) {
        float *o = xt + i * *mp;
        for (int64_t r = 0; r < m; r++) o[r] = x[r * k + i];
        for (int64_t r = m; r < *mp; r++) o[r] = 0.0f;
    }
    return xt;
}

// C weight rows against V groups of 16 input rows: C * V accumulators of 16 rows each.
static inline __attribute__((always_inline)) void bcast_tile(const float *xt, int64_t mp,
                                                              int64_t m, int64_t k,
                                                              const float *w, float *y,
                                                              int64_t ldy, const int V,
                                                              const int C, int add) {
    __m512 acc[12][2];
    for (int c = 0; c < C; c++)
        for (int v = 0; v < V; v++) acc[c][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 xv[2];
        // The next tile's weight rows, one line each per 16 steps, into L2: C rows read four
        // bytes at a time are C slow streams that the hardware prefetcher does not keep up
        // with (a 16-row product over 393 MB of weights: 31 ms without, 21 ms with).
        if ((i & 15) == 0)
            for (int c = 0; c < C; c++)
                _mm_prefetch((const char *)(w + (C + c) * k + i), _MM_HINT_T1);
        for (int v = 0; v < V; v++) xv[v] = _mm512_loadu_ps(xt + i * mp + 16 * v);
        for (int c = 0; c < C; c++) {
            const __m512 wb = _mm512_set1_ps(w[c * k + i]);
            for (int v = 0; v < V; v++) acc[c][v] = _mm512_fmadd_ps(wb, xv[v], acc[c][v]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int v = 0; v < V; v++) {
            float s[16];
            _mm512_storeu_ps(s, acc[c][v]);
            for (int l = 0; l < 16 && 16 * v + l < m; l++) {
                float *o = y + (16 * v + l) * ldy + c;
                *o = add ? *o + s[l] : s[l];
            }
        }
}

// Weight rows [j0, j1) against xt: 12 weight rows a tile for 16 lanes of rows, 8 for 32
// (12 and 16 accumulators: enough to cover the FMA latency on two units, few enough to
// leave registers for the operands).
static void bcast_block(const float *xt, int64_t mp, int64_t m, const float *w, float *y,
                        int64_t n, int64_t k, int64_t j0, int64_t j1, int add) {
    int64_t j = j0;
#define BCAST(V, C) bcast_tile(xt, mp, m, k, w + j * k, y + j, n, V, C, add)
    if (mp == 16) {
        for (; j + 12 <= j1; j += 12) BCAST(1, 12);
        for (; j + 4 <= j1; j += 4) BCAST(1, 4);
        for (; j < j1; j++) BCAST(1, 1);
    } else {
        for (; j + 8 <= j1; j += 8) BCAST(2, 8);
        for (; j + 4 <= j1; j += 4) BCAST(2, 4);
        for (; j < j1; j++) BCAST(2, 1);
    }
#undef BCAST
}
#else
static float *transposed(const float *x, int64_t m, int64_t k, int64_t *mp) {
    (void)x, (void)m, (void)k, (void)mp;
    return NULL;
}

static void bcast_block(const float *xt, int64_t mp, int64_t m, const float *w, float *y,
                        int64_t n, int64_t k, int64_t j0, int64_t j1, int add) {
    (void)xt, (void)mp, (void)m, (void)w, (void)y, (void)n, (void)k, (void)j0, (void)j1,
        (void)add;
}
#endif

// y[m, n] (+)= x[m, k] . w[n, k]^T + b: the weight rows split among the team in blocks of
// 48 (a multiple of every tile, small enough to balance); add keeps y's values (a residual).
static void linear_for(const float *x, const float *w, const float *b, float *y, int64_t m,
                       int64_t n, int64_t k, int add) {
    const int64_t block = 48;
    int64_t nblocks = (n + block - 1) / block, mp = 0;
    float *xt = transposed(x, m, k, &mp);
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < nblocks; bi++) {
        int64_t j0 = bi * block, j1 = j0 + block < n ? j0 + block : n;
        if (xt)
            bcast_block(xt, mp, m, w, y, n, k, j0, j1, add);
        else
            linear_block(x, w, y, m, n, k, j0, j1, add);
        if (b)
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = j0; j < j1; j++) y[r * n + j] += b[j];
    }
    free(xt);
}

void sl_linear(const float *x, const float *w, const float *b, float *y, int64_t m, int64_t n,
               int64_t k, int add, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    linear_for(x, w, b, y, m, n, k, add);
}

// ---- quantised weights: GGUF blocks of 32, dequantised in registers -------------------
// A weight row of k inputs is k / 32 blocks, as llama.cpp ships them (little-endian):
//   kind 1, Q8_0: fp16 d, 32 x int8 q             (34 bytes): w = d * q
//   kind 2, Q4_1: fp16 d, fp16 m, 16 bytes of nibbles (20 bytes): w = d * q + m, where
//                 byte i holds element i in its low nibble and element i + 16 in its high.
// A block becomes four vectors of 8 fp32 lanes in registers and is FMA'd against a few input
// rows before the next block is read, or (12 rows and more) a panel of weight rows becomes an
// fp32 tile in L2 for the fp32 kernel; either way the weights are read from memory once per
// product at 34/128 or 20/128 of the fp32 bytes.
enum { KIND_F32 = 0, KIND_Q8_0 = 1, KIND_Q4_1 = 2 };

static inline int64_t block_bytes(int kind) { return kind == KIND_Q8_0 ? 34 : 20; }

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    return _cvtsh_ss(h);
}

static inline __attribute__((always_inline)) void deq_block(const uint8_t *b, const int kind,
                                                            __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    if (kind == KIND_Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + 8 * i));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        }
        return;
    }
    const __m256 m = _mm256_set1_ps(half_to_float(b + 2));
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4)), mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), m);
}

#ifdef SL_AVX512
// deq_block in 16 lanes: elements 0-15 in w[0], 16-31 in w[1] (for Q4_1 the low and the
// high nibbles). Half the instructions of the 8-lane form, which is what a few-row product
// of quantised weights spends its time on (it reads 4-7x fewer bytes than fp32).
static inline __attribute__((always_inline)) void deq_block16(const uint8_t *b, const int kind,
                                                              __m512 w[2]) {
    if (kind == KIND_Q4_1) {  // d and m: one 4-byte load, one conversion of both halves
        int32_t dm_bits;
        memcpy(&dm_bits, b, 4);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));
        const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 4)), mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m);
        w[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m);
        return;
    }
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    for (int i = 0; i < 2; i++) {
        __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * i));
        w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
}

// qrow below, in 16 lanes: two accumulators per row (one per half block); a single row
// takes blocks in pairs into four, since one block's dequantisation is shorter than the
// FMA latency that a chain of two would wait on.
static inline __attribute__((always_inline)) void qrow(const float *x, int64_t k,
                                                       const uint8_t *w, float *y, int64_t ldy,
                                                       const int R, const int kind, int add) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t bb = block_bytes(kind);
    int64_t i = 0;
    if (R == 1) {
        __m512 odd0 = _mm512_setzero_ps(), odd1 = odd0;
        for (; i + 64 <= k; i += 64, w += 2 * bb) {
            __m512 a[2], b[2];
            deq_block16(w, kind, a);
            deq_block16(w + bb, kind, b);
            acc[0][0] = _mm512_fmadd_ps(a[0], _mm512_loadu_ps(x + i), acc[0][0]);
            acc[0][1] = _mm512_fmadd_ps(a[1], _mm512_loadu_ps(x + i + 16), acc[0][1]);
            odd0 = _mm512_fmadd_ps(b[0], _mm512_loadu_ps(x + i + 32), odd0);
            odd1 = _mm512_fmadd_ps(b[1], _mm512_loadu_ps(x + i + 48), odd1);
        }
        acc[0][0] = _mm512_add_ps(acc[0][0], odd0);
        acc[0][1] = _mm512_add_ps(acc[0][1], odd1);
    }
    for (; i < k; i += 32, w += bb) {
        __m512 wv[2];
        deq_block16(w, kind, wv);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 2; c++)
                acc[r][c] = _mm512_fmadd_ps(wv[c], _mm512_loadu_ps(x + r * k + i + 16 * c),
                                            acc[r][c]);
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(fold16(_mm512_add_ps(acc[r][0], acc[r][1])));
        y[r * ldy] = add ? y[r * ldy] + s : s;
    }
}
#else
// R input rows (1-4) against one quantised weight row: each block dequantised once and
// FMA'd into every row's accumulators (four per row for a single row, to cover the FMA
// latency of one chain; two per row otherwise, so 8 + 4 registers fit in 16).
static inline __attribute__((always_inline)) void qrow(const float *x, int64_t k,
                                                       const uint8_t *w, float *y, int64_t ldy,
                                                       const int R, const int kind, int add) {
    const int A = R == 1 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
    const int64_t bb = block_bytes(kind);
    for (int64_t i = 0; i < k; i += 32, w += bb) {
        __m256 wv[4];
        deq_block(w, kind, wv);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++)
                acc[r][c % A] = _mm256_fmadd_ps(wv[c], _mm256_loadu_ps(x + r * k + i + 8 * c),
                                                acc[r][c % A]);
    }
    for (int r = 0; r < R; r++) {
        __m256 t = acc[r][0];
        for (int a = 1; a < A; a++) t = _mm256_add_ps(t, acc[r][a]);
        float s = hsum(t);
        y[r * ldy] = add ? y[r * ldy] + s : s;
    }
}
#endif

// Weight rows [j0, j1) against all m input rows, four input rows at a time; the weight
// row stays in L1 while every group of rows passes over it.
static void qlinear_block(const float *x, const uint8_t *w, float *y, int64_t m, int64_t n,
                          int64_t k, int64_t j0, int64_t j1, int kind, int add) {
    const int64_t row_bytes = k / 32 * block_bytes(kind);
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *wr = w + j * row_bytes;
        int64_t r = 0;
#define QROWS(R)                                                                           \
    (kind == KIND_Q8_0 ? qrow(x + r * k, k, wr, y + r * n + j, n, R, KIND_Q8_0, add)       \
                       : qrow(x + r * k, k, wr, y + r * n + j, n, R, KIND_Q4_1, add))
        for (; r + 4 <= m; r += 4) QROWS(4);
        switch (m - r) {
            case 3: QROWS(3); break;
            case 2: QROWS(2); break;
            case 1: QROWS(1); break;
        }
#undef QROWS
    }
}

// Weight rows [j0, j1) as fp32 rows out[0, j1 - j0) (out is (j1 - j0) * k floats).
static void dequantize_rows(const uint8_t *w, float *out, int64_t j0, int64_t j1, int64_t k,
                            int kind) {
    const int64_t bb = block_bytes(kind), row_bytes = k / 32 * bb;
    for (int64_t j = j0; j < j1; j++, out += k) {
        const uint8_t *wr = w + j * row_bytes;
        for (int64_t i = 0; i < k; i += 32, wr += bb) {
#ifdef SL_AVX512
            __m512 wv[2];
            if (kind == KIND_Q8_0)
                deq_block16(wr, KIND_Q8_0, wv);
            else
                deq_block16(wr, KIND_Q4_1, wv);
            for (int c = 0; c < 2; c++) _mm512_storeu_ps(out + i + 16 * c, wv[c]);
#else
            __m256 wv[4];
            if (kind == KIND_Q8_0)
                deq_block(wr, KIND_Q8_0, wv);
            else
                deq_block(wr, KIND_Q4_1, wv);
            for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + i + 8 * c, wv[c]);
#endif
        }
    }
}

#ifdef SL_VNNI
// ---- integer dots (AVX-512 VNNI) on blocks interleaved by 16 rows -----------------------
// Kinds 3 and 4 are Q4_1 and Q8_0 with the blocks of 16 consecutive weight rows side by
// side, one block column at a time: the 16 rows' fp16 scales (Q4_1: 16 d then 16 m; Q8_0:
// 16 d), then their quant bytes as vectors of 16 lanes, lane j of vector t holding bytes
// 4t..4t+3 of row j's block (Q4_1: 4 vectors, Q8_0: 8). A group of 16 rows is k / 32 such
// block columns, 320 (Q4_1) or 544 (Q8_0) bytes each: the same bytes as GGUF's, reordered
// (quant.interleave makes this layout; n must be a multiple of 16). In GGUF's Q4_1 the low
// nibbles of bytes 4t..4t+3 are elements 4t..4t+3 and their high nibbles 16+4t..16+4t+3,
// so one load and two masks give vpdpbusd four consecutive inputs for each of 16 rows.
//
// The input rows are quantised per row and block of 32, as llama.cpp's Q8_1: dx = amax /
// 127, qx = round(x / dx), sx = dx * sum(qx). Then for a weight block w = d qw (+ m),
//   sum(w x) ~= d dx sum(qw qx) (+ m sx),
// with sum(qw qx) exact in int32. vpdpbusd multiplies unsigned by signed bytes: Q4_1's
// nibbles are the unsigned side; for Q8_0 the inputs are, stored as qx + 128, and the
// 128 sum(qw) this adds is taken off again (sum(qw) by vpdpbusd against ones). Every output
// takes the same operations in the same block order whatever the tile and the row count,
// so the result of a row never depends on which other rows share its step.
// Why: the fp32 paths dequantise every weight before an FMA that does one multiply-add per
// lane; vpdpbusd does four per lane on the blocks as they are. One thread of a Zen 5 core
// (see docs/design/model.md) ran a 256-token prefill's Q4_1 products at 2.9x oneDNN's fp32
// GEMM rate, and a single row at the memory's rate.
enum { KIND_Q4_1X = 3, KIND_Q8_0X = 4, QX_TOKEN_BLOCK = 256 };

static inline int64_t qx_column_bytes(int kind) { return kind == KIND_Q8_0X ? 544 : 320; }

// Rows [r0, r1) of x [m, k] as int8 q [m, k] (XOR offset: 0x80 stores qx + 128 as unsigned)
// with d, s [m, k / 32].
static void quantize_inputs(const float *x, int64_t r0, int64_t r1, int64_t k, int8_t *q,
                            float *d, float *s, int offset) {
    const int64_t nb = k / 32;
    const __m128i flip = _mm_set1_epi8((char)offset);
    for (int64_t r = r0; r < r1; r++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = x + r * k + 32 * b;
            const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a),
                                                                  _mm512_abs_ps(c)));
            const float dx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512 iv = _mm512_set1_ps(inv);
            const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, iv));
            const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, iv));
            int8_t *qb = q + r * k + 32 * b;
            _mm_storeu_si128((__m128i *)qb, _mm_xor_si128(_mm512_cvtepi32_epi8(qa), flip));
            _mm_storeu_si128((__m128i *)(qb + 16),
                             _mm_xor_si128(_mm512_cvtepi32_epi8(qc), flip));
            d[r * nb + b] = dx;
            s[r * nb + b] = dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
        }
}

static inline int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

// G groups of 16 weight rows (w: the first group, gs bytes apart) against R quantised input
// rows: y[r * ldy + 16 g + lane]. Always inlined with constant G, R and kind.
static inline __attribute__((always_inline)) void qx_tile(const uint8_t *w, int64_t gs,
                                                          const int8_t *q, const float *d,
                                                          const float *s, int64_t k, float *y,
                                                          int64_t ldy, const int G,
                                                          const int R, const int kind,
                                                          int add) {
    const int64_t nb = k / 32, cb = qx_column_bytes(kind);
    const __m512i mask = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi8(1);
    __m512 acc[2][4];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) acc[g][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *col = w + b * cb;
        __m512i dot[2][4], wsum[2];
        for (int g = 0; g < G; g++) {
            wsum[g] = _mm512_setzero_si512();
            for (int r = 0; r < R; r++) dot[g][r] = _mm512_setzero_si512();
        }
        if (kind == KIND_Q4_1X) {
            for (int t = 0; t < 4; t++) {
                __m512i lo[2], hi[2];
                for (int g = 0; g < G; g++) {
                    const __m512i raw = _mm512_loadu_si512(col + g * gs + 64 + 64 * t);
                    lo[g] = _mm512_and_si512(raw, mask);
                    hi[g] = _mm512_and_si512(_mm512_srli_epi32(raw, 4), mask);
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *qb = q + r * k + 32 * b + 4 * t;
                    const __m512i xl = _mm512_set1_epi32(load4(qb));
                    const __m512i xh = _mm512_set1_epi32(load4(qb + 16));
                    for (int g = 0; g < G; g++) {
                        dot[g][r] = _mm512_dpbusd_epi32(dot[g][r], lo[g], xl);
                        dot[g][r] = _mm512_dpbusd_epi32(dot[g][r], hi[g], xh);
                    }
                }
            }
        } else {
            for (int t = 0; t < 8; t++) {
                __m512i wv[2];
                for (int g = 0; g < G; g++) {
                    wv[g] = _mm512_loadu_si512(col + g * gs + 32 + 64 * t);
                    wsum[g] = _mm512_dpbusd_epi32(wsum[g], ones, wv[g]);
                }
                for (int r = 0; r < R; r++) {
                    const __m512i xu = _mm512_set1_epi32(load4(q + r * k + 32 * b + 4 * t));
                    for (int g = 0; g < G; g++)
                        dot[g][r] = _mm512_dpbusd_epi32(dot[g][r], xu, wv[g]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            const uint8_t *sc = col + g * gs;
            const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
            if (kind == KIND_Q4_1X) {
                const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
                for (int r = 0; r < R; r++) {
                    const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(d[r * nb + b]));
                    acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][r]), scale, acc[g][r]);
                    acc[g][r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(s[r * nb + b]), acc[g][r]);
                }
            } else {
                const __m512i bias = _mm512_slli_epi32(wsum[g], 7);
                for (int r = 0; r < R; r++) {
                    const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(d[r * nb + b]));
                    const __m512i exact = _mm512_sub_epi32(dot[g][r], bias);
                    acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[g][r]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) {
            float *yr = y + r * ldy + 16 * g;
            _mm512_storeu_ps(yr, add ? _mm512_add_ps(_mm512_loadu_ps(yr), acc[g][r]) : acc[g][r]);
        }
}

// Weight groups [g0, g0 + G) against input rows [r0, r1), four rows a tile.
#define QX_TILES(G, R, KIND)                                                               \
    for (; r + R <= r1; r += R)                                                            \
        qx_tile(wg, gs, q + r * k, d + r * nb, s + r * nb, k, y + r * n + 16 * g0, n, G, R, \
                KIND, add)
#define QX_KIND(KIND)                                                                      \
    do {                                                                                   \
        if (G == 2) {                                                                      \
            QX_TILES(2, 4, KIND);                                                          \
            QX_TILES(2, 2, KIND);                                                          \
            QX_TILES(2, 1, KIND);                                                          \
        } else {                                                                           \
            QX_TILES(1, 4, KIND);                                                          \
            QX_TILES(1, 1, KIND);                                                          \
        }                                                                                  \
    } while (0)

static void qx_block(const uint8_t *w, const int8_t *q, const float *d, const float *s,
                     float *y, int64_t n, int64_t k, int64_t g0, int G, int64_t r0, int64_t r1,
                     int kind, int add) {
    const int64_t nb = k / 32, gs = nb * qx_column_bytes(kind);
    const uint8_t *wg = w + g0 * gs;
    int64_t r = r0;
    if (kind == KIND_Q4_1X)
        QX_KIND(KIND_Q4_1X);
    else
        QX_KIND(KIND_Q8_0X);
}
#undef QX_KIND
#undef QX_TILES

// y[m, n] (+)= x[m, k] . w^T + b for kinds 3 and 4; an orphaned `omp for` like the others.
// The inputs are quantised once, shared by the team; then pairs of 16-row groups split
// among it, token block by token block (256 rows: their inputs stay in L2 while the team's
// weight groups pass over them).
static void qx_linear_for(const float *x, const uint8_t *w, const float *b, float *y,
                          int64_t m, int64_t n, int64_t k, int add, int kind) {
    const int64_t nb = k / 32, groups = n / 16, pairs = (groups + 1) / 2;
    const int64_t tblocks = (m + QX_TOKEN_BLOCK - 1) / QX_TOKEN_BLOCK;
    int8_t *q = NULL;
#pragma omp single copyprivate(q)
    q = malloc(m * k + 2 * sizeof(float) * m * nb);
    float *d = (float *)(q + m * k), *s = d + m * nb;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_inputs(x, r, r + 1, k, q, d, s, kind == KIND_Q8_0X ? 0x80 : 0);
#pragma omp for collapse(2) schedule(static)
    for (int64_t tb = 0; tb < tblocks; tb++)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t g0 = 2 * p, r0 = tb * QX_TOKEN_BLOCK;
            const int64_t r1 = r0 + QX_TOKEN_BLOCK < m ? r0 + QX_TOKEN_BLOCK : m;
            qx_block(w, q, d, s, y, n, k, g0, g0 + 1 < groups ? 2 : 1, r0, r1, kind, add);
            if (b)
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t j = 16 * g0; j < 16 * (g0 + 2) && j < n; j++) y[r * n + j] += b[j];
        }
#pragma omp single nowait
    free(q);
}

// Kind-3/4 rows [j0, j1) as fp32 rows (out is (j1 - j0) * k floats), as dequantize_rows.
static void qx_dequantize_rows(const uint8_t *w, float *out, int64_t j0, int64_t j1,
                               int64_t k, int kind) {
    const int64_t nb = k / 32, cb = qx_column_bytes(kind), gs = nb * cb;
    for (int64_t j = j0; j < j1; j++, out += k) {
        const int64_t lane = j % 16;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *col = w + (j / 16) * gs + b * cb;
            const float dj = half_to_float(col + 2 * lane);
            if (kind == KIND_Q8_0X) {
                for (int i = 0; i < 32; i++)
                    out[32 * b + i] = dj * (float)(int8_t)col[32 + 64 * (i / 4) + 4 * lane + i % 4];
                continue;
            }
            const float mj = half_to_float(col + 32 + 2 * lane);
            for (int t = 0; t < 4; t++)
                for (int c = 0; c < 4; c++) {
                    const uint8_t byte = col[64 + 64 * t + 4 * lane + c];
                    out[32 * b + 4 * t + c] = fmaf(dj, (float)(byte & 0x0F), mj);
                    out[32 * b + 16 + 4 * t + c] = fmaf(dj, (float)(byte >> 4), mj);
                }
        }
    }
}
#endif

#ifdef SL_AVX512
// ---- fp32 weights interleaved by 16 rows (kind 5): one kernel for every row count ------
// w is [n / 16][k][16]: each group of 16 output rows stores, for each input i, their 16
// weights as one vector (``quant.interleave_f32``; n a multiple of 16, any k). A tile is R
// input rows (up to 8) against NV groups (up to 3, 48 outputs): per input a vector load per
// group, one broadcast per row, R * NV FMAs into registers. Why not the plain layout:
// - the weights of a tile are NV contiguous streams read whole vectors at a time, which the
//   hardware prefetcher keeps up with; the plain 32-row tiles read 8 rows four bytes at a
//   time and streamed fp32 weights from memory at ~140 GFLOP/s, against ~180 here;
// - at prefill sizes the same tiles reached 229-238 GFLOP/s at 256-1024 rows on one Zen 5
//   core, where oneDNN's linear on the plain weight reached 212-217 (and 227-228 on its own
//   packed copy, a second copy of every weight);
// - every output is one FMA chain over i in order, whatever R, NV, the thread count or the
//   neighbouring rows: batching invariance is exact.
enum { KIND_F32X = 5, FX_GROUPS = 3, FX_ROWS = 8, FX_TOKEN_BLOCK = 256 };

// A tile's R x NV accumulators (+ the bias) stored to y, or added to it.
static inline __attribute__((always_inline)) void fx_store(__m512 acc[FX_ROWS][FX_GROUPS],
                                                            const float *b, float *y,
                                                            int64_t ldy, int add, const int R,
                                                            const int NV) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) {
            __m512 o = acc[r][v];
            if (b) o = _mm512_add_ps(o, _mm512_loadu_ps(b + 16 * v));
            float *dst = y + r * ldy + 16 * v;
            _mm512_storeu_ps(dst, add ? _mm512_add_ps(_mm512_loadu_ps(dst), o) : o);
        }
}

static inline __attribute__((always_inline)) void fx_tile(const float *x, int64_t k,
                                                           const float *wg, int64_t gs,
                                                           const float *b, float *y,
                                                           int64_t ldy, int add,
                                                           const float *pf, int npf,
                                                           const int R, const int NV) {
    __m512 acc[FX_ROWS][FX_GROUPS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 wv[FX_GROUPS];
        for (int v = 0; v < npf; v++)
            _mm_prefetch((const char *)(pf + v * gs + 16 * i), _MM_HINT_T1);
        for (int v = 0; v < NV; v++) wv[v] = _mm512_loadu_ps(wg + v * gs + 16 * i);
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * k + i]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
        }
    }
    fx_store(acc, b, y, ldy, add, R, NV);
}

#ifdef SL_BF16
// ---- bf16 weights interleaved by 16 rows (kind 6): the fp32 tiles, two inputs a step ----
// w is [n / 16][k / 2][16][2] bf16 (``quant.interleave_bf16``; k even): for each group of
// 16 output rows and each pair of inputs (2i, 2i+1), the 16 rows' two weights side by
// side, so one 64-byte vector holds what VDPBF16PS takes. x arrives as fp32 and is rounded
// to bf16 once per product (round to nearest even, as torch's .to(torch.bfloat16) does);
// each pair of inputs is broadcast as one 32-bit word. The accumulators stay fp32, and
// each output is still one chain over the input pairs in order, so batching invariance is
// exact, as for kind 5. Half the bytes of fp32 for the same tile shape: decode streams
// half as much, and VDPBF16PS does two multiply-adds a lane where an FMA does one.
enum { KIND_BF16X = 6 };

static inline __attribute__((always_inline)) void bx_tile(const uint32_t *x, int64_t kp,
                                                           const uint16_t *wg, int64_t gs,
                                                           const float *b, float *y,
                                                           int64_t ldy, int add,
                                                           const uint16_t *pf, int npf,
                                                           const int R, const int NV) {
    __m512 acc[FX_ROWS][FX_GROUPS];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i++) {
        __m512bh wv[FX_GROUPS];
        for (int v = 0; v < npf; v++)
            _mm_prefetch((const char *)(pf + v * gs + 32 * i), _MM_HINT_T1);
        for (int v = 0; v < NV; v++)
            wv[v] = (__m512bh)_mm512_loadu_si512((const void *)(wg + v * gs + 32 * i));
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[r * kp + i]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
        }
    }
    fx_store(acc, b, y, ldy, add, R, NV);
}

// Rows [r0, r1) of x [m, k] rounded to bf16 into xb (row stride k): 16 at a time, the
// tail under a mask.
static void to_bf16_rows(const float *x, uint16_t *xb, int64_t r0, int64_t r1, int64_t k) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = 0; i < k; i += 16) {
            const __mmask16 mk = k - i >= 16 ? 0xffff : (__mmask16)((1u << (k - i)) - 1);
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mk, x + r * k + i));
            _mm256_mask_storeu_epi16(xb + r * k + i, mk, (__m256i)h);
        }
}
#define BX_TILE_OR(R, NV, ...)                                                             \
    (bf ? bx_tile((const uint32_t *)x + r * (k / 2), k / 2, (const uint16_t *)wg, gs, bg,   \
                  y + r * n + 16 * g0, n, add, (const uint16_t *)pfr, npf, R, NV)           \
        : __VA_ARGS__)
#else
#define BX_TILE_OR(R, NV, ...) (__VA_ARGS__)
#endif

#define FX_TILE(R, NV)                                                                     \
    do {                                                                                   \
        const int64_t sp = spread ? (r - r0) / FX_ROWS : 0;                                \
        const void *pfr = spread ? (const void *)((const char *)pf + sp * gs * es) : pf;     \
        const int npf = spread ? sp < FX_GROUPS : (r == r0) * FX_GROUPS;                   \
        BX_TILE_OR(R, NV, fx_tile((const float *)x + r * k, k, (const float *)wg, gs, bg,  \
                                  y + r * n + 16 * g0, n, add, (const float *)pfr, npf, R, \
                                  NV));                                                    \
    } while (0)
#define FX_ROWS_OF(NV)                                                                     \
    do {                                                                                   \
        for (; r + FX_ROWS <= r1; r += FX_ROWS) FX_TILE(FX_ROWS, NV);                      \
        switch (r1 - r) {                                                                  \
        case 7: FX_TILE(7, NV); break;                                                     \
        case 6: FX_TILE(6, NV); break;                                                     \
        case 5: FX_TILE(5, NV); break;                                                     \
        case 4: FX_TILE(4, NV); break;                                                     \
        case 3: FX_TILE(3, NV); break;                                                     \
        case 2: FX_TILE(2, NV); break;                                                     \
        case 1: FX_TILE(1, NV); break;                                                     \
        }                                                                                  \
    } while (0)

// Rows [r0, r1) against groups [g0, g0 + G) (G <= FX_GROUPS); bf: kind 6 (x already bf16,
// w bf16), else kind 5. A group is gs = 16 * k elements of es bytes either way.
static void fx_block(const void *x, const void *w, const float *b, float *y, int64_t n,
                     int64_t k, int64_t g0, int G, int64_t r0, int64_t r1, int add,
                     const int bf) {
    const int64_t gs = 16 * k, es = bf ? 2 : 4;
    const void *wg = (const char *)w + g0 * gs * es;
    const float *bg = b ? b + 16 * g0 : NULL;
    // The next block goes to L2 while this one is computed, a line of a group each step: the
    // first three row tiles take a group each where there are three, else the first tile
    // takes all three. Over 200 MB of a layer's products in memory, one thread, against no
    // prefetch: 8 rows 90 -> 108 GFLOP/s; 32 rows ~170 -> ~195 (the first tile alone
    // prefetching all three groups at 32 rows: ~170-185).
    const void *pf = (const char *)wg + FX_GROUPS * gs * es;
    const int spread = r1 - r0 >= FX_GROUPS * FX_ROWS;
    int64_t r = r0;
    if (G == 3)
        FX_ROWS_OF(3);
    else if (G == 2)
        FX_ROWS_OF(2);
    else
        FX_ROWS_OF(1);
}
#undef FX_ROWS_OF
#undef FX_TILE
#undef BX_TILE_OR

// y[m, n] (+)= x[m, k] . w^T + b for kind 5 (bf = 0, x fp32) or 6 (bf = 1, x the inputs
// rounded to bf16); an orphaned `omp for` like the others. Blocks of 3 groups split among
// the team, token block by token block (256 rows: a block's inputs stay in L2 while the
// team's weights pass over them).
static void fx_blocks_for(const void *x, const void *w, const float *b, float *y, int64_t m,
                          int64_t n, int64_t k, int add, int bf) {
    const int64_t groups = n / 16, wblocks = (groups + FX_GROUPS - 1) / FX_GROUPS;
    const int64_t tblocks = (m + FX_TOKEN_BLOCK - 1) / FX_TOKEN_BLOCK;
#pragma omp for collapse(2) schedule(static)
    for (int64_t tb = 0; tb < tblocks; tb++)
        for (int64_t wb = 0; wb < wblocks; wb++) {
            const int64_t g0 = wb * FX_GROUPS, r0 = tb * FX_TOKEN_BLOCK;
            const int G = groups - g0 < FX_GROUPS ? (int)(groups - g0) : FX_GROUPS;
            fx_block(x, w, b, y, n, k, g0, G, r0, r0 + FX_TOKEN_BLOCK < m ? r0 + FX_TOKEN_BLOCK : m,
                     add, bf);
        }
}

#ifdef SL_BF16
// Kind 6: the team rounds x to bf16 once into a buffer it shares (one member allocates it
// and hands the pointer to the rest), then runs the tiles over it.
static void bx_linear_for(const float *x, const uint16_t *w, const float *b, float *y,
                          int64_t m, int64_t n, int64_t k, int add) {
    uint16_t *xb = NULL;
#pragma omp single copyprivate(xb)
    xb = malloc(sizeof(uint16_t) * m * k);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++) to_bf16_rows(x, xb, r, r + 1, k);
    fx_blocks_for(xb, w, b, y, m, n, k, add, 1);
#pragma omp single
    free(xb);
}
#endif
#endif

// linear_for over weights of any kind (k a multiple of 32 for the quantised ones).
// Up to 11 rows, each block is dequantised in registers and FMA'd into the rows (qrow): the
// product streams the blocks and dequantises each once per four rows. From 12 rows on,
// repeating that costs more than the bytes it saves (8 times per block at 32 rows: a
// batch-32 q4_1 decode step took 1.14x fp32's), so each team member dequantises a panel of
// 24 weight rows once into an fp32 tile (24 * k floats: 55 KB at k = 576, 147 KB at 1536,
// L2-resident) and runs the fp32 broadcast tiles over it: the weights cross memory once, as
// blocks, and the FMAs read from L2 as in the fp32 product (24: a multiple of the tiles;
// 12 and 48 measured no better). Over 30 layers of SmolLM2's four products as q8_0 blocks,
// one thread: 8 rows took 32 ms on panels against qrow's 20; at 12 the two were level.
enum { QPANEL_MIN_ROWS = 12, QPANEL_ROWS = 24 };

static void any_linear_for(const float *x, const void *w, const float *b, float *y, int64_t m,
                           int64_t n, int64_t k, int add, int kind) {
    if (kind == KIND_F32) {
        linear_for(x, (const float *)w, b, y, m, n, k, add);
        return;
    }
#ifdef SL_AVX512
    if (kind == KIND_F32X) {
        fx_blocks_for(x, w, b, y, m, n, k, add, 0);
        return;
    }
#endif
#ifdef SL_BF16
    if (kind == KIND_BF16X) {
        bx_linear_for(x, (const uint16_t *)w, b, y, m, n, k, add);
        return;
    }
#endif
#ifdef SL_VNNI
    if (kind == KIND_Q4_1X || kind == KIND_Q8_0X) {
        qx_linear_for(x, (const uint8_t *)w, b, y, m, n, k, add, kind);
        return;
    }
#endif
    const int panel = m >= QPANEL_MIN_ROWS;
    const int64_t block = panel ? QPANEL_ROWS : 16;
    int64_t nblocks = (n + block - 1) / block, mp = 0;
    float *tile_w = panel ? malloc(sizeof(float) * block * k) : NULL;
    float *xt = panel ? transposed(x, m, k, &mp) : NULL;
#pragma omp for schedule(static)
    for (int64_t bi = 0; bi < nblocks; bi++) {
        int64_t j0 = bi * block, j1 = j0 + block < n ? j0 + block : n;
        if (panel) {
            dequantize_rows((const uint8_t *)w, tile_w, j0, j1, k, kind);
            if (xt)
                bcast_block(xt, mp, m, tile_w, y + j0, n, k, 0, j1 - j0, add);
            else
                linear_block(x, tile_w, y + j0, m, n, k, 0, j1 - j0, add);
        } else {
            qlinear_block(x, (const uint8_t *)w, y, m, n, k, j0, j1, kind, add);
        }
        if (b)
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = j0; j < j1; j++) y[r * n + j] += b[j];
    }
    free(tile_w);
    free(xt);
}

void sl_qlinear(const float *x, const uint8_t *w, const float *b, float *y, int64_t m,
                int64_t n, int64_t k, int add, int kind, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    any_linear_for(x, w, b, y, m, n, k, add, kind);
}

// out[n, k] = the fp32 weights of n quantised rows: prefill-sized products dequantise a
// matrix once and hand it to BLAS, whose GEMM amortises that over all their rows.
void sl_dequantize(const uint8_t *w, float *out, int64_t n, int64_t k, int kind,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
#ifdef SL_VNNI
        if (kind == KIND_Q4_1X || kind == KIND_Q8_0X) {
            qx_dequantize_rows(w, out + j * k, j, j + 1, k, kind);
            continue;
        }
#endif
        dequantize_rows(w, out + j * k, j, j + 1, k, kind);
    }
}

// Whether this build takes kind 5 (fp32 interleaved by 16 rows: the AVX-512 builds).
int sl_f32_interleaved(void) {
#ifdef SL_AVX512
    return 1;
#else
    return 0;
#endif
}

// Whether this build takes kind 6 (bf16 interleaved by 16 rows: the AVX512-BF16 build).
int sl_bf16_dot(void) {
#ifdef SL_BF16
    return 1;
#else
    return 0;
#endif
}

// Whether this build takes kinds 3 and 4 (interleaved by 16 rows, integer dots).
int sl_int8_dot(void) {
#ifdef SL_VNNI
    return 1;
#else
    return 0;
#endif
}

// e^x, for 8 lanes (exp8) and 16 (exp16): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error ~2e-7, below fp32 rounding of the softmax sums);
// inputs below -87 flush to 0, as softmax wants for masked-out scores. The reduction and the
// polynomial are written once, for both widths (W: 256 or 512); only the clamp and the 2^n
// scaling differ.
#define EXP_FLOOR -87.0f
#define EXP_LOG2E 1.44269504f
#define DEFINE_EXP_POLY(T, W)                                                               \
    static inline T exp_poly##W(T x, T n) {                                                 \
        T r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693145752f), x);                     \
        r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(1.42860677e-6f), r);                     \
        T p = _mm##W##_set1_ps(1.0f / 720);                                                 \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 120));                          \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 24));                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 6));                            \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(0.5f));                                \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f));                                \
        return _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f));                             \
    }
DEFINE_EXP_POLY(__m256, 256)

static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_FLOOR);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 p = exp_poly256(x, n);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef SL_AVX512
DEFINE_EXP_POLY(__m512, 512)

// scalef applies 2^n, which is exact for the normal range that inputs above EXP_FLOOR give:
// exp8's values, in half the instructions of exp8 on each half.
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(EXP_FLOOR);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_maskz_scalef_ps(keep, exp_poly512(x, n), n);
}

// out[j] = the sum of v[j]'s 16 lanes, for 16 vectors: a transpose-and-add tree (45
// shuffles and adds for 16 sums, against ~6 a sum one by one).
static inline __m512 sum16x16(__m512 v[16]) {
    __m512 x[8], y[4], w[2];
    for (int i = 0; i < 8; i++)  // x[i]: per 128-bit chunk, v[2i] and v[2i+1] interleaved
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // y[i]: per chunk, partial sums of v[4i..4i+3]
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  // w[i]: chunks 0+1 and 2+3 of y[2i], then of y[2i+1]
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88),
                         _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Walks a sequence's cached rows in position order through its block table: no division
// per position, and no read of the table past the block that holds position len - 1.
typedef struct {
    const float *cache, *base;
    const int32_t *table;
    int64_t bs, row, blk, off;
} row_walk;

static inline const float *next_row(row_walk *w, int64_t p, int64_t len) {
    const float *r = w->base + w->off * w->row;
    if (++w->off == w->bs && p + 1 < len)
        w->off = 0, w->base = w->cache + (int64_t)w->table[++w->blk] * w->bs * w->row;
    return r;
}

// One query token's G heads (sharing one KV head) over positions [0, len), d = 16 D: the
// scores 16 positions at a time (each position's dot in 16 lanes, then one add tree for
// the 16 sums), a softmax whose 1 / sum is applied to the output, and the values read
// once for all G heads (G x D accumulators). s holds G rows of len rounded up to 16.
// Why: the AVX2 path reduces every score on its own and reads V once per head; decode
// steps of 16 sequences at 288 positions spent 24 ms of a 38 ms step in it (9 GB/s of K/V).
static inline __attribute__((always_inline)) void decode_heads16(
    const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
    int64_t bs, int64_t row, int64_t len, float scale, float *s, float *o, const int G,
    const int D) {
    const int64_t lp = (len + 15) & ~(int64_t)15;
    __m512 qv[4][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D; c++)
            qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + g * 16 * D + 16 * c), _mm512_set1_ps(scale));
    // K rows of the next 16 positions go to L1 one group ahead, so the K reads overlap the
    // FMAs, and those of the group after to L2 (walker `far`); V's rows go to L2 for the
    // value pass (a head's row is 4 lines, row floats apart). Why two distances: a head's
    // rows are short strided pieces of scattered blocks, and with L1 prefetches alone the
    // core had too few misses in flight: 32 sequences at 264 positions, 30 layers, one
    // thread, 41-46 ms -> 29-31 ms in alternating runs (prefetching further ahead: no better).
    const int64_t vofs = v_cache - k_cache;
    row_walk walk = {k_cache, k_cache + (int64_t)table[0] * bs * row, table, bs, row, 0, 0};
    row_walk far = walk;
    const float *next[16];
    for (int j = 0; j < 16; j++)  // past the end: any row, masked below
        next[j] = j < len ? next_row(&walk, j, len) : next[0];
    for (int j = 0; j < 32 && j < len; j++) {
        const float *r = next_row(&far, j, len);
        if (j >= 16)
            for (int c = 0; c < D; c++) _mm_prefetch((const char *)(r + 16 * c), _MM_HINT_T1);
    }
    for (int64_t p0 = 0; p0 < lp; p0 += 16) {
        const float *kp[16];
        for (int j = 0; j < 16; j++) {
            kp[j] = next[j];
            const int64_t p = p0 + 16 + j;
            if (p + 16 < len) {
                const float *r = next_row(&far, p + 16, len);
                for (int c = 0; c < D; c++) _mm_prefetch((const char *)(r + 16 * c), _MM_HINT_T1);
            }
            if (p < len) {
                next[j] = next_row(&walk, p, len);
                for (int c = 0; c < D; c++) _mm_prefetch((const char *)(next[j] + 16 * c), _MM_HINT_T0);
            } else {
                next[j] = next[0];
            }
            for (int c = 0; c < D; c++) _mm_prefetch((const char *)(kp[j] + vofs + 16 * c), _MM_HINT_T1);
        }
        for (int g = 0; g < G; g++) {
            __m512 dots[16];
            for (int j = 0; j < 16; j++) {
                __m512 a = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(kp[j]));
                for (int c = 1; c < D; c++)
                    a = _mm512_fmadd_ps(qv[g][c], _mm512_loadu_ps(kp[j] + 16 * c), a);
                dots[j] = a;
            }
            _mm512_storeu_ps(s + g * lp + p0, sum16x16(dots));
        }
    }
    float inv[4];
    for (int g = 0; g < G; g++) {
        float *sg = s + g * lp;
        for (int64_t p = len; p < lp; p++) sg[p] = -INFINITY;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < lp; p += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + p));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t p = 0; p < lp; p += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + p), m));
            _mm512_storeu_ps(sg + p, e);
            sum = _mm512_add_ps(sum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    __m512 acc[4][8];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
        const float *vb = v_cache + (int64_t)table[p0 / bs] * bs * row;
        const int64_t n = len - p0 < bs ? len - p0 : bs;
        for (int64_t j = 0; j < n; j++) {
            const float *vp = vb + j * row;
            __m512 vv[8];
            for (int c = 0; c < D; c++) vv[c] = _mm512_loadu_ps(vp + 16 * c);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(s[g * lp + p0 + j]);
                for (int c = 0; c < D; c++) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D; c++)
            _mm512_storeu_ps(o + g * 16 * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

// decode_heads16 for the shapes it holds in registers (G <= 4 heads a KV head, d of 64 or
// 128 with G * d / 16 <= 16 accumulators); 0 where the caller must take the AVX2 path.
static int decode_heads(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *table, int64_t bs, int64_t row, int64_t d, int64_t len,
                        float scale, float *s, float *o, int64_t G) {
#define HEADS(g, dd) decode_heads16(q, k_cache, v_cache, table, bs, row, len, scale, s, o, g, dd)
    if (d == 64) {
        switch (G) {
            case 1: HEADS(1, 4); return 1;
            case 2: HEADS(2, 4); return 1;
            case 3: HEADS(3, 4); return 1;
            case 4: HEADS(4, 4); return 1;
        }
    } else if (d == 128) {
        switch (G) {
            case 1: HEADS(1, 8); return 1;
            case 2: HEADS(2, 8); return 1;
        }
    }
#undef HEADS
    return 0;
}
#endif

// In place: s[0..len) <- softmax(s).
static void softmax(float *s, int64_t len) {
    float mx = -INFINITY;
    for (int64_t p = 0; p < len; p++) mx = s[p] > mx ? s[p] : mx;
    __m256 vmx = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= len; p += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), vmx));
        _mm256_storeu_ps(s + p, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; p < len; p++) {
        s[p] = expf(s[p] - mx);
        sum += s[p];
    }
    __m256 inv = _mm256_set1_ps(1.f / sum);
    for (p = 0; p + 8 <= len; p += 8) _mm256_storeu_ps(s + p, _mm256_mul_ps(_mm256_loadu_ps(s + p), inv));
    for (; p < len; p++) s[p] /= sum;
}

// Scores of the G query heads that share one KV head, over positions [0, len): two
// positions at a time, each dot split in two chains, so 4G independent FMA chains hide
// the FMA latency. d is a multiple of 16 (checked by the caller). Walks the block table
// block by block: no division per position.
static inline __attribute__((always_inline)) void scores_g(const float *q, const float *k_cache,
                                                           const int32_t *table, int64_t bs,
                                                           int64_t row, int64_t d, int64_t len,
                                                           float scale, float *s, const int G) {
    for (int64_t p0 = 0; p0 < len; p0 += bs) {
        const float *blk = k_cache + (int64_t)table[p0 / bs] * bs * row;
        int64_t n = len - p0 < bs ? len - p0 : bs;
        for (int64_t j = 0; j < n; j += 2) {
            const int two = j + 1 < n;
            const float *k0 = blk + j * row, *k1 = two ? k0 + row : k0;
            __m256 a[8][2], b[8][2];
            for (int g = 0; g < G; g++) a[g][0] = a[g][1] = b[g][0] = b[g][1] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 16) {
                __m256 ka0 = _mm256_loadu_ps(k0 + i), kb0 = _mm256_loadu_ps(k0 + i + 8);
                __m256 ka1 = _mm256_loadu_ps(k1 + i), kb1 = _mm256_loadu_ps(k1 + i + 8);
                for (int g = 0; g < G; g++) {
                    __m256 qa = _mm256_loadu_ps(q + g * d + i);
                    __m256 qb = _mm256_loadu_ps(q + g * d + i + 8);
                    a[g][0] = _mm256_fmadd_ps(qa, ka0, a[g][0]);
                    a[g][1] = _mm256_fmadd_ps(qb, kb0, a[g][1]);
                    b[g][0] = _mm256_fmadd_ps(qa, ka1, b[g][0]);
                    b[g][1] = _mm256_fmadd_ps(qb, kb1, b[g][1]);
                }
            }
            for (int g = 0; g < G; g++) {
                s[g * len + p0 + j] = hsum(_mm256_add_ps(a[g][0], a[g][1])) * scale;
                if (two) s[g * len + p0 + j + 1] = hsum(_mm256_add_ps(b[g][0], b[g][1])) * scale;
            }
        }
    }
}

static void scores(const float *q, const float *k_cache, const int32_t *table, int64_t bs,
                   int64_t row, int64_t d, int64_t len, float scale, float *s, int64_t G) {
    switch (G) {
        case 1: scores_g(q, k_cache, table, bs, row, d, len, scale, s, 1); return;
        case 2: scores_g(q, k_cache, table, bs, row, d, len, scale, s, 2); return;
        case 3: scores_g(q, k_cache, table, bs, row, d, len, scale, s, 3); return;
        case 4: scores_g(q, k_cache, table, bs, row, d, len, scale, s, 4); return;
        default:
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
                int64_t n = G - g0 < 4 ? G - g0 : 4;
                // A slice of heads: its scores land in rows g0.. of s (len apart).
                for (int64_t g = 0; g < n; g++)
                    scores_g(q + (g0 + g) * d, k_cache, table, bs, row, d, len, scale,
                             s + (g0 + g) * len, 1);
            }
    }
}

// o[0..d) = sum_p w[p] * V[p]: up to 8 accumulators of 8 lanes held in registers.
static void weighted_values(const float *w, const float *v_cache, const int32_t *table,
                            int64_t bs, int64_t row, int64_t d, int64_t len, float *o) {
    for (int64_t i0 = 0; i0 < d; i0 += 64) {
        int64_t nv = (d - i0) / 8 < 8 ? (d - i0) / 8 : 8;
        __m256 acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t p0 = 0; p0 < len; p0 += bs) {
            const float *blk = v_cache + (int64_t)table[p0 / bs] * bs * row + i0;
            int64_t n = len - p0 < bs ? len - p0 : bs;
            for (int64_t j = 0; j < n; j++) {
                const float *vp = blk + j * row;
                __m256 pw = _mm256_set1_ps(w[p0 + j]);
                for (int c = 0; c < 8; c++)
                    if (c < nv) acc[c] = _mm256_fmadd_ps(pw, _mm256_loadu_ps(vp + 8 * c), acc[c]);
            }
        }
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + i0 + 8 * c, acc[c]);
    }
}

static void attention_for(const float *q, int64_t q_stride, const float *k_cache,
                          const float *v_cache, const int32_t *tables, int64_t table_stride,
                          const int32_t *rows, const int32_t *seq, const int32_t *pos,
                          int64_t N, float *out, int64_t n_q, int64_t n_kv, int64_t d,
                          int64_t bs, float scale) {
    const int64_t group = n_q / n_kv;
    const int64_t row = n_kv * d;  // floats per cached position
    float *s = NULL;
    int64_t cap = 0;
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < N * n_kv; item++) {
        int64_t t = item / n_kv, h = item % n_kv, len = (int64_t)pos[t] + 1;
        const int32_t *table = tables + (int64_t)seq[t] * table_stride;
        if ((len + 16) * group > cap) {
            free(s);
            cap = (len + 16) * group;
            s = (float *)malloc(sizeof(float) * cap);
        }
        const float *qh = q + (int64_t)rows[t] * q_stride + h * group * d;
        float *o = out + ((int64_t)rows[t] * n_q + h * group) * d;
#ifdef SL_AVX512
        if (decode_heads(qh, k_cache + h * d, v_cache + h * d, table, bs, row, d, len, scale, s,
                         o, group))
            continue;
#endif
        scores(qh, k_cache + h * d, table, bs, row, d, len, scale, s, group);
        for (int64_t g = 0; g < group; g++) {
            softmax(s + g * len, len);
            weighted_values(s + g * len, v_cache + h * d, table, bs, row, d, len, o + g * d);
        }
    }
    free(s);
}

void sl_paged_attention(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int32_t *tables, int64_t table_stride,
                        const int32_t *rows, const int32_t *seq, const int32_t *pos, int64_t N,
                        float *out, int64_t n_q, int64_t n_kv, int64_t d, int64_t bs,
                        float scale, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    attention_for(q, q_stride, k_cache, v_cache, tables, table_stride, rows, seq, pos, N, out,
                  n_q, n_kv, d, bs, scale);
}

#ifdef SL_AVX512
// ---- prefill attention: runs of query tokens, 32 at a time -------------------------------
// sl_paged_attention reads every visible K/V row once per query token: right for decode, but a
// 700-token chunk re-reads its context 700 times and ran slower than torch's SDPA. Here a
// tile is up to 32 consecutive query tokens of one sequence (consecutive rows and positions)
// and one query head, the tokens in the lanes of two vectors (flash attention with the rows
// transposed):
// - scores of a block of ATT_KB keys: each key's element is broadcast against the tile's
//   transposed queries (qt[i] = 32 tokens' i-th element), 12 keys at a time, so the scores
//   come out as vectors of tokens per key, the layout the rest wants;
// - the online softmax (running max and sum per token) runs across lanes, no reductions;
// - the output accumulates transposed (ot[c] = 32 tokens' c-th element): each V element is
//   broadcast against the key's probabilities, 12 output elements at a time.
// Each broadcast feeds two FMAs (16-token tiles, one each, ran 1.3x slower: the loads, not
// the FMAs, set the pace). Tiles of all heads and runs are shared among the team (dynamic:
// causal tiles differ in work). The output's 12-element groups are a function inlined with a
// constant width: with the width a variable, the compiler kept the accumulators on the stack
// and branched after every FMA pair, and the output half ran at ~60% of the scores' rate.
// One thread, SmolLM2's heads: a fresh 2,048-token prompt ~27 ms a layer (~180 GFLOP/s, of
// which the softmax is ~15%), 1,024 tokens ~7 ms (~170); torch's causal SDPA on the same
// contiguous K/V takes 72 and 22 ms.
enum { ATT_TILE = 32, ATT_KB = 48 };

// ot[c0 .. c0 + C) (ATT_TILE tokens a row, scaled by alpha first) += V[j][c] * p[j] over the
// block's nk keys. Always inlined with a constant C, so the accumulators stay in registers.
static inline __attribute__((always_inline)) void pv_block(const int C, const float *const *vp,
                                                           int64_t nk, int64_t c0,
                                                           const __m512 *sc,
                                                           const __m512 *alpha, float *ot) {
    enum { V = ATT_TILE / 16 };
    __m512 acc[12][V];
    for (int c = 0; c < C; c++)
        for (int v = 0; v < V; v++)
            acc[c][v] = _mm512_mul_ps(_mm512_loadu_ps(ot + (c0 + c) * ATT_TILE + 16 * v), alpha[v]);
    for (int64_t j = 0; j < nk; j++) {
        const float *vr = vp[j] + c0;
        for (int c = 0; c < C; c++) {
            const __m512 vv = _mm512_set1_ps(vr[c]);
            for (int v = 0; v < V; v++) acc[c][v] = _mm512_fmadd_ps(vv, sc[j * V + v], acc[c][v]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int v = 0; v < V; v++) _mm512_storeu_ps(ot + (c0 + c) * ATT_TILE + 16 * v, acc[c][v]);
}

static void tile_attention(const float *q, int64_t q_stride, const float *k_cache,
                           const float *v_cache, const int32_t *table, int64_t row0,
                           int64_t pos0, int64_t T, int64_t hq, float *out, int64_t n_q,
                           int64_t n_kv, int64_t d, int64_t bs, float scale, float *qt,
                           float *ot, __m512 *sc) {
    enum { V = ATT_TILE / 16 };
    const int64_t h = hq / (n_q / n_kv), last = pos0 + T - 1;
    for (int64_t i = 0; i < d; i++)
        for (int64_t l = 0; l < ATT_TILE; l++)
            qt[i * ATT_TILE + l] = l < T ? q[(row0 + l) * q_stride + hq * d + i] * scale : 0.0f;
    for (int64_t i = 0; i < d * ATT_TILE; i++) ot[i] = 0.0f;
    __m512 m[V], lsum[V];
    __m512i lane_pos[V];
    for (int v = 0; v < V; v++) {
        m[v] = _mm512_set1_ps(-INFINITY), lsum[v] = _mm512_setzero_ps();
        lane_pos[v] = _mm512_add_epi32(_mm512_set1_epi32((int)pos0 + 16 * v),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                         12, 13, 14, 15));
    }
    const float *kp[ATT_KB], *vp[ATT_KB];
    for (int64_t kb = 0; kb <= last; kb += ATT_KB) {
        const int64_t nk = last + 1 - kb < ATT_KB ? last + 1 - kb : ATT_KB;
        // The block's K/V rows, found once (a division per key cost as much as its FMAs).
        for (int64_t j = 0, blk = kb / bs, off = kb % bs; j < nk; j++) {
            const int64_t at = ((int64_t)table[blk] * bs + off) * n_kv * d + h * d;
            kp[j] = k_cache + at, vp[j] = v_cache + at;
            if (++off == bs) off = 0, blk++;
        }
        // Scores: sc[j * V + v] = 16 tokens' scores for key j.
        int64_t j = 0;
        for (; j + 12 <= nk; j += 12) {
            __m512 acc[12][V];
            for (int c = 0; c < 12; c++)
                for (int v = 0; v < V; v++) acc[c][v] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                __m512 x[V];
                for (int v = 0; v < V; v++) x[v] = _mm512_loadu_ps(qt + i * ATT_TILE + 16 * v);
                for (int c = 0; c < 12; c++) {
                    const __m512 kv = _mm512_set1_ps(kp[j + c][i]);
                    for (int v = 0; v < V; v++) acc[c][v] = _mm512_fmadd_ps(kv, x[v], acc[c][v]);
                }
            }
            for (int c = 0; c < 12; c++)
                for (int v = 0; v < V; v++) sc[(j + c) * V + v] = acc[c][v];
        }
        for (; j < nk; j++) {
            __m512 acc[V];
            for (int v = 0; v < V; v++) acc[v] = _mm512_setzero_ps();
            for (int64_t i = 0; i < d; i++) {
                const __m512 kv = _mm512_set1_ps(kp[j][i]);
                for (int v = 0; v < V; v++)
                    acc[v] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(qt + i * ATT_TILE + 16 * v),
                                             acc[v]);
            }
            for (int v = 0; v < V; v++) sc[j * V + v] = acc[v];
        }
        // Causal mask, then the online softmax, each lane its own token.
        __m512 alpha[V];
        for (int v = 0; v < V; v++) {
            __m512 bm = m[v];
            for (j = 0; j < nk; j++) {
                __m512 *x = sc + j * V + v;
                if (kb + j > pos0 + 16 * v)  // keys after some token's position
                    *x = _mm512_mask_blend_ps(
                        _mm512_cmp_epi32_mask(lane_pos[v], _mm512_set1_epi32((int)(kb + j)),
                                              _MM_CMPINT_LT),
                        *x, _mm512_set1_ps(-INFINITY));
                bm = _mm512_max_ps(bm, *x);
            }
            // Every token sees key 0, so bm is finite from the first block on.
            alpha[v] = exp16(_mm512_sub_ps(m[v], bm));
            m[v] = bm;
            lsum[v] = _mm512_mul_ps(lsum[v], alpha[v]);
            for (j = 0; j < nk; j++) {
                __m512 *x = sc + j * V + v;
                *x = exp16(_mm512_sub_ps(*x, bm));
                lsum[v] = _mm512_add_ps(lsum[v], *x);
            }
        }
        // Output: ot[c] (16 tokens a vector) += V[j][c] * p[j], 12 elements at a time.
        int64_t c0 = 0;
        for (; c0 + 12 <= d; c0 += 12) pv_block(12, vp, nk, c0, sc, alpha, ot);
        switch (d - c0) {
        case 0: break;
        case 4: pv_block(4, vp, nk, c0, sc, alpha, ot); break;
        case 8: pv_block(8, vp, nk, c0, sc, alpha, ot); break;
        default:
            for (; c0 < d; c0++) pv_block(1, vp, nk, c0, sc, alpha, ot);
        }
    }
    float inv[ATT_TILE];
    for (int v = 0; v < V; v++)
        _mm512_storeu_ps(inv + 16 * v, _mm512_div_ps(_mm512_set1_ps(1.0f), lsum[v]));
    for (int64_t l = 0; l < T; l++)
        for (int64_t c = 0; c < d; c++)
            out[(row0 + l) * n_q * d + hq * d + c] = ot[c * ATT_TILE + l] * inv[l];
}

int sl_prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *tables, int64_t table_stride,
                         const int32_t *rows, const int32_t *seq, const int32_t *pos, int64_t N,
                         float *out, int64_t n_q, int64_t n_kv, int64_t d, int64_t bs,
                         float scale, int num_threads) {
    // Tiles: runs of up to ATT_TILE tokens with consecutive rows and positions in one sequence.
    int64_t *start = malloc(sizeof(int64_t) * (N + 1)), n_tiles = 0;
    for (int64_t t = 0; t < N;) {
        int64_t e = t + 1;
        while (e < N && e - t < ATT_TILE && seq[e] == seq[t] && rows[e] == rows[e - 1] + 1 &&
               pos[e] == pos[e - 1] + 1)
            e++;
        start[n_tiles++] = t;
        t = e;
    }
    start[n_tiles] = N;
#pragma omp parallel num_threads(num_threads)
    {
        float *qt = malloc(sizeof(float) * d * ATT_TILE), *ot = malloc(sizeof(float) * d * ATT_TILE);
        __m512 *sc = aligned_alloc(64, sizeof(__m512) * ATT_KB * (ATT_TILE / 16));
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n_tiles * n_q; w++) {
            const int64_t t = start[w / n_q], T = start[w / n_q + 1] - t;
            tile_attention(q, q_stride, k_cache, v_cache, tables + seq[t] * table_stride,
                           rows[t], pos[t], T, w % n_q, out, n_q, n_kv, d, bs, scale, qt, ot,
                           sc);
        }
        free(qt), free(ot), free(sc);
    }
    free(start);
    return 1;
}
#else
int sl_prefill_attention(const float *q, int64_t q_stride, const float *k_cache,
                         const float *v_cache, const int32_t *tables, int64_t table_stride,
                         const int32_t *rows, const int32_t *seq, const int32_t *pos, int64_t N,
                         float *out, int64_t n_q, int64_t n_kv, int64_t d, int64_t bs,
                         float scale, int num_threads) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)tables, (void)table_stride,
        (void)rows, (void)seq, (void)pos, (void)N, (void)out, (void)n_q, (void)n_kv, (void)d,
        (void)bs, (void)scale, (void)num_threads;
    return 0;  // not built: the caller uses another path
}
#endif

// ---- the per-token glue between the matrix products --------------------------------
// One call each instead of the 3-8 small torch ops they replace: at decode sizes the ops'
// dispatch cost, not their arithmetic, is what a step pays for.

// out[r] = x[r] / rms(x[r]) * w, rows of x x_stride floats apart.
static void rms_norm_for(const float *x, int64_t x_stride, const float *w, float *out,
                         int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(ss / dim + eps));
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv),
                                                  _mm256_loadu_ps(w + i)));
        for (; i < dim; i++) o[i] = xr[i] * (1.0f / sqrtf(ss / dim + eps)) * w[i];
    }
}

// The glue's own parallel regions only open for many rows: for a few, waking the team
// costs more than the work.
void sl_rms_norm(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows,
                 int64_t dim, float eps, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 8)
    rms_norm_for(x, x_stride, w, out, rows, dim, eps);
}

// out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: SwiGLU on the fused gate/up product.
static void silu_mul_for(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#ifdef SL_AVX512
        for (; i + 16 <= inter; i += 16) {
            const __m512 gv = _mm512_loadu_ps(g + i);
            const __m512 sig = _mm512_div_ps(
                _mm512_set1_ps(1.0f),
                _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(u + i)));
        }
#endif
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

void sl_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 8)
    silu_mul_for(gu, out, rows, inter);
}

// Rotary embedding in place on the q and k heads of each token's fused qkv row (heads'
// rotary pairs adjacent: (2i, 2i + 1), as the loader lays them out), then the token's k
// and v are stored at its cache slot. rope is [max_pos, d / 2] of (cos, sin) pairs.
static void rope_store_for(float *qkv, int64_t rows, int64_t n_q, int64_t n_kv, int64_t d,
                           const float *rope, const int64_t *positions, float *k_cache,
                           float *v_cache, const int64_t *slots) {
    const int64_t width = (n_q + 2 * n_kv) * d, rot = (n_q + n_kv) * d;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *row = qkv + r * width;
        const float *cs = rope + positions[r] * d;  // d / 2 pairs of 2 floats
        for (int64_t h = 0; h < rot; h += d)
            for (int64_t i = 0; i < d; i += 2) {
                float a = row[h + i], b = row[h + i + 1], c = cs[i], s = cs[i + 1];
                row[h + i] = a * c - b * s;
                row[h + i + 1] = a * s + b * c;
            }
        if (k_cache) {
            float *kd = k_cache + slots[r] * n_kv * d, *vd = v_cache + slots[r] * n_kv * d;
            for (int64_t i = 0; i < n_kv * d; i++) {
                kd[i] = row[n_q * d + i];
                vd[i] = row[rot + i];
            }
        }
    }
}

void sl_rope_store(float *qkv, int64_t rows, int64_t n_q, int64_t n_kv, int64_t d,
                   const float *rope, const int64_t *positions, float *k_cache,
                   float *v_cache, const int64_t *slots, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows > 8)
    rope_store_for(qkv, rows, n_q, n_kv, d, rope, positions, k_cache, v_cache, slots);
}

// ---- a whole decoder stack per call ------------------------------------------------
// A few-token step (decode, drafts, short chunks: every token's attention on the paged
// kernel) pays per layer ~10 kernel calls from Python, each with its own team wake-up;
// at batch 1 that was ~7 ms of a ~30 ms step. Here all layers run in one parallel
// region, phases separated by barriers.

// One layer's tensors, in this order (the caller passes n_layers of these back to back).
typedef struct {
    const float *ln1;
    const void *qkv_w;  // the four products' weights are fp32 or blocks of `kind`
    const float *qkv_b;
    const void *o_w;
    const float *ln2;
    const void *gate_up_w, *down_w;
    float *k_cache, *v_cache;  // [num_blocks, bs, n_kv, d]
} layer_ptrs;

// x [m, hidden] (the embedded tokens) becomes the last layer's output, before the final
// norm. qkv_b may be NULL. Token r is at positions[r] and stores its K/V at slots[r];
// attention as in sl_paged_attention over the N query tokens rows/seq/pos (normally
// every token of the batch).
void sl_decoder_stack(float *x, int64_t m, const layer_ptrs *layers, int64_t n_layers,
                      int64_t hidden, int64_t n_q, int64_t n_kv, int64_t d, int64_t inter,
                      float eps, const float *rope, const int64_t *positions,
                      const int64_t *slots, const int32_t *tables, int64_t table_stride,
                      const int32_t *rows, const int32_t *seq, const int32_t *pos, int64_t N,
                      int64_t bs, int kind, int num_threads) {
    const int64_t width = (n_q + 2 * n_kv) * d;
    const float scale = 1.0f / sqrtf((float)d);
    float *h = malloc(sizeof(float) * m * hidden), *qkv = malloc(sizeof(float) * m * width);
    float *att = malloc(sizeof(float) * m * n_q * d);
    float *gu = malloc(sizeof(float) * m * 2 * inter), *act = malloc(sizeof(float) * m * inter);
#pragma omp parallel num_threads(num_threads)
    for (int64_t l = 0; l < n_layers; l++) {
        const layer_ptrs *L = layers + l;
        rms_norm_for(x, hidden, L->ln1, h, m, hidden, eps);
        any_linear_for(h, L->qkv_w, L->qkv_b, qkv, m, width, hidden, 0, kind);
        rope_store_for(qkv, m, n_q, n_kv, d, rope, positions, L->k_cache, L->v_cache, slots);
        attention_for(qkv, width, L->k_cache, L->v_cache, tables, table_stride, rows, seq, pos,
                      N, att, n_q, n_kv, d, bs, scale);
        any_linear_for(att, L->o_w, NULL, x, m, hidden, n_q * d, 1, kind);
        rms_norm_for(x, hidden, L->ln2, h, m, hidden, eps);
        any_linear_for(h, L->gate_up_w, NULL, gu, m, 2 * inter, hidden, 0, kind);
        silu_mul_for(gu, act, m, inter);
        any_linear_for(act, L->down_w, NULL, x, m, hidden, inter, 1, kind);
    }
    free(h), free(qkv), free(att), free(gu), free(act);
}
