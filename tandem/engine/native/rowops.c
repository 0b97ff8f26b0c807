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
#include <stdint.h>

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

/* IEEE binary16 bits of f, rounded to nearest, ties to even (what torch's float32 -> float16 cast
 * gives: tested on edge cases and random floats): overflow to infinity, subnormals, NaN kept quiet.
 * Plain integer arithmetic, so it needs no F16C. */
static inline uint16_t half_bits(float f) {
    const union { float f; uint32_t u; } v = {.f = f};
    const uint16_t sign = (uint16_t)((v.u >> 16) & 0x8000u);
    const uint32_t a = v.u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return sign | 0x7C00u | (a > 0x7F800000u ? 0x200u : 0u); /* infinity, NaN */
    if (a >= 0x477FF000u) return sign | 0x7C00u; /* 65520 and up round past the largest half, 65504 */
    if (a < 0x38800000u) { /* below 2^-14: a multiple of 2^-24 (1024 of them carry into the smallest normal) */
        const union { uint32_t u; float f; } m = {.u = a};
        return sign | (uint16_t)rintf(m.f * 16777216.0f); /* exact product; rint rounds ties to even */
    }
    const uint32_t r = a - 0x38000000u; /* exponent bias 127 -> 15 */
    return sign | (uint16_t)((r + 0xFFFu + ((r >> 13) & 1u)) >> 13); /* drop 13 bits, ties to even */
}

/* Rotary embedding of a block's queries and keys, and the block's keys and values written into one
 * layer's cache: what the forward did in ~15 torch ops per layer (slices, views, a roll, two
 * products and a sum, two strided cache copies), each costing more than its arithmetic on a decode
 * step's few rows.
 *
 * qkv: [n, (H + 2 KV) D] rows qkv_stride floats apart (q heads, then k heads, then v heads);
 * cs, sn: [n, D] the cosines and signed sines of each row's position (the sine's first half
 * negated, as NativeLlama._rope makes them); q_out: [n, H, D] contiguous; kc, vc: [KV, cap, D]
 * contiguous, row r's key and value land at position start + r.
 *
 * Arithmetic as transformers' rotate_half form, x * cos + rotate_half(x) * sin, element by element
 * with each product rounded before the sum (ISO C: no contraction into FMA), which is exactly what
 * the torch ops computed: x * cos + roll(x, D/2) * signed_sin (a negation is exact).
 *
 * half: the cache holds float16 (kc, vc are uint16_t arrays): each key and value is computed in
 * float32 as above and rounded once to binary16 (half_bits). */
void tandem_rope_store(const float *restrict qkv, int qkv_stride, int n, int H, int KV, int D,
                       const float *restrict cs, const float *restrict sn, float *restrict q_out,
                       void *restrict kc, void *restrict vc, int cap, int start, int half) {
    const int hd = D / 2;
    float kr[D > 0 ? D : 1];
    for (int r = 0; r < n; r++) {
        const float *row = qkv + (size_t)r * qkv_stride;
        const float *c = cs + (size_t)r * D, *s = sn + (size_t)r * D;
        for (int h = 0; h < H + KV; h++) {
            const float *x = row + (size_t)h * D;
            const size_t slot = ((size_t)(h - H) * cap + start + r) * D; /* keys only (h >= H) */
            float *o = h < H ? q_out + ((size_t)r * H + h) * D : half ? kr : (float *)kc + slot;
            for (int i = 0; i < hd; i++) o[i] = x[i] * c[i] + x[i + hd] * s[i];
            for (int i = hd; i < D; i++) o[i] = x[i] * c[i] + x[i - hd] * s[i];
            if (h >= H && half)
                for (int i = 0; i < D; i++) ((uint16_t *)kc)[slot + i] = half_bits(kr[i]);
        }
        const float *v = row + (size_t)(H + KV) * D;
        for (int h = 0; h < KV; h++) {
            const size_t slot = ((size_t)h * cap + start + r) * D;
            if (half)
                for (int i = 0; i < D; i++) ((uint16_t *)vc)[slot + i] = half_bits(v[(size_t)h * D + i]);
            else
                for (int i = 0; i < D; i++) ((float *)vc)[slot + i] = v[(size_t)h * D + i];
        }
    }
}

