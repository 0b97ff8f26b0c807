/* Few-row GEMM on block-quantized weights as GGUF files hold them: y[n, m] = x[n, k] . W[m, k]^T,
 * x float32, W in blocks of 32 inputs with a scale (and an offset) per block and output.
 *
 * Why: a user who brings a Q4_1 or Q8_0 GGUF knows that model as it runs quantized, and a CPU
 * decode step is bound by reading the weights: SmolLM2-135M's linear layers are 540 MB in float32
 * and ~96 MB as the file holds them (20 bytes per 32 weights in Q4_1, 34 in Q8_0).
 *
 * Two arithmetics, each its own kernel below:
 *   - float32 activations (precision "gguf-float", AVX-512): the weights widened to float32 in
 *     registers per use, one float FMA per weight and row; this first part of the file;
 *   - 8-bit activations (precision "gguf", the default: llama.cpp's arithmetic), integer dot
 *     products on AVX-512 VNNI or AVX2 with the same bits on both; the second part.
 *
 * Formats of the float-activation kernel (after tandem/engine/quant.py repacks a GGUF tensor;
 * w = q * d + m for every kind):
 *   Q4 (GGUF Q4_0 with m = -8 d, and Q4_1): q in 0..15, two inputs per byte: for panel p, input
 *       pair j and lane o, byte [p][j][o] holds q[o][2j] in its low and q[o][2j+1] in its high nibble;
 *   Q8 (GGUF Q8_0, m = 0): q in -127..127, int8 [p][k][16].
 *   d, m: float32 [p][k/32][16] (GGUF keeps them as float16: widening is exact).
 * Panels of 16 outputs, as in panel.c: one 64-byte vector holds 16 outputs' widened weights at one
 * input, so no horizontal sums; a tile of R rows x P panels keeps R*P accumulators in registers.
 *
 * Arithmetic: the weight is formed as fma(q, d, m) (one rounding of q d + m; for Q4_0 exactly
 * d (q - 8) rounded once, GGUF's definition) and every output is one chain
 * acc = fma(x[r][kk], w[o][kk], acc) over kk = 0..k-1 from 0, whatever the tile, the row count,
 * the row's place or the thread count. So a row's result has the same bits alone or in a block:
 * plain decoding and verification compute the same numbers (the lossless rule needs no more).
 * Reference: dequantize, then F.linear (tandem/engine/quant.py; tests compare within rounding).
 *
 * Built at first use like gemv.c; tandem_quant_available() / tandem_quant_a_available() say which
 * kernel this host's build has (quant.py offers only those; with neither, a GGUF is dequantized to
 * float32 as before).
 */
#include <stddef.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif


#define LANES 16
#define BLOCK 32 /* inputs per scale: GGUF's Q4_0, Q4_1 and Q8_0 */
/* Software prefetch of the weights this far ahead of the block being read, into L2 (_MM_HINT_T1).
 * Why: the hardware prefetchers stop at every 4 KB page and ramp up again, and a one-token step
 * reads each weight once, so without it every page's first lines wait for memory. Measured on the
 * 2-core Intel Xeon host (Granite Rapids class) for the default target: a one-token step at 300
 * tokens 5.90 -> 4.19 ms at 8 KB ahead (2 KB: 5.14, 4 KB: 4.40, 16 KB: 4.17; into L1 instead:
 * 4.63 at 8 KB; non-temporal: 1.6x slower). Prefetching never changes a result's bits. */
#define PF_AHEAD 8192

#ifdef __AVX512F__

#define MAX_R 8   /* rows per tile of 2 panels: 8 x 2 accumulators, 2 x (d, m) and the widened weights fit 32 registers */
#define MAX_R1 16 /* rows per tile of 1 panel: a verification block of 9-16 rows widens each weight once */

/* The widened weights of 16 outputs at inputs kk (and kk + 1 for Q4) of one panel. */
static inline __attribute__((always_inline)) void widen(const void *restrict q, size_t at, const int Q4,
                                                        __m512 d, __m512 m, __m512 *w0, __m512 *w1) {
    if (Q4) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const unsigned char *)q + at)));
        *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), d, m);
        *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d, m);
    } else {
        *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const signed char *)q + at)))), d, m);
        *w1 = *w0;
    }
}

