/* Few-row GEMM on block-quantized weights as GGUF files hold them: y[n, m] = x[n, k] . W[m, k]^T,
 * x float32, W in blocks of 32 inputs with a scale (and an offset) per block and output.
 *
 * Why: a user who brings a Q4_1 or Q8_0 GGUF knows that model as it runs quantized, and a CPU
 * decode step is bound by reading the weights: SmolLM2-135M's linear layers are 540 MB in float32
 * and ~115 MB here (0.75 bytes a weight in Q4, 1.25 in Q8). So the weights stay quantized and are
 * widened to float32 in registers, per use.
 *
 * Formats (after tandem/engine/quant.py repacks a GGUF tensor; w = q * d + m for every kind):
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
 * Built at first use like gemv.c; without AVX-512 tandem_quant_available() says 0 and a quantized
 * target is not offered (the GGUF is dequantized to float32 as before).
 */
#include <stddef.h>

#define LANES 16
#define BLOCK 32 /* inputs per scale: GGUF's Q4_0, Q4_1 and Q8_0 */

#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>

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
