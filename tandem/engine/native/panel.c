/* Few-row GEMM on a panel-packed weight: y[n, m] = x[n, k] . W[m, k]^T, n <= 32, AVX-512 or AVX2.
 *
 * Why a second kernel beside gemv.c: gemv.c takes dot products along k (one weight row against a
 * few activation rows, then a horizontal sum per output), which reads weights at the streaming
 * rate for 1-3 rows but turns compute-bound from about 5 rows (on a 2-core AMD EPYC host, 9 rows
 * read weights at 10-14 GB/s against ~30 for a streaming read), so verification blocks of 4-17
 * rows ran on oneDNN at 60-80% of the streaming rate. A verification block of 9 tokens then cost
 * 2.1-2.2x a one-token step there.
 *
 * Here the weight is packed in panels of 16 outputs, k-major ([m/16][k][16], zero rows padding
 * the last panel), so one 64-byte load holds the weights of 16 outputs at one k. A tile of R rows
 * x P panels keeps R*P accumulators of 16 outputs in registers; per k it loads P weight vectors,
 * broadcasts one activation per row and does R*P fused multiply-adds: no horizontal sums, and each
 * weight vector feeds R FMAs. Tiles: up to 6 rows x 4 panels, or up to 12 rows x 2 panels (at most
 * 24 accumulators + P weights + 1 broadcast of AVX-512's 32 registers); more rows run as several
 * tiles of near-equal height over the same panel group, which the first tile brought into L2.
 *
 * Arithmetic: every output is a single chain acc = fma(x[r][kk], w[o][kk], acc) for kk = 0..k-1,
 * from acc = 0, whatever the tile, the row count, the row's place in the call or the thread count.
 * So a row's result has the same bits alone or among 31 other rows (row-invariant, like gemv.c,
 * though not the same bits as gemv.c, whose sum order differs). Reference: F.linear; tests compare.
 *
 * int8 panels (tandem_panel_rows_q8, a draft model's weights): the same tiles over int8 weights with
 * one scale per output, widened to float32 in registers (exact: |q| <= 127) and scaled once at the
 * end, so a quarter of the bytes stream from memory; on the EPYC host 0.55-0.65x the time of torch's
 * weight-packed int8 matmul on every SmolLM2 shape at 1-9 rows.
 *
 * Built at first use by tandem/engine/panel.py like gemv.c, for AVX-512 or (a form below with the
 * same bits) AVX2 with FMA. Without either the library still builds, and tandem_panel_available()
 * says 0: the path is then not offered.
 */
#include <stddef.h>

#define LANES 16 /* outputs per panel: one AVX-512 register of floats */

#ifdef __AVX512F__
#include <immintrin.h>
#include <omp.h>

#define MAX_R 12 /* rows in one tile with 2 panels */
/* Software prefetch of each panel's stream this many bytes ahead, into L2: the hardware prefetchers
 * restart at every 4 KB page (quant.c says more; measured there). Past a panel's end it fetches the
 * next panel's start, which the next group reads; past the weight's end, lines nobody reads (a
 * prefetch never faults). It never changes a result. */
#define PF_BYTES 8192
#define WIDE_R 6 /* rows in one tile with 4 panels */

/* R rows x P panels, k steps; R and P are constants at every call (always inlined from the switch
 * below), so the compiler keeps acc in registers. panels: the group's first panel; col0: its first
 * output column; m: the real output count (the last panel may hold padding). */
static inline __attribute__((always_inline)) __m512 weights16(const void *restrict panels, size_t at, const int Q8) {
    if (Q8) /* 16 int8 weights, exactly as floats (|q| <= 127) */
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const signed char *)panels + at))));
    return _mm512_loadu_ps((const float *)panels + at);
}

/* Q8: the panels hold int8 weights (a float32 view of them is q * scale, one scale per output):
 * the chain runs over the int8 values as floats and the sum is multiplied by the output's scale
 * once at the end, so each output is still one chain in k order (row-invariant). */
static inline __attribute__((always_inline)) void tile(const float *restrict x, size_t ldx,
                                                       const void *restrict panels, size_t pstride,
                                                       int k, const int R, const int P,
                                                       float *restrict y, size_t ldy, int col0, int m,
                                                       const int Q8, const float *restrict scales) {
    __m512 acc[MAX_R][4];
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        __m512 w[4];
        /* one 64-byte line per panel every kk (float32) or every 4th (int8) */
        if (!Q8 || kk % 4 == 0)
#pragma GCC unroll 4
            for (int p = 0; p < P; p++)
                _mm_prefetch((const char *)panels + (p * pstride + (size_t)kk * LANES) * (Q8 ? 1 : 4) + PF_BYTES, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) w[p] = weights16(panels, p * pstride + (size_t)kk * LANES, Q8);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);