/* R rows x P panels over all k inputs; R, P, Q4 are constants at every call (inlined from the
 * switch below), so the accumulators stay in registers. q: the group's first panel; qstride: bytes
 * per panel; dm: the group's first panel's d, then m at +mstride floats. */
static inline __attribute__((always_inline)) void tile(const float *restrict x, size_t ldx, const void *restrict q,
                                                       size_t qstride, const float *restrict dm, size_t dstride,
                                                       size_t mstride, int k, const int R, const int P, const int Q4,
                                                       float *restrict y, size_t ldy, int col0, int m) {
    __m512 acc[MAX_R1][2];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int b = 0; b < k / BLOCK; b++) {
        __m512 d[2], mm[2];
        /* software prefetch, PF_AHEAD in each stream (weights, scales, offsets) */
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            const char *qa = (const char *)q + p * qstride + (size_t)(Q4 ? b * BLOCK / 2 : b * BLOCK) * LANES;
            for (int l = 0; l < BLOCK * LANES / (1 + Q4); l += 64) _mm_prefetch(qa + PF_AHEAD + l, _MM_HINT_T1);
            _mm_prefetch((const char *)(dm + p * dstride + (size_t)b * LANES) + PF_AHEAD, _MM_HINT_T1);
            _mm_prefetch((const char *)(dm + mstride + p * dstride + (size_t)b * LANES) + PF_AHEAD, _MM_HINT_T1);
        }
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            d[p] = _mm512_loadu_ps(dm + p * dstride + (size_t)b * LANES);
            mm[p] = _mm512_loadu_ps(dm + mstride + p * dstride + (size_t)b * LANES);
        }
        for (int kk = b * BLOCK; kk < (b + 1) * BLOCK; kk += 1 + Q4) {
            __m512 w0[2], w1[2];
#pragma GCC unroll 2
            for (int p = 0; p < P; p++)
                widen(q, p * qstride + (size_t)(Q4 ? kk / 2 : kk) * LANES, Q4, d[p], mm[p], &w0[p], &w1[p]);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                const __m512 x0 = _mm512_set1_ps(x[r * ldx + kk]);
#pragma GCC unroll 2
                for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(x0, w0[p], acc[r][p]);
                if (Q4) {
                    const __m512 x1 = _mm512_set1_ps(x[r * ldx + kk + 1]);
#pragma GCC unroll 2
                    for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(x1, w1[p], acc[r][p]);
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int p = 0; p < P; p++) {
            const int col = col0 + p * LANES;
            if (col + LANES <= m)
                _mm512_storeu_ps(y + r * ldy + col, acc[r][p]);
            else if (col < m)
                _mm512_mask_storeu_ps(y + r * ldy + col, (__mmask16)((1u << (m - col)) - 1u), acc[r][p]);
        }
}

#define TILE_(R, P) tile(xr, (size_t)k, qp, qstride, dp, dstride, mstride, k, R, P, Q4, yr, (size_t)m, p0 * LANES, m)
#define ROWS_(P)                                                                                                    \
    switch (R) {                                                                                                   \
    case 1: TILE_(1, P); break;                                                                                    \
    case 2: TILE_(2, P); break;                                                                                    \
    case 3: TILE_(3, P); break;                                                                                    \
    case 4: TILE_(4, P); break;                                                                                    \
    case 5: TILE_(5, P); break;                                                                                    \
    case 6: TILE_(6, P); break;                                                                                    \
    case 7: TILE_(7, P); break;                                                                                    \
    default: TILE_(8, P); break;                                                                                   \
    }
#define WIDE_ROWS                                                                                                  \
    switch (R) {                                                                                                   \
    case 9: TILE_(9, 1); break;                                                                                    \
    case 10: TILE_(10, 1); break;                                                                                  \
    case 11: TILE_(11, 1); break;                                                                                  \
    case 12: TILE_(12, 1); break;                                                                                  \
    case 13: TILE_(13, 1); break;                                                                                  \
    case 14: TILE_(14, 1); break;                                                                                  \
    case 15: TILE_(15, 1); break;                                                                                  \
    default: TILE_(16, 1); break;                                                                                  \
    }

int tandem_quant_available(void) { return 1; }

