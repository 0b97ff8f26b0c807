/* Row-wise operations of the native forward on a CPU, where torch's per-call cost is larger than
 * the work: a decode step calls RMSNorm 61 times on one 576-float row, and torch's fused op took
 * 9 us alone and 15-45 us between two GEMMs (measured on a 2-core Intel Xeon host) for ~1 us of
 * arithmetic, ~1.8 ms of a 28 ms step.
 *
 * Each row is computed on its own, in a fixed order, so a row's result has the same bits whatever
 * the other rows of the call are (a plain step and a verification block alike). Plain C: the
 * compiler vectorizes it for the host (-march=native); no instruction set is required.
 *
 * The reference is transformers' Llama RMSNorm, w * (x * rsqrt(mean(x^2) + eps)); tests compare the
 * two (close, not bit for bit: the sum of squares is taken in another order).
 */
#include <math.h>
#include <stddef.h>

#define LANES 16

/* y[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)) for rows r < n of d floats; rows of x and y at
 * x_stride / y_stride floats apart. Threads split the rows of a long call (a prefill). */
void tandem_rms_norm(const float *restrict x, int x_stride, const float *restrict w, float *restrict y,
                     int y_stride, int n, int d, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 64)
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * x_stride;
        float *yr = y + (size_t)r * y_stride;
        float acc[LANES] = {0};
        int i = 0;
        for (; i + LANES <= d; i += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += xr[i + l] * xr[i + l];
        for (; i < d; i++) acc[i % LANES] += xr[i] * xr[i];
        float s = 0.0f;
        for (int l = 0; l < LANES; l++) s += acc[l];
        const float inv = 1.0f / sqrtf(s / (float)d + eps);
        for (int e = 0; e < d; e++) yr[e] = w[e] * (xr[e] * inv);
    }
}