#pragma GCC unroll 4
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xb, w[p], acc[r][p]);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            const int col = col0 + p * LANES;
            if (Q8) acc[r][p] = _mm512_mul_ps(acc[r][p], _mm512_loadu_ps(scales + col));
            if (col + LANES <= m)
                _mm512_storeu_ps(y + r * ldy + col, acc[r][p]);
            else if (col < m)
                _mm512_mask_storeu_ps(y + r * ldy + col, (__mmask16)((1u << (m - col)) - 1u), acc[r][p]);
        }
}

#define TILE_(R, P) tile(xr, (size_t)k, wp, pstride, k, R, P, yr, (size_t)m, p0 * LANES, m, Q8, scales)
#define TILE4(R) TILE_(R, 4)
#define TILE2(R) TILE_(R, 2)
#define TILE1(R) TILE_(R, 1)

int tandem_panel_available(void) { return 1; }

/* x: [n, k] row-major; packed: [ceil(m/16), k, 16] (float32, or int8 with Q8); scales: [ceil(m/16) * 16]
 * (Q8 only); y: [n, m] row-major. threads: torch's intra-op count (this library binds to the
 * libgomp.so.1 torch has loaded, so it runs in torch's pool). Each thread takes a contiguous run of
 * panels, so each output is computed by one thread. */
static inline __attribute__((always_inline)) void rows(const float *restrict x, const void *restrict packed,
                                                       const float *restrict scales, float *restrict y,
                                                       int n, int m, int k, int threads, const int Q8) {
    const int panels = (m + LANES - 1) / LANES;
    const size_t pstride = (size_t)k * LANES;
    /* tiles of near-equal height, each as tall as the registers allow, so that the tile which
     * reads a panel group from memory does as much of the work as it can */
    const int tiles = (n + MAX_R - 1) / MAX_R;
    const int group = (n + tiles - 1) / tiles > WIDE_R ? 2 : 4;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int begin = (int)((long)panels * t / T), end = (int)((long)panels * (t + 1) / T);
        for (int p0 = begin; p0 < end; p0 += group) {
            const int P = end - p0 < group ? end - p0 : group;
            const void *wp = Q8 ? (const void *)((const signed char *)packed + (size_t)p0 * pstride)
                                : (const void *)((const float *)packed + (size_t)p0 * pstride);
            for (int j = 0, r0 = 0; j < tiles; j++) {
                const int R = (n - r0) / (tiles - j);
                const float *xr = x + (size_t)r0 * k;
                float *yr = y + (size_t)r0 * m;
                r0 += R;
                if (P == 1) {
                    switch (R) {
                    case 1: TILE1(1); break;
                    case 2: TILE1(2); break;
                    case 3: TILE1(3); break;
                    case 4: TILE1(4); break;
                    case 5: TILE1(5); break;
                    case 6: TILE1(6); break;
                    case 7: TILE1(7); break;
                    case 8: TILE1(8); break;
                    case 9: TILE1(9); break;
                    case 10: TILE1(10); break;
                    case 11: TILE1(11); break;
                    default: TILE1(12); break;
                    }
                } else if (P <= 2) {
                    switch (R) {
                    case 1: TILE2(1); break;
                    case 2: TILE2(2); break;
                    case 3: TILE2(3); break;
                    case 4: TILE2(4); break;
                    case 5: TILE2(5); break;
                    case 6: TILE2(6); break;
                    case 7: TILE2(7); break;
                    case 8: TILE2(8); break;
                    case 9: TILE2(9); break;
                    case 10: TILE2(10); break;
                    case 11: TILE2(11); break;
                    default: TILE2(12); break;
                    }
                } else if (P == 3) { /* the run's last group: rows <= WIDE_R here */
                    switch (R) {
                    case 1: TILE_(1, 3); break;
                    case 2: TILE_(2, 3); break;
                    case 3: TILE_(3, 3); break;
                    case 4: TILE_(4, 3); break;
                    case 5: TILE_(5, 3); break;
                    default: TILE_(6, 3); break;
                    }
                } else {
                    switch (R) {
                    case 1: TILE4(1); break;
                    case 2: TILE4(2); break;
                    case 3: TILE4(3); break;
                    case 4: TILE4(4); break;
                    case 5: TILE4(5); break;
                    default: TILE4(6); break;
                    }
                }
            }
        }
    }
}

void tandem_panel_rows(const float *restrict x, const float *restrict packed, float *restrict y,
                       int n, int m, int k, int threads) {
    rows(x, packed, 0, y, n, m, k, threads, 0);
}