static inline __attribute__((always_inline)) void rows(const float *restrict x, const void *restrict q,
                                                       const float *restrict d, const float *restrict mo,
                                                       float *restrict y, int n, int m, int k, int threads,
                                                       const int Q4) {
    const int panels = (m + LANES - 1) / LANES;
    const size_t qstride = (size_t)k * LANES / (Q4 ? 2 : 1), dstride = (size_t)(k / BLOCK) * LANES;
    const size_t mstride = (size_t)(mo - d); /* m sits at a fixed distance after d (one allocation) */
    /* 9-16 rows (verification blocks): one tile over one panel, so each widened weight serves every
     * row instead of being widened once per tile (a 9-token step 0.94x the two-tile form's time on
     * the EPYC host; the rest of it is the FMAs themselves: 9 per weight and row pair) */
    const int wide = n > MAX_R && n <= MAX_R1;
    const int group = wide ? 1 : 2;
    const int tiles = wide ? 1 : (n + MAX_R - 1) / MAX_R;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int begin = (int)((long)panels * t / T), end = (int)((long)panels * (t + 1) / T);
        for (int p0 = begin; p0 < end; p0 += group) {
            const int P = end - p0 < group ? end - p0 : group;
            const void *qp = (const unsigned char *)q + (size_t)p0 * qstride;
            const float *dp = d + (size_t)p0 * dstride;
            /* tiles of near-equal height over the same panel pair, which the first brought into L2 */
            for (int j = 0, r0 = 0; j < tiles; j++) {
                const int R = (n - r0) / (tiles - j);
                const float *xr = x + (size_t)r0 * k;
                float *yr = y + (size_t)r0 * m;
                r0 += R;
                if (wide) {
                    WIDE_ROWS
                } else if (P == 1) {
                    ROWS_(1)
                } else {
                    ROWS_(2)
                }
            }
        }
    }
}

/* x: [n, k] float32 row-major (k a multiple of 32); q, d, m as above, where m = d + the m offset
 * within one float32 buffer [2][panels][k/32][16]; y: [n, m] row-major. threads: torch's intra-op
 * count (torch's own OpenMP pool). Each thread takes a contiguous run of panels. */
void tandem_quant_rows_q4(const float *restrict x, const unsigned char *restrict q, const float *restrict dm,
                          float *restrict y, int n, int m, int k, int threads) {
    const size_t half = (size_t)((m + LANES - 1) / LANES) * (size_t)(k / BLOCK) * LANES;
    rows(x, q, dm, dm + half, y, n, m, k, threads, 1);
}

void tandem_quant_rows_q8(const float *restrict x, const signed char *restrict q, const float *restrict dm,
                          float *restrict y, int n, int m, int k, int threads) {
    const size_t half = (size_t)((m + LANES - 1) / LANES) * (size_t)(k / BLOCK) * LANES;
    rows(x, q, dm, dm + half, y, n, m, k, threads, 0);
}


#else /* no AVX-512: a quantized target is not offered (tandem_quant_available) */

int tandem_quant_available(void) { return 0; }

void tandem_quant_rows_q4(const float *x, const unsigned char *q, const float *dm, float *y, int n, int m, int k,
                          int threads) {
    (void)x, (void)q, (void)dm, (void)y, (void)n, (void)m, (void)k, (void)threads;
}

void tandem_quant_rows_q8(const float *x, const signed char *q, const float *dm, float *y, int n, int m, int k,
                          int threads) {
    (void)x, (void)q, (void)dm, (void)y, (void)n, (void)m, (void)k, (void)threads;
}

#endif