/* tandem_rope_store for nb blocks of one forward's rows in one call: block i is rows desc[6 i] ..
 * desc[6 i] + desc[6 i + 1] - 1 of qkv (and of cs, sn, q_out), its cache layer's keys and values at
 * the addresses desc[6 i + 2] and desc[6 i + 3], its capacity desc[6 i + 4] and start desc[6 i + 5].
 * The same arithmetic per row (the same bits); one call a layer instead of one a block (a batched
 * step of 16 sessions made 464 of them, ~3 us each through ctypes). */
void tandem_rope_store_many(int nb, const long long *desc, const float *restrict qkv, int qkv_stride, int H, int KV,
                            int D, const float *restrict cs, const float *restrict sn, float *restrict q_out,
                            int half) {
    for (int i = 0; i < nb; i++) {
        const long long *d = desc + 6 * (size_t)i;
        const size_t a = (size_t)d[0];
        tandem_rope_store(qkv + a * qkv_stride, qkv_stride, (int)d[1], H, KV, D, cs + a * D, sn + a * D,
                          q_out + a * H * D, (void *)(size_t)d[2], (void *)(size_t)d[3], (int)d[4], (int)d[5], half);
    }
}

/* x[r] += o[r], then y[r] = RMSNorm(x[r]) as tandem_rms_norm computes it, for rows r < n of d
 * floats (x, o, y contiguous): the residual add and the next norm of the native forward in one call
 * instead of two (a torch add costs ~2 us on a decode step's row, more than its arithmetic). The
 * add is the same IEEE sum torch's makes, so the bits are those of the two calls. */
void tandem_add_rms_norm(float *restrict x, const float *restrict o, const float *restrict w, float *restrict y,
                         int n, int d, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 64)
    for (int r = 0; r < n; r++) {
        float *xr = x + (size_t)r * d;
        const float *orow = o + (size_t)r * d;
        for (int e = 0; e < d; e++) xr[e] = xr[e] + orow[e];
    }
    tandem_rms_norm(x, d, w, y, d, n, d, eps, threads);
}

/* e^x, clamped to x in [-87, 87] (where it stays a normal float): n = nearest(x / ln 2), r = x - n ln 2
 * in two fused steps (Cody-Waite: ln 2 split so n * ln2_hi is exact), e^r by its Taylor series to
 * degree 7 (|r| <= 0.347: remainder below 2e-8 relative), times 2^n from the exponent bits. Plain C
 * that the compiler vectorizes; within 2 ulp of the true value (tested against float64). */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x > 87.0f ? 87.0f : x;
    /* nearest integer, ties to even, by the 1.5 * 2^23 trick (|x / ln 2| < 2^22; no call, so it vectorizes) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = fmaf(-n, 0.693145751953125f, x); /* ln 2's top 16 bits: n * this is exact */
    r = fmaf(-n, 1.42860682030941723e-6f, r);  /* the rest of ln 2 */
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* out[r][i] = silu(gu[r][i]) * gu[r][inter + i] = g / (1 + e^-g) * u, for rows r < n: the gated MLP's
 * activation from the fused gate/up GEMM's output [n, 2 inter] into [n, inter] in one call instead
 * of four torch ops (two slices, silu, a product: ~12 us on a decode step's row). Element by element
 * in a fixed order, so row-invariant; not torch's bits (its exp differs in the last place), which
 * the lossless rule does not ask for: plain decoding and verification both run this. */
static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int m) {
    for (int i = 0; i < m; i++) o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
}

void tandem_silu_mul(const float *restrict gu, float *restrict out, int n, int inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 64)
    for (int r = 0; r < n; r++)
        silu_mul_row(gu + (size_t)r * 2 * inter, gu + (size_t)r * 2 * inter + inter, out + (size_t)r * inter, inter);
}