void tandem_panel_rows_q8(const float *restrict x, const signed char *restrict packed, const float *restrict scales,
                          float *restrict y, int n, int m, int k, int threads) {
    rows(x, packed, scales, y, n, m, k, threads, 1);
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (AMD Zen 2 / Zen 3, older Intel): the same panels and the same arithmetic, each output one
 * FMA chain in k order from zero, so the same bits as the AVX-512 form (a vector's width does not
 * enter a lane's chain; tested where both run). A panel's 16 outputs are two 8-lane registers;
 * with 16 registers a tile is one panel x up to 6 rows (12 accumulators, 2 weights, 1 broadcast). */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#define MAX_R2 6
#define PF_BYTES 8192

static inline __attribute__((always_inline)) void weights8x2(const void *restrict panels, size_t at, const int Q8,
                                                             __m256 *lo, __m256 *hi) {
    if (Q8) {
        const signed char *q = (const signed char *)panels + at;
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8))));
    } else {
        *lo = _mm256_loadu_ps((const float *)panels + at);
        *hi = _mm256_loadu_ps((const float *)panels + at + 8);
    }
}

static inline __attribute__((always_inline)) void tile2(const float *restrict x, size_t ldx, const void *restrict panel,
                                                        int k, const int R, float *restrict y, size_t ldy, int col,
                                                        int m, const int Q8, const float *restrict scales) {
    __m256 lo[MAX_R2], hi[MAX_R2];
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int kk = 0; kk < k; kk++) {
        if (!Q8 || kk % 4 == 0)
            _mm_prefetch((const char *)panel + (size_t)kk * LANES * (Q8 ? 1 : 4) + PF_BYTES, _MM_HINT_T1);
        __m256 wl, wh;
        weights8x2(panel, (size_t)kk * LANES, Q8, &wl, &wh);
#pragma GCC unroll 6
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_set1_ps(x[r * ldx + kk]);
            lo[r] = _mm256_fmadd_ps(xb, wl, lo[r]);
            hi[r] = _mm256_fmadd_ps(xb, wh, hi[r]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; r++) {
        if (Q8) {
            lo[r] = _mm256_mul_ps(lo[r], _mm256_loadu_ps(scales + col));
            hi[r] = _mm256_mul_ps(hi[r], _mm256_loadu_ps(scales + col + 8));
        }
        if (col + LANES <= m) {
            _mm256_storeu_ps(y + r * ldy + col, lo[r]);
            _mm256_storeu_ps(y + r * ldy + col + 8, hi[r]);
        } else if (col < m) { /* the last panel's real outputs only */
            float buf[LANES];
            _mm256_storeu_ps(buf, lo[r]);
            _mm256_storeu_ps(buf + 8, hi[r]);
            memcpy(y + r * ldy + col, buf, sizeof(float) * (size_t)(m - col));
        }
    }
}

#define TILE2_(R) tile2(xr, (size_t)k, wp, k, R, yr, (size_t)m, p * LANES, m, Q8, scales)

int tandem_panel_available(void) { return 1; }

static inline __attribute__((always_inline)) void rows2(const float *restrict x, const void *restrict packed,
                                                        const float *restrict scales, float *restrict y,
                                                        int n, int m, int k, int threads, const int Q8) {
    const int panels = (m + LANES - 1) / LANES;
    const size_t pstride = (size_t)k * LANES;
    const int tiles = (n + MAX_R2 - 1) / MAX_R2;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int begin = (int)((long)panels * t / T), end = (int)((long)panels * (t + 1) / T);
        for (int p = begin; p < end; p++) {
            const void *wp = Q8 ? (const void *)((const signed char *)packed + (size_t)p * pstride)
                                : (const void *)((const float *)packed + (size_t)p * pstride);
            for (int j = 0, r0 = 0; j < tiles; j++) {
                const int R = (n - r0) / (tiles - j);
                const float *xr = x + (size_t)r0 * k;
                float *yr = y + (size_t)r0 * m;
                r0 += R;
                switch (R) {
                case 1: TILE2_(1); break;
                case 2: TILE2_(2); break;
                case 3: TILE2_(3); break;
                case 4: TILE2_(4); break;
                case 5: TILE2_(5); break;
                default: TILE2_(6); break;
                }
            }
        }
    }
}

void tandem_panel_rows(const float *restrict x, const float *restrict packed, float *restrict y,
                       int n, int m, int k, int threads) {
    rows2(x, packed, 0, y, n, m, k, threads, 0);
}

void tandem_panel_rows_q8(const float *restrict x, const signed char *restrict packed, const float *restrict scales,
                          float *restrict y, int n, int m, int k, int threads) {
    rows2(x, packed, scales, y, n, m, k, threads, 1);
}

#else /* neither AVX-512 nor AVX2 with FMA: the path is not offered (tandem_panel_available) */

int tandem_panel_available(void) { return 0; }

void tandem_panel_rows(const float *x, const float *packed, float *y, int n, int m, int k, int threads) {
    (void)x, (void)packed, (void)y, (void)n, (void)m, (void)k, (void)threads;
}

void tandem_panel_rows_q8(const float *x, const signed char *packed, const float *scales, float *y, int n, int m,
                          int k, int threads) {
    (void)x, (void)packed, (void)scales, (void)y, (void)n, (void)m, (void)k, (void)threads;
}

#endif
