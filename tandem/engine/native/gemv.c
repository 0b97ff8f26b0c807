/* Few-row GEMM for memory-bound decode steps: y[n, out] = x[n, in] . W[out, in]^T, n <= 32.
 *
 * Why our own: a decode or verification step multiplies 1-17 activation rows by weights that are
 * read from DRAM once per step, so the cost is reading W. Measured on a 2-core AMD EPYC host, the
 * library paths (MKL, oneDNN) read W at 60-80% of a streaming read of the same bytes; this loop
 * streams each weight row once, keeps the n activation rows in L1/L2, and computes every output
 * with the same summation order whatever n is (so a row's result does not depend on how many other
 * rows share the call).
 *
 * Built at first use by tandem/engine/gemv.py with the host's compiler (-O3 -march=native -fopenmp);
 * the reference is torch.nn.functional.linear, and tests compare the two.
 */
#include <stddef.h>

#define LANES 16 /* accumulators per dot product: one AVX-512 register of floats */
#define BLOCK 4  /* activation rows sharing each load of a weight vector */
/* Software prefetch of the weights this many floats (8 KB) ahead, into L2: the hardware prefetchers
 * restart at every 4 KB page, and each weight row is 1-6 KB (quant.c says more; measured there). A
 * thread's rows are contiguous, so ahead is the next rows; past the weight's end it only fetches
 * lines nobody reads (a prefetch never faults). It never changes a result. */
#define PF_FLOATS 2048

/* The dot products of `rows` (1..BLOCK) activation rows with one weight row. Every row is summed
 * in the same order (LANES strided partial sums, then a fixed pairwise reduction), whatever `rows`
 * is and wherever the row sits in the call: a row's result never depends on the other rows. Built
 * with ISO C semantics (-std=c11: no contraction into FMA), so every specialization rounds the same
 * way. Always inlined with a constant `rows`, so the compiler keeps rows x LANES accumulators in
 * registers and loads each weight vector once for all rows. */
static inline __attribute__((always_inline)) void dots(const float *restrict x, size_t ldx,
                                                       const float *restrict w, int k, const int rows,
                                                       float *restrict out, size_t ldo) {
    float acc[BLOCK][LANES] = {{0}};
    int i = 0;
    for (; i + LANES <= k; i += LANES) {
#if defined(__GNUC__)
        __builtin_prefetch(w + i + PF_FLOATS, 0, 2); /* read, into L2 */
#endif
        for (int r = 0; r < rows; r++) {
#pragma omp simd
            for (int l = 0; l < LANES; l++) acc[r][l] += x[r * ldx + i + l] * w[i + l];
        }
    }
    for (int r = 0; r < rows; r++) {
        float tail = 0.0f;
        for (int j = i; j < k; j++) tail += x[r * ldx + j] * w[j];
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++) acc[r][l] += acc[r][l + width];
        out[r * ldo] = acc[r][0] + tail;
    }
}

/* x: [n, k] row-major; w: [m, k] row-major; y: [n, m] row-major; threads: torch's intra-op count
 * (the library is loaded into a process whose libgomp.so.1 is torch's, so the pool is shared). */
void tandem_gemv_rows(const float *restrict x, const float *restrict w, float *restrict y,
                      int n, int m, int k, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int o = 0; o < m; o++) {
        const float *wr = w + (size_t)o * k;
        for (int r = 0; r < n; r += BLOCK) {
            const float *xr = x + (size_t)r * k;
            float *yr = y + (size_t)r * m + o;
            switch (n - r < BLOCK ? n - r : BLOCK) { /* a constant row count per call of dots */
            case 1: dots(xr, (size_t)k, wr, k, 1, yr, (size_t)m); break;
            case 2: dots(xr, (size_t)k, wr, k, 2, yr, (size_t)m); break;
            case 3: dots(xr, (size_t)k, wr, k, 3, yr, (size_t)m); break;
            default: dots(xr, (size_t)k, wr, k, 4, yr, (size_t)m); break;
            }
        }
    }
}