/* ---- 8-bit activations (precision "gguf", llama.cpp's arithmetic): integer dot products per block ----
 *
 * Why: with float32 activations every weight costs one float FMA per row, so a 9-row verification
 * block costs 2-2.7x one row (compute-bound). llama.cpp quantizes the activations to 8 bits per
 * block of 32 and sums integer products; one AVX-512 VNNI instruction then does 64 products. This is
 * the same definition of the model as llama.cpp's (up to its float summation order).
 *
 * Arithmetic (the definition, shared by the vector kernel and tandem_quant_rows_a_ref):
 *   per row and block of 32 inputs: dx = max|x| / 127, xq = nearest-even(x * (1 / dx)) (0 where
 *   dx is 0), sx = sum(xq), sxd = dx * sx;
 *   per output, from acc = 0, over blocks in order: s = sum(q * xq) (exact integers),
 *   acc = fma(s, d * dx, acc), then for Q4 acc = fma(m, sxd, acc) (Q8_0 has m = 0: skipped).
 * Everything a row's result depends on is that row's own numbers in a fixed order, so a row gets the
 * same bits alone, in any block, at any thread count (tested), and the same on a host without VNNI
 * running the reference.
 *
 * Layout (quant.py packs it): one stream per panel of 16 outputs, block after block, each block
 * the file's bytes for those outputs (20 per output and block for Q4_1, 34 for Q8_0), so a step
 * reads what the file holds and in one sequential pass. A Q4 block: 256 bytes of weights, where
 * byte [h][o][t] (h = 0..3, lane o, t = 0..3) holds q[o][32b + 4h + t] in its low and
 * q[o][32b + 16 + 4h + t] in its high nibble (one 64-byte load gives two VNNI operands of 4 inputs x
 * 16 lanes), then d[16] and m[16] as float16 (the file's; widening is exact). A Q8 block: 512 bytes,
 * [j][o][t] = q[o][32b + 4j + t] + 128 (VNNI multiplies unsigned by signed bytes; the 128 sx it adds
 * is taken off exactly), then d[16] as float16.
 */
/* Blocks [begin, end) of the row-major n x k/32 blocks of x (k a multiple of 32, so block i of the
 * flat array is row i / (k/32)'s block i % (k/32)): the 8-bit activations as defined above. */
static void quantize_range(const float *restrict x, long begin, long end, signed char *restrict xq,
                           float *restrict dx, float *restrict sxd, int *restrict sx) {
    for (long i = begin; i < end; i++) {
        const float *v = x + (size_t)i * BLOCK;
        signed char *o = xq + (size_t)i * BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int s = 0;
        for (int j = 0; j < BLOCK; j++) {
            const int qi = (int)nearbyintf(v[j] * id);
            o[j] = (signed char)qi;
            s += qi;
        }
        dx[i] = d, sx[i] = s, sxd[i] = d * (float)s;
    }
}

/* The definition in plain C, one output at a time: the tests' bit-exact reference for the vector
 * kernels. q: [m][k] the quantized values (Q4 0..15, Q8 -127..127); d, mo: [m][k/32]. */
void tandem_quant_rows_a_ref(const float *restrict x, const signed char *restrict q, const float *restrict d,
                             const float *restrict mo, float *restrict y, int n, int m, int k, int has_m) {
    const int nb = k / BLOCK;
    signed char *xq = malloc((size_t)n * k);
    float *dx = malloc(sizeof(float) * (size_t)n * nb * 2);
    int *sx = malloc(sizeof(int) * (size_t)n * nb);
    const float *sxd = dx + (size_t)n * nb;
    quantize_range(x, 0, (long)n * nb, xq, dx, dx + (size_t)n * nb, sx);
    for (int r = 0; r < n; r++)
        for (int o = 0; o < m; o++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int s = 0;
                for (int i = 0; i < BLOCK; i++)
                    s += (int)q[(size_t)o * k + (size_t)b * BLOCK + i] * (int)xq[(size_t)r * k + (size_t)b * BLOCK + i];
                acc = fmaf((float)s, d[(size_t)o * nb + b] * dx[(size_t)r * nb + b], acc);
                if (has_m) acc = fmaf(mo[(size_t)o * nb + b], sxd[(size_t)r * nb + b], acc);
            }
            y[(size_t)r * m + o] = acc;
        }
    free(xq), free(dx), free(sx);
}

#define A_BLOCK_BYTES(Q4) ((Q4) ? 16 * 20 : 16 * 34) /* one panel's block: the file's bytes for 16 outputs */
#define A_SCALES(Q4) ((Q4) ? 256 : 512)                /* where its scales start */
/* Prefetch [p, p + bytes) ahead by PF_AHEAD, not past `end` (a thread's share of the weight: the
 * lines after it are another thread's or another buffer's). */
static inline __attribute__((always_inline)) void prefetch_ahead(const unsigned char *p, int bytes,
                                                                 const unsigned char *end) {
#if defined(__AVX2__) || defined(__AVX512F__)
    for (int l = 0; l < bytes; l += 64)
        if (p + PF_AHEAD + l < end) _mm_prefetch((const char *)(p + PF_AHEAD + l), _MM_HINT_T1);
#else
    (void)p, (void)bytes, (void)end;
#endif
}

#define MAX_RA 4 /* rows per tile with two integer sums a row: 4 float + 8 integer accumulators (8 rows spilled on AVX-512) */

static inline __attribute__((always_inline)) int load4(const signed char *p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

/* Block b of a tile_a call: its weights qb and the rows' activations xb, the weights ahead prefetched. */
#define A_BLOCK_AT(b)                                                  \
    const unsigned char *qb = q + (size_t)(b) * A_BLOCK_BYTES(Q4);     \
    const signed char *xb = xq + (size_t)(b) * BLOCK;                  \
    if (pf_end) prefetch_ahead(qb, A_BLOCK_BYTES(Q4), pf_end)

/* tile_a's arguments, the same in its VNNI and AVX2 forms below. */
#define TILE_A_SIGNATURE                                                                                       \
    static inline __attribute__((always_inline)) void tile_a(                                                  \
        const signed char *restrict xq, const float *restrict dx, const float *restrict sxd,                   \
        const int *restrict sx, int k, const unsigned char *restrict q, const unsigned char *restrict sc,      \
        const int R, const int Q4, float *restrict y, size_t ldy, int col, int m, const unsigned char *pf_end)

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VW 16 /* outputs per vector: a whole panel */
#define MAX_RT 9 /* rows per tile: past 4 rows one integer sum a row, so a 9-row verification block is one tile
                   * and each weight is unpacked once for it, not once per 3-row tile (9-row step at 300
                   * tokens 10.40 -> 8.95 ms on the Intel host; 9 float + 9 integer accumulators fit) */
#define A_ISA "AVX-512 VNNI"

/* quantize_range in vector form: the same operations in the same order per element (max, divide,
 * reciprocal, multiply, nearest-even), so the same bytes (tests compare it with the reference,
 * which uses the scalar form) */
static void quantize_blocks(const float *restrict x, long begin, long end, signed char *restrict xq,
                            float *restrict dx, float *restrict sxd, int *restrict sx) {
    for (long i = begin; i < end; i++) {
        const float *v = x + (size_t)i * BLOCK;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + LANES);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(xq + (size_t)i * BLOCK), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + (size_t)i * BLOCK + LANES), _mm512_cvtsepi32_epi8(q1));
        const int s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        dx[i] = d, sx[i] = s, sxd[i] = d * (float)s;
    }
}

/* R rows x the 16 outputs of one panel over all k inputs. q: the panel's first block's weights, sc:
 * its scales (then offsets), both a block's bytes apart per block; xq, dx, sxd, sx: the tile's first
 * row. One VNNI instruction multiplies
 * 4 inputs x 16 outputs; two integer sums per row halve the dependency chain (integer addition is
 * exact, so their order is free). */
TILE_A_SIGNATURE {
    const int nb = k / BLOCK;
    /* up to 4 rows: two integer sums per row (halving each dependency chain); more rows: one, so
     * that 9 rows' sums and results fit the 32 registers (integer addition is exact: same sums) */
    const int two = R <= 4;
    __m512 acc[MAX_RT];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int b = 0; b < nb; b++) {
        __m512i s0[MAX_RT], s1[MAX_RT];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_si512();
        A_BLOCK_AT(b);
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) {
            __m512i w0, w1;
            if (Q4) { /* inputs 4h.. in the low nibbles, 16 + 4h.. in the high ones */
                const __m512i v = _mm512_loadu_si512(qb + h * 64);
                w0 = _mm512_and_si512(v, low), w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            } else { /* inputs 8h.. and 8h + 4.. */
                w0 = _mm512_loadu_si512(qb + (2 * h) * 64), w1 = _mm512_loadu_si512(qb + (2 * h + 1) * 64);
            }
            const int a0 = Q4 ? 4 * h : 8 * h, a1 = Q4 ? 16 + 4 * h : 8 * h + 4;
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) {
                s0[r] = _mm512_dpbusd_epi32(s0[r], w0, _mm512_set1_epi32(load4(xb + (size_t)r * k + a0)));
                if (two)
                    s1[r] = _mm512_dpbusd_epi32(s1[r], w1, _mm512_set1_epi32(load4(xb + (size_t)r * k + a1)));
                else
                    s0[r] = _mm512_dpbusd_epi32(s0[r], w1, _mm512_set1_epi32(load4(xb + (size_t)r * k + a1)));
            }
        }
        const unsigned char *sb = sc + (size_t)b * A_BLOCK_BYTES(Q4);
        const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
        const __m512 mv = Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 2 * LANES))) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            __m512i s = two ? _mm512_add_epi32(s0[r], s1[r]) : s0[r];
            if (!Q4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * sx[(size_t)r * nb + b])); /* stored q + 128 */
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dv, _mm512_set1_ps(dx[(size_t)r * nb + b])), acc[r]);
            if (Q4) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sxd[(size_t)r * nb + b]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        if (col + LANES <= m)
            _mm512_storeu_ps(y + r * ldy + col, acc[r]);
        else if (col < m)
            _mm512_mask_storeu_ps(y + r * ldy + col, (__mmask16)((1u << (m - col)) - 1u), acc[r]);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define VW 8 /* outputs per vector: half a panel */
#define MAX_RT MAX_RA /* rows per tile: AVX2 has 16 registers */
#define A_ISA "AVX2"

static void quantize_blocks(const float *restrict x, long begin, long end, signed char *restrict xq,
                            float *restrict dx, float *restrict sxd, int *restrict sx) {
    quantize_range(x, begin, end, xq, dx, sxd, sx);
}

/* R rows x 8 outputs (half a panel: q and sc point at the half's first lane in the first block's
 * weights and scales; the layout keeps a 64-byte stride per 4 inputs). AVX2 has no VNNI: maddubs multiplies unsigned by signed
 * bytes into 16-bit pair sums, madd with ones widens them to 32 bits, the same 4-input sums as
 * VNNI's, exactly: Q4 pairs are at most 2 x 15 x 127; Q8 goes through the sign trick (|x| times q
 * with x's sign: pairs at most 2 x 127 x 127, no saturation), so it needs no 128 sx correction. */
TILE_A_SIGNATURE {
    const int nb = k / BLOCK;
    __m256 acc[MAX_RA];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    for (int b = 0; b < nb; b++) {
        __m256i s[MAX_RA];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        A_BLOCK_AT(b);
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++) {
            __m256i w0, w1;
            if (Q4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qb + h * 64));
                w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            } else { /* back to signed q */
                w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qb + (2 * h) * 64)), flip);
                w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qb + (2 * h + 1) * 64)), flip);
            }
            const int a0 = Q4 ? 4 * h : 8 * h, a1 = Q4 ? 16 + 4 * h : 8 * h + 4;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m256i x0 = _mm256_set1_epi32(load4(xb + (size_t)r * k + a0));
                const __m256i x1 = _mm256_set1_epi32(load4(xb + (size_t)r * k + a1));
                __m256i p0, p1;
                if (Q4) {
                    p0 = _mm256_maddubs_epi16(w0, x0), p1 = _mm256_maddubs_epi16(w1, x1);
                } else {
                    p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(x0), _mm256_sign_epi8(w0, x0));
                    p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(x1), _mm256_sign_epi8(w1, x1));
                }
                if (Q4) /* two 16-bit pair sums of at most 3,810 add without overflow */
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones));
                else
                    s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)));
            }
        }
        const unsigned char *sb = sc + (size_t)b * A_BLOCK_BYTES(Q4);
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        const __m256 mv = Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 2 * LANES))) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dv, _mm256_set1_ps(dx[(size_t)r * nb + b])), acc[r]);
            if (Q4) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sxd[(size_t)r * nb + b]), acc[r]);
        }
    }
    (void)sx;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        if (col + VW <= m) {
            _mm256_storeu_ps(y + r * ldy + col, acc[r]);
        } else if (col < m) {
            float part[VW];
            _mm256_storeu_ps(part, acc[r]);
            for (int o = 0; o < m - col; o++) y[r * ldy + col + o] = part[o];
        }
    }
}
#endif

#ifdef VW
#define TILE_A(R) tile_a(xq + (size_t)r0 * k, dx + (size_t)r0 * nb, sxd + (size_t)r0 * nb, sx + (size_t)r0 * nb, k, \
                         qp, sp, R, Q4, y + (size_t)r0 * m, (size_t)m, col, m, pf)

/* Panels [begin, end) for all n rows, the activations already quantized. Q4 must be a literal at
 * each call: the parallel region below is outlined by the compiler, which does not carry a
 * constant into it, so it calls this once per kind. */
static inline __attribute__((always_inline)) void panels_a(const signed char *restrict xq, const float *restrict dx,
                                                           const float *restrict sxd, const int *restrict sx,
                                                           const unsigned char *restrict q, float *restrict y, int n,
                                                           int m, int k, int begin, int end, const int Q4) {
    const int nb = k / BLOCK, tiles = (n + MAX_RT - 1) / MAX_RT;
    const size_t pstride = (size_t)nb * A_BLOCK_BYTES(Q4);
    const unsigned char *end_q = q + (size_t)end * pstride; /* this thread's share ends here */
    for (int p = begin; p < end; p++)
        for (int part = 0; part < LANES / VW; part++) { /* AVX2: each half of the panel */
            const unsigned char *qp = q + (size_t)p * pstride + (size_t)part * VW * 4;
            const unsigned char *sp = q + (size_t)p * pstride + A_SCALES(Q4) + (size_t)part * VW * 2;
            const int col = p * LANES + part * VW;
            for (int j = 0, r0 = 0; j < tiles; j++) {
                const int R = (n - r0) / (tiles - j);
                /* the first pass over a panel prefetches; later row tiles and the AVX2 second half
                 * read it from cache */
                const unsigned char *pf = j == 0 && part == 0 ? end_q : NULL;
                switch (R) {
                case 1: TILE_A(1); break;
                case 2: TILE_A(2); break;
                case 3: TILE_A(3); break;
#if MAX_RT > 4
                case 4: TILE_A(4); break;
                case 5: TILE_A(5); break;
                case 6: TILE_A(6); break;
                case 7: TILE_A(7); break;
                case 8: TILE_A(8); break;
                default: TILE_A(9); break;
#else
                default: TILE_A(4); break;
#endif
                }
                r0 += R;
            }
        }
}

static void rows_a(const float *restrict x, const unsigned char *restrict q, float *restrict y, int n, int m, int k,
                   int threads, const int Q4) {
    const int nb = k / BLOCK, panels = (m + LANES - 1) / LANES;
    signed char *xq = malloc((size_t)n * k);
    float *dx = malloc(sizeof(float) * (size_t)n * nb * 2);
    int *sx = malloc(sizeof(int) * (size_t)n * nb);
    float *sxd = dx + (size_t)n * nb;
    const long blocks = (long)n * nb;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        /* the activations first, each thread a share, then every thread reads all (quantizing a
         * decode step's few blocks on one thread before the region measured the same, 0.99x) */
        quantize_blocks(x, blocks * t / T, blocks * (t + 1) / T, xq, dx, sxd, sx);
#pragma omp barrier
        const int begin = (int)((long)panels * t / T), end = (int)((long)panels * (t + 1) / T);
        if (Q4)
            panels_a(xq, dx, sxd, sx, q, y, n, m, k, begin, end, 1);
        else
            panels_a(xq, dx, sxd, sx, q, y, n, m, k, begin, end, 0);
    }
    free(xq), free(dx), free(sx);
}

int tandem_quant_a_available(void) { return 1; }

const char *tandem_quant_a_isa(void) { return A_ISA; }

/* x: [n, k] float32 row-major (k a multiple of 32); q: the packed weights as above; y: [n, m]. */
void tandem_quant_rows_q4a(const float *restrict x, const unsigned char *restrict q, float *restrict y, int n, int m,
                           int k, int threads) {
    rows_a(x, q, y, n, m, k, threads, 1);
}

void tandem_quant_rows_q8a(const float *restrict x, const unsigned char *restrict q, float *restrict y, int n, int m,
                           int k, int threads) {
    rows_a(x, q, y, n, m, k, threads, 0);
}

#else /* neither AVX-512 VNNI nor AVX2: the 8-bit-activation target is not offered (its reference still runs) */
int tandem_quant_a_available(void) { return 0; }

const char *tandem_quant_a_isa(void) { return "none"; }

void tandem_quant_rows_q4a(const float *x, const unsigned char *q, float *y, int n, int m, int k, int threads) {
    (void)x, (void)q, (void)y, (void)n, (void)m, (void)k, (void)threads;
}

void tandem_quant_rows_q8a(const float *x, const unsigned char *q, float *y, int n, int m, int k, int threads) {
    (void)x, (void)q, (void)y, (void)n, (void)m, (void)k, (void)threads;
}
#endif
