/* Attention of a block on a CPU (a decode step, a verification block or tree, a prompt piece of any
 * length): n new query rows (positions s .. s+n-1) against one layer's KV cache holding positions
 * 0 .. s+n-1, causal, with grouped KV heads (query head h reads KV head h / (H / KV)).
 *
 * Why every block comes here, prefill included: a row's result depends only on its own query and
 * the keys up to its position, in a fixed order (runs of SPAN keys at fixed positions, merged in
 * order), never on the rows beside it, the block's length or the thread count. So a position gets
 * the same bits whether its prompt was prefilled whole, in pieces (chunked prefill under load),
 * copied from another session's prefix, or stepped one token at a time, and greedy output is the
 * same under any load (docs/history.md, "One request, one answer"). torch's kernel gives a
 * row other bits in a longer block.
 *
 * Why our own: torch's CPU flash attention splits its work by heads and query blocks and runs a
 * one-row query block as small GEMM calls per 512 keys. Measured on a 2-core Intel Xeon host for
 * SmolLM2's layer shape (9 query heads, 3 KV heads, head_dim 64), one query row took 650 us a layer
 * at 4,000 tokens of context (it reads 6 MB of keys and values there: ~9 GB/s, a third of the
 * host's streaming rate) and attention was 40% of a decode step. Here each thread takes a
 * contiguous run of keys of one KV head, loads each key and value vector once for all G x n query
 * rows of that head, and keeps a flash-style running maximum and sum per row; the runs are merged
 * at the end.
 *
 * The reference is torch.nn.functional.scaled_dot_product_attention; tests compare the two (close,
 * not bit for bit: the summation order differs, as it does between torch's own CPU kernels).
 *
 * Layouts (floats):
 *   q    row t, head h at q[t * q_stride + h * D]   (the rotated [n, H + KV, D] q/k block)
 *   k, v key j of KV head g at k[(g * cap + j) * D]   (a layer of the [KV, cap, D] cache; with
 *        `half`, IEEE binary16 elements, widened exactly to floats a tile at a time)
 *   out  row t, head h at out[t * o_stride + h * D]   (the [n, H * D] input of the output projection)
 * D must be a multiple of 16 (one v16 of floats) and at most 256; the loader checks.
 *
 * A shared prefix: with `plen` > 0, positions 0 .. plen-1 are read from another cache, `pk`/`pv`
 * (capacity `pcap`: key j of KV head g at pk[(g * pcap + j) * D]), and position p >= plen from
 * k/v at p - plen. Sessions of one tenant that begin with the same tool list hold its keys and
 * values once (tandem/engine/model/llama.py, KVCache). plen is a multiple of SPAN, so every run
 * lies wholly in one of the two and reads the same keys in the same order as over one cache: a
 * row gets the same bits with the prefix shared as with it copied.
 *
 * Token trees: with `tree` non-NULL, row t sees the cache's keys 0 .. s-1 and the block's keys s + i
 * for the bits i set in tree[t] (itself and its ancestors; a block has at most 32 rows) instead of
 * the causal s .. s+t. Keys it cannot see add exact zeros, as keys past a causal row's position do.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

/* A vector of 16 floats, `v16`: one AVX-512 register, or two AVX2 registers (lanes 0-7, 8-15).
 * Every operation below is lane-wise or a fixed permutation, and the AVX2 form does the same
 * IEEE operations on the same lanes in the same order, so the kernel computes the same bits on an
 * AVX2 host (AMD Zen 2 / Zen 3, older Intel) as on an AVX-512 one (tested where both run): a
 * session failed over between the two kinds of host resumes on the same numbers. Masks (`m16`)
 * are 16-bit lane sets in both. */
#if defined(__AVX512F__)
typedef __m512 v16;
static inline __attribute__((always_inline)) v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline __attribute__((always_inline)) v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline __attribute__((always_inline)) v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline __attribute__((always_inline)) v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
/* lanes of a greater than b (ordered, quiet) */
static inline __attribute__((always_inline)) unsigned v_gt(v16 a, v16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
/* lanes in `keep` from a, the others 0 */
static inline __attribute__((always_inline)) v16 v_keep(unsigned keep, v16 a) { return _mm512_maskz_mov_ps((__mmask16)keep, a); }
/* lanes in `keep` from a, the others from b */
static inline __attribute__((always_inline)) v16 v_blend(unsigned keep, v16 b, v16 a) { return _mm512_mask_blend_ps((__mmask16)keep, b, a); }
static inline __attribute__((always_inline)) v16 v_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p 2^n for whole n in [-126, 0] and p in [0.5, 2]: one rounding of the exact product (scalef) */
static inline __attribute__((always_inline)) v16 v_scale2(v16 p, v16 n) { return _mm512_scalef_ps(p, n); }
static inline __attribute__((always_inline)) float v_hmax(v16 a) { return _mm512_reduce_max_ps(a); }
static inline __attribute__((always_inline)) v16 v_widen(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* the per-128-bit-lane steps of the scores' transposing tree (scores16) */
static inline __attribute__((always_inline)) v16 v_unpack_sum(v16 a, v16 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __attribute__((always_inline)) v16 v_shuffle_sum(v16 a, v16 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
}
/* 128-bit lanes: [a0 a2 b0 b2] + [a1 a3 b1 b3] */
static inline __attribute__((always_inline)) v16 v_lane_sum(v16 a, v16 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
static inline __attribute__((always_inline)) __m256 v_lo(v16 a) { return _mm512_castps512_ps256(a); }
static inline __attribute__((always_inline)) __m256 v_hi(v16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }
#define V_REGS 32 /* vector registers: the value pass keeps 6 x 4 or 3 x 8 sums in them */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef struct { __m256 lo, hi; } v16;
static inline __attribute__((always_inline)) v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline __attribute__((always_inline)) void v_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
static inline __attribute__((always_inline)) v16 v_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline __attribute__((always_inline)) v16 v_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline __attribute__((always_inline)) v16 v_sub(v16 a, v16 b) { return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline __attribute__((always_inline)) v16 v_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline __attribute__((always_inline)) v16 v_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline __attribute__((always_inline)) v16 v_max(v16 a, v16 b) { return (v16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline __attribute__((always_inline)) unsigned v_gt(v16 a, v16 b) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ))
           | (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)) << 8;
}
/* a lane set as two all-ones/all-zeros lane masks */
static inline __attribute__((always_inline)) v16 v_lanes(unsigned keep) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i lo = _mm256_set1_epi32((int)(keep & 0xFFu)), hi = _mm256_set1_epi32((int)((keep >> 8) & 0xFFu));
    return (v16){_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(lo, bit), bit)),
                 _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(hi, bit), bit))};
}
static inline __attribute__((always_inline)) v16 v_keep(unsigned keep, v16 a) {
    const v16 m = v_lanes(keep);
    return (v16){_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)};
}
static inline __attribute__((always_inline)) v16 v_blend(unsigned keep, v16 b, v16 a) {
    const v16 m = v_lanes(keep);
    return (v16){_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
static inline __attribute__((always_inline)) v16 v_round(v16 a) {
    return (v16){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                 _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
/* p 2^n for whole n in [-126, 0]: 2^n is a normal float built from its exponent bits, and the one
 * multiplication rounds the exact product once, as AVX-512's scalef does */
static inline __attribute__((always_inline)) __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline __attribute__((always_inline)) v16 v_scale2(v16 p, v16 n) {
    return (v16){_mm256_mul_ps(p.lo, pow2_8(n.lo)), _mm256_mul_ps(p.hi, pow2_8(n.hi))};
}
static inline __attribute__((always_inline)) float v_hmax(v16 a) { /* exact in any order */
    __m256 m = _mm256_max_ps(a.lo, a.hi);
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}
static inline __attribute__((always_inline)) v16 v_widen(const uint16_t *p) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
static inline __attribute__((always_inline)) v16 v_unpack_sum(v16 a, v16 b) {
    return (v16){_mm256_add_ps(_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.lo, b.lo)),
                 _mm256_add_ps(_mm256_unpacklo_ps(a.hi, b.hi), _mm256_unpackhi_ps(a.hi, b.hi))};
}
static inline __attribute__((always_inline)) v16 v_shuffle_sum(v16 a, v16 b) {
    return (v16){_mm256_add_ps(_mm256_shuffle_ps(a.lo, b.lo, 0x44), _mm256_shuffle_ps(a.lo, b.lo, 0xEE)),
                 _mm256_add_ps(_mm256_shuffle_ps(a.hi, b.hi, 0x44), _mm256_shuffle_ps(a.hi, b.hi, 0xEE))};
}
static inline __attribute__((always_inline)) v16 v_lane_sum(v16 a, v16 b) {
    return (v16){_mm256_add_ps(_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(a.lo, a.hi, 0x31)),
                 _mm256_add_ps(_mm256_permute2f128_ps(b.lo, b.hi, 0x20), _mm256_permute2f128_ps(b.lo, b.hi, 0x31))};
}
static inline __attribute__((always_inline)) __m256 v_lo(v16 a) { return a.lo; }
static inline __attribute__((always_inline)) __m256 v_hi(v16 a) { return a.hi; }
#define V_REGS 16
#else
#error "this kernel needs AVX-512 or AVX2 with FMA and F16C, which this CPU lacks: attention stays on torch's kernel"
#endif

/* The sum of a vector's 16 lanes in one fixed order (upper half + lower half, then again at 128
 * and 64 bits, as GCC's _mm512_reduce_add_ps does), written out so both forms share it. */
static inline __attribute__((always_inline)) float v_hsum(v16 a) {
    const __m256 h = _mm256_add_ps(v_hi(a), v_lo(a));
    const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
    const __m128 t = _mm_add_ps(q, _mm_shuffle_ps(q, q, 0x4E)); /* [q0+q2, q1+q3, ...] */
    return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}

#define TILE 64       /* keys scored per pass: the G x n x TILE block of scores stays in L1 */
#define MAX_VEC 16    /* D / 16 vectors per key: head_dim up to 256 */
#define SPAN 256      /* keys per run (a unit of a thread's work): shorter runs cost more to merge than they save */
#define PF_BYTES 8192 /* software prefetch this far ahead in each of the key and value streams (below) */

/* Prefetch into L2 the keys and values of positions [a, b) of one KV head (each D floats): a
 * run's first keys; the rest are prefetched as the run goes (run_v).
 * Why: the hardware prefetchers stop at every 4 KB page (16 keys at head_dim 64) and ramp up again,
 * so without it each page's first lines wait for memory. Measured on the 2-core Intel Xeon host:
 * one token's attention over 30 layers' caches of 4,000 tokens 9.7 -> 7.9 ms (19 -> 23 GB/s; 4 KB
 * and 16 KB ahead measured the same or worse; docs/history.md, "Software prefetch").
 * Prefetching never changes a result's bits. */
static inline __attribute__((always_inline)) void prefetch_keys(const char *kg, const char *vg, size_t key_bytes, int a,
                                                                int b) {
    const char *k0 = kg + (size_t)a * key_bytes, *k1 = kg + (size_t)b * key_bytes;
    const char *v0 = vg + (size_t)a * key_bytes;
    for (ptrdiff_t o = 0; k0 + o < k1; o += 64) {
        _mm_prefetch(k0 + o, _MM_HINT_T1);
        _mm_prefetch(v0 + o, _MM_HINT_T1);
    }
}

/* e^x for 16 floats, within 2 ulp over the range softmax uses (x <= 0); exactly 0 below -87 and for
 * -inf (a masked key). 2^(x log2 e) with the integer part applied by scalef and the fraction in
 * [-0.5, 0.5] by its Taylor series to degree 7 (remainder < 6e-9 relative). */
static inline __attribute__((always_inline)) v16 exp16(v16 x) {
    const unsigned live = v_gt(x, v_set1(-87.0f));
    const v16 t = v_mul(v_keep(live, x), v_set1(1.44269504088896341f));
    const v16 n = v_round(t);
    const v16 f = v_mul(v_sub(t, n), v_set1(0.693147180559945309f)); /* |f| <= ln2/2 */
    v16 p = v_set1(1.0f / 5040.0f);
    p = v_fma(p, f, v_set1(1.0f / 720.0f));
    p = v_fma(p, f, v_set1(1.0f / 120.0f));
    p = v_fma(p, f, v_set1(1.0f / 24.0f));
    p = v_fma(p, f, v_set1(1.0f / 6.0f));
    p = v_fma(p, f, v_set1(0.5f));
    p = v_fma(p, f, v_set1(1.0f));
    p = v_fma(p, f, v_set1(1.0f));
    return v_keep(live, v_scale2(p, n));
}

/* The dot products of one query row `qv` (V vectors) with 16 keys kp[0..15], as one vector (lane i:
 * key i). Each key gives a vector of partial products; the 16 vectors are summed lane-wise by a
 * transposing tree of unpacks and shuffles (~45 instructions for 16 sums, where one horizontal
 * reduction per score costs ~8 on a serial chain), in a fixed order, so a score's bits depend only
 * on its inputs. The tree is reduced as the partials are made (pairs, then quads, ...): with all 16
 * partials live at once, the compiler spilled them to the stack (measured: a 9-row block at 4,000
 * tokens 1.7x slower). */
static inline __attribute__((always_inline)) v16 dot1(const int V, const v16 *qv, const float *restrict kj) {
    v16 a = v_mul(qv[0], v_load(kj));
    for (int e = 1; e < V; e++) a = v_fma(qv[e], v_load(kj + 16 * e), a);
    return a;
}
static inline __attribute__((always_inline)) v16 pair(const int V, const v16 *qv, const float *const *kp) {
    const v16 a = dot1(V, qv, kp[0]), b = dot1(V, qv, kp[1]); /* per 128-bit lane: [a, b, a, b] partials */
    return v_unpack_sum(a, b);
}
static inline __attribute__((always_inline)) v16 quad(const int V, const v16 *qv, const float *const *kp) {
    const v16 w0 = pair(V, qv, kp), w1 = pair(V, qv, kp + 2); /* per 128-bit lane: the 4 keys' sums */
    return v_shuffle_sum(w0, w1);
}
static inline __attribute__((always_inline)) v16 scores16(const int V, const v16 *qv, const float *const *kp) {
    const v16 x0 = quad(V, qv, kp), x1 = quad(V, qv, kp + 4);
    const v16 y01 = v_lane_sum(x0, x1);
    const v16 x2 = quad(V, qv, kp + 8), x3 = quad(V, qv, kp + 12);
    const v16 y23 = v_lane_sum(x2, x3);
    return v_lane_sum(y01, y23);
}

/* acc rows 0 .. RC-1 += the tile's probabilities times its values; the rows are first scaled by
 * their softmax correction. RC rows x V vectors of sums stay in registers across the tile's keys.
 * Written out per (RC, V) by a macro: as one function over constant-but-parameter sizes, GCC kept
 * the sums in a stack array (a variable-length one), so every FMA went through memory (measured:
 * a one-row step's attention at 4,000 tokens 1.3x slower, a 9-row block's 1.7x). */
#define VALUES_FN(RC_, V_) \
    static inline __attribute__((always_inline)) void values_##RC_##_##V_( \
        const float *restrict vt, int w, const float *restrict sc, const float *restrict corr, float *restrict acc) { \
        enum { D_ = 16 * V_ }; \
        v16 a[RC_][V_]; \
        for (int i = 0; i < RC_; i++) { \
            const v16 c = v_set1(corr[i]); \
            for (int e = 0; e < V_; e++) a[i][e] = v_mul(v_load(acc + i * D_ + 16 * e), c); \
        } \
        for (int j = 0; j < w; j++) { \
            v16 vv[V_]; \
            for (int e = 0; e < V_; e++) vv[e] = v_load(vt + (size_t)j * D_ + 16 * e); \
            for (int i = 0; i < RC_; i++) { \
                const v16 p = v_set1(sc[i * TILE + j]); \
                for (int e = 0; e < V_; e++) a[i][e] = v_fma(p, vv[e], a[i][e]); \
            } \
        } \
        for (int i = 0; i < RC_; i++) \
            for (int e = 0; e < V_; e++) v_store(acc + i * D_ + 16 * e, a[i][e]); \
    }
/* head_dim 64 (SmolLM2, Llama 3.2 1B) and 128 (most others) */
VALUES_FN(1, 4) VALUES_FN(2, 4) VALUES_FN(3, 4) VALUES_FN(4, 4) VALUES_FN(5, 4) VALUES_FN(6, 4)
VALUES_FN(1, 8) VALUES_FN(2, 8) VALUES_FN(3, 8)

/* The same for any other head size (and 4-6 rows at 128): the same arithmetic in the same order,
 * through memory. */
static void values_any(const int V, const int RC, const float *restrict vt, int w, const float *restrict sc,
                       const float *restrict corr, float *restrict acc) {
    const int D = 16 * V;
    for (int i = 0; i < RC; i++)
        for (int e = 0; e < D; e++) acc[(size_t)i * D + e] *= corr[i];
    for (int j = 0; j < w; j++)
        for (int i = 0; i < RC; i++) {
            const v16 p = v_set1(sc[i * TILE + j]);
            for (int e = 0; e < V; e++) {
                float *ai = acc + (size_t)i * D + 16 * e;
                v_store(ai, v_fma(p, v_load(vt + (size_t)j * D + 16 * e), v_load(ai)));
            }
        }
}

static inline __attribute__((always_inline)) void values(const int V, const int RC, const float *restrict vt, int w,
                                                         const float *restrict sc, const float *restrict corr,
                                                         float *restrict acc) {
#define VALUES_CASE(RC_, V_) if (V == V_ && RC == RC_) { values_##RC_##_##V_(vt, w, sc, corr, acc); return; }
    VALUES_CASE(1, 4) VALUES_CASE(2, 4) VALUES_CASE(3, 4) VALUES_CASE(4, 4) VALUES_CASE(5, 4) VALUES_CASE(6, 4)
    VALUES_CASE(1, 8) VALUES_CASE(2, 8) VALUES_CASE(3, 8)
#undef VALUES_CASE
    values_any(V, RC, vt, w, sc, corr, acc);
}

/* A tile of w float16 keys (or values) widened into `out` (exact: every binary16 is a float32),
 * 16 at a time (w * D is a multiple of 16). Once a tile, before its scores: each key is then read
 * by every query row of the block, and widening it per read cost more than the bytes it saves
 * (measured: 4-row blocks at 300 tokens 1.24x slower, docs/history.md). */
static inline __attribute__((always_inline)) void widen(const uint16_t *restrict in, size_t n, float *restrict out) {
    for (size_t x = 0; x < n; x += 16)
        v_store(out + x, v_widen(in + x));
}

/* One thread's run: keys [j0, j1) of KV head g for its R = G * n query rows (row r: head g * G + r / n,
 * query t = r % n, which sees keys up to s + t). Leaves, per row r, the running maximum m[r], the
 * sum l[r] of e^(score - m[r]) and acc[r * D ..] = the sum of e^(score - m[r]) v. V = D / 16 is a
 * constant at each call site, so the loops over a vector's parts unroll into registers. */
static inline __attribute__((always_inline)) void run_v(const int V, const int HALF, const float *restrict q,
                                                        int q_stride, const char *restrict kg, const char *restrict vg,
                                                        int G,
                                                        int n, int s, int g, int j0, int j1, float scale,
                                                        const unsigned *restrict tree,
                                                        float *restrict m, float *restrict l, float *restrict acc) {
    const int R = G * n, D = 16 * V;
    const size_t kb = (size_t)D * (HALF ? 2 : 4); /* bytes of one stored key (or value) */
    /* rows per register block of the value pass: 6 x 4 or 3 x 8 sums in AVX-512's 32 registers; 2 x 4
     * or 1 x 8 in AVX2's 16 (each v16 is two). A row's sums are its own whatever the block. */
    const int RC = V_REGS == 32 ? (V <= 4 ? 6 : 3) : (V <= 4 ? 2 : 1);
    float sc[R * TILE] __attribute__((aligned(64)));
    /* a float16 cache's tile, widened (`widen`); a float32 cache is read in place */
    float kw[HALF ? TILE * D : 1] __attribute__((aligned(64))), vw[HALF ? TILE * D : 1] __attribute__((aligned(64)));
    float corr[R];
    for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    for (size_t i = 0; i < (size_t)R * D; i++) acc[i] = 0.0f;
    const v16 vscale = v_set1(scale), ninf = v_set1(-INFINITY);
    /* keys (and values) this far ahead of the group being scored are prefetched; the run's first
     * ones at once */
    const int ahead = (PF_BYTES / (int)kb + 15) & ~15;
    prefetch_keys(kg, vg, kb, j0, j0 + ahead < j1 ? j0 + ahead : j1);
    for (int t0 = j0; t0 < j1; t0 += TILE) {
        const int t1 = (t0 + TILE < j1) ? t0 + TILE : j1, w = t1 - t0, wp = (w + 15) & ~15;
        /* the tile's keys and values as floats: key j at kt + (j - t0) * D */
        const float *kt = (const float *)(kg + (size_t)t0 * kb), *vt = (const float *)(vg + (size_t)t0 * kb);
        if (HALF) {
            widen((const uint16_t *)(kg + (size_t)t0 * kb), (size_t)w * D, kw);
            widen((const uint16_t *)(vg + (size_t)t0 * kb), (size_t)w * D, vw);
            kt = kw, vt = vw;
        }
        /* scores, 16 keys at a time; keys past a row's position (or past the run) get -inf */
        for (int j = t0; j < t1; j += 16) {
            const int cnt = (t1 - j < 16) ? t1 - j : 16;
            /* the group `ahead` keys on is prefetched a few lines per query row below, spread over
             * the group's work: issued at once (128 lines at head_dim 64), the prefetches filled
             * the core's miss buffers and stalled it (28% of a 9-row block's samples sat on them);
             * spread, a 9-row block over 30 layers' caches of 4,000 tokens took 18.7 -> 15.0 ms
             * on the 2-core Intel Xeon host, one row 7.8 -> 7.3 ms (docs/history.md,
             * "Attention: spread prefetch") */
            const int pa = j + ahead, pb = pa + 16 < j1 ? pa + 16 : j1;
            const int lines = pa < j1 ? (int)(((size_t)(pb - pa) * kb + 63) / 64) : 0;
            const char *pk = kg + (size_t)pa * kb, *pv = vg + (size_t)pa * kb;
            const float *kp[16]; /* the group's keys; past the run's end key j again (masked below) */
            for (int i = 0; i < 16; i++) kp[i] = kt + (size_t)((i < cnt ? j + i : j) - t0) * D;
            for (int r = 0; r < R; r++) {
                const int t = r % n;
                for (int x = r * lines / R; x < (r + 1) * lines / R; x++) {
                    _mm_prefetch(pk + 64 * (size_t)x, _MM_HINT_T1);
                    _mm_prefetch(pv + 64 * (size_t)x, _MM_HINT_T1);
                }
                const float *qr = q + (size_t)t * q_stride + (size_t)(g * G + r / n) * D;
                v16 qv[MAX_VEC];
                for (int e = 0; e < V; e++) qv[e] = v_load(qr + 16 * e);
                const v16 dots = scores16(V, qv, kp);
                unsigned vis;
                if (tree == 0 || j + cnt <= s) {
                    int lim = (tree ? s - 1 : s + t) - j + 1; /* keys j .. j+lim-1 are visible to this row */
                    lim = lim < 0 ? 0 : (lim > cnt ? cnt : lim);
                    vis = lim >= 16 ? 0xFFFFu : (1u << lim) - 1u;
                } else { /* a tile reaching into a tree block: the cache part, then the row's ancestors */
                    unsigned bits = 0;
                    for (int i = 0; i < cnt; i++)
                        if (j + i < s || ((tree[t] >> (j + i - s)) & 1u)) bits |= 1u << i;
                    vis = bits;
                }
                v_store(sc + r * TILE + (j - t0), v_blend(vis, ninf, v_mul(dots, vscale)));
            }
        }
        /* softmax bookkeeping per row */
        for (int r = 0; r < R; r++) {
            float *row = sc + r * TILE;
            v16 vm = ninf;
            for (int x = 0; x < wp; x += 16) vm = v_max(vm, v_load(row + x));
            /* Past the first tiles a row's running maximum rarely grows: then mx is m[r] and the
             * correction e^0 = 1 exactly, so the horizontal maximum and the expf call are skipped
             * (the same bits either way; ~27 rows x 63 tiles x 90 heads and layers of a 9-token step
             * at 4,000 tokens) */
            float mx = m[r];
            if (v_gt(vm, v_set1(m[r]))) {
                const float tmx = v_hmax(vm);
                mx = tmx > m[r] ? tmx : m[r];
            }
            if (mx == -INFINITY) { /* every key so far is after this row's position */
                for (int x = 0; x < wp; x += 16) v_store(row + x, v_set1(0.0f));
                corr[r] = 1.0f;
                continue;
            }
            corr[r] = m[r] == -INFINITY ? 0.0f : (mx == m[r] ? 1.0f : expf(m[r] - mx));
            const v16 vmx = v_set1(mx);
            v16 sum = v_set1(0.0f);
            for (int x = 0; x < wp; x += 16) {
                const v16 p = exp16(v_sub(v_load(row + x), vmx));
                v_store(row + x, p);
                sum = v_add(sum, p);
            }
            l[r] = l[r] * corr[r] + v_hsum(sum);
            m[r] = mx;
        }
        /* values: each value vector loaded once per block of rows, the rows' sums in registers */
        int r0 = 0;
        for (; r0 + RC <= R; r0 += RC) values(V, RC, vt, w, sc + r0 * TILE, corr + r0, acc + (size_t)r0 * D);
        /* the rest in one block too: a one-row step has R = G rows (3 for SmolLM2), and one pass per
         * row would put each row's sums on a dependency chain of its own per key */
        float *const sr = sc + r0 * TILE, *const ar = acc + (size_t)r0 * D;
        switch (R - r0) {
        case 1: values(V, 1, vt, w, sr, corr + r0, ar); break;
        case 2: values(V, 2, vt, w, sr, corr + r0, ar); break;
        case 3: values(V, 3, vt, w, sr, corr + r0, ar); break;
        case 4: values(V, 4, vt, w, sr, corr + r0, ar); break;
        case 5: values(V, 5, vt, w, sr, corr + r0, ar); break;
        default: break;
        }
    }
}

static void run(const int half, const float *restrict q, int q_stride, const char *restrict kg,
                const char *restrict vg, int G, int n, int D, int s, int g, int j0, int j1, float scale,
                const unsigned *restrict tree, float *restrict m, float *restrict l, float *restrict acc) {
    /* head sizes in use: 64 (SmolLM2, Llama 3.2 1B), 128 (most others); each in both cache types */
#define RUN(V_, H_) run_v(V_, H_, q, q_stride, kg, vg, G, n, s, g, j0, j1, scale, tree, m, l, acc)
    switch (D / 16) {
    case 4: if (half) RUN(4, 1); else RUN(4, 0); break;
    case 8: if (half) RUN(8, 1); else RUN(8, 0); break;
    default: /* 16 .. 256 in steps of 16: one generic instance per cache type */
        for (int v = 1; v <= MAX_VEC; v++)
            if (v == D / 16) { if (half) RUN(v, 1); else RUN(v, 0); break; }
    }
#undef RUN
}

/* One block's attention: its queries, its layer of the cache, where its output goes. */
typedef struct {
    const float *q;
    const char *k, *v; /* float32, or float16 where half */
    float *out;
    const unsigned *tree;
    const char *pk, *pv; /* the shared prefix's cache (positions 0 .. plen-1), or NULL with plen 0 */
    int q_stride, o_stride, n, s, cap;
    int pcap, plen; /* its capacity and length (a multiple of SPAN, at most s) */
    int half;     /* keys and values stored as float16 (IEEE binary16), widened exactly on load */
    int runs;     /* runs of SPAN keys over its s + n positions */
    size_t first; /* its first item among all blocks' (head, run) items, and its partials' offset / per */
} block_t;

/* Item `item` of block b: KV head item / runs, keys of run item % runs. Runs of SPAN keys at fixed
 * positions (0, SPAN, 2 SPAN, ...), whatever the block's length, the other blocks and the thread
 * count: a row's result then has the same bits whether it is computed alone (a plain step) or in
 * a block (verification). Keys past a row's position only add exact zeros to its sums, and a run
 * wholly past it is skipped in the merge. */
static void block_item(const block_t *b, int H, int KV, int D, float scale, int item, float *restrict m) {
    const int G = H / KV, R = G * b->n, L = b->s + b->n;
    const int g = item / b->runs, c = item % b->runs;
    const int j0 = c * SPAN, j1 = (j0 + SPAN < L) ? j0 + SPAN : L;
    const size_t es = b->half ? 2 : 4;
    if (j0 < b->plen) { /* a run of the shared prefix: every key before the block's rows */
        const size_t head = (size_t)g * b->pcap * D * es; /* bytes to KV head g */
        run(b->half, b->q, b->q_stride, b->pk + head, b->pv + head, G, b->n, D, b->s, g, j0, j1, scale, b->tree, m,
            m + R, m + 2 * R);
        return;
    }
    /* the block's own cache, which holds position p at p - plen: the run's keys and the block's
     * start move together, so every visibility test compares the same distances */
    const size_t head = (size_t)g * b->cap * D * es;
    run(b->half, b->q, b->q_stride, b->k + head, b->v + head, G, b->n, D, b->s - b->plen, g, j0 - b->plen,
        j1 - b->plen, scale, b->tree, m, m + R, m + 2 * R);
}

/* Merge the runs of KV head g's rows of block b: out = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M).
 * part: the block's partials, run after run (m, l, acc of R rows each). */
static void block_merge(const block_t *b, int H, int KV, int D, int g, const float *restrict part) {
    const int G = H / KV, R = G * b->n, n = b->n, runs = b->runs;
    const size_t per = (size_t)R * (D + 2);
    for (int r = 0; r < R; r++) {
        float M = -INFINITY;
        for (int c = 0; c < runs; c++) {
            const float mc = part[(size_t)(g * runs + c) * per + r];
            M = mc > M ? mc : M;
        }
        float *o = b->out + (size_t)(r % n) * b->o_stride + (size_t)(g * G + r / n) * D;
        float lsum = 0.0f;
        for (int e = 0; e < D; e++) o[e] = 0.0f;
        for (int c = 0; c < runs; c++) {
            const float *base = part + (size_t)(g * runs + c) * per;
            if (base[r] == -INFINITY) continue; /* a run entirely after this row's position */
            const float f = expf(base[r] - M);
            lsum += base[R + r] * f;
            const float *a = base + 2 * R + (size_t)r * D;
            for (int e = 0; e < D; e++) o[e] += a[e] * f;
        }
        const float inv = 1.0f / lsum;
        for (int e = 0; e < D; e++) o[e] *= inv;
    }
}

/* The attention of nb blocks, each as tandem_attend computes it (the same runs, the same merge:
 * the same bits), in one parallel region over every block's (head, run) items and one over their
 * merges. Why: a batched decode step of 16 sessions made 16 calls a layer, each a parallel region
 * of 6 items at 300 tokens, with the merge and the Python between them on one thread while the
 * other waited (libgomp's waiting was 26% of such a step's samples on the 2-core Intel host). */
static int attend_blocks(block_t *bl, int nb, int H, int KV, int D, float scale, int threads) {
    if (D % 16 || D > 16 * MAX_VEC || H % KV || KV <= 0) return -1;
    const int G = H / KV;
    size_t items = 0, floats = 0;
    for (int i = 0; i < nb; i++) {
        if (bl[i].n <= 0 || bl[i].s < 0 || bl[i].plen < 0 || bl[i].plen % SPAN || bl[i].plen > bl[i].s
            || (bl[i].plen && (!bl[i].pk || !bl[i].pv || bl[i].pcap < bl[i].plen)))
            return -1;
        bl[i].runs = (bl[i].s + bl[i].n + SPAN - 1) / SPAN;
        bl[i].first = items;
        items += (size_t)KV * bl[i].runs;
    }
    size_t *at = malloc(sizeof(size_t) * (nb + 1)); /* block i's partials start at part + at[i] */
    int *owner = malloc(sizeof(int) * (items ? items : 1));
    if (!at || !owner) { free(at), free(owner); return -2; }
    for (int i = 0; i < nb; i++) {
        at[i] = floats;
        floats += (size_t)KV * bl[i].runs * G * bl[i].n * (D + 2);
        for (size_t x = bl[i].first; x < bl[i].first + (size_t)KV * bl[i].runs; x++) owner[x] = i;
    }
    at[nb] = floats;
    float *part = aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16));
    if (!part) { free(at), free(owner); return -2; }
    /* Contiguous shares (a static schedule): a thread's runs then mostly follow each other in
     * memory. Measured against a dynamic schedule of single runs on the 2-core Intel Xeon host:
     * 9 rows at 4,000 tokens 20.2 -> 18.7 ms, one row 8.0 -> 7.5 ms (before the spread prefetch).
     * The runs' bits do not depend on which thread computes them. */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long x = 0; x < (long)items; x++) {
            const block_t *b = bl + owner[x];
            const int item = (int)(x - (long)b->first);
            block_item(b, H, KV, D, scale, item, part + at[owner[x]] + (size_t)item * G * b->n * (D + 2));
        }
#pragma omp for schedule(static)
        for (long x = 0; x < (long)nb * KV; x++)
            block_merge(bl + x / KV, H, KV, D, (int)(x % KV), part + at[x / KV]);
    }
    free(part), free(at), free(owner);
    return 0;
}

#define MAX_ROWS 32 /* query rows of one block as the runs see it (their scores stay in L1); longer blocks are split */

/* The blocks as attend_blocks takes them: a block of more than MAX_ROWS rows (a prompt piece) as
 * consecutive blocks of MAX_ROWS rows (the last shorter), each over the cache up to its own last
 * row. A row's result does not depend on the rows beside it (above), so a prompt prefilled whole,
 * in pieces of any length, or one token at a time gets the same bits at every position: the keys
 * and values the next layer writes, and so the logits, are the same however the prompt arrived.
 * A tree block (at most MAX_ROWS rows) stays whole. Returns the count, or -1. */
static int split_blocks(const block_t *in, int nb, block_t **out) {
    int total = 0;
    for (int i = 0; i < nb; i++) {
        if (in[i].n <= 0 || in[i].s < 0 || (in[i].tree && in[i].n > MAX_ROWS)) return -1;
        total += (in[i].n + MAX_ROWS - 1) / MAX_ROWS;
    }
    block_t *bl = malloc(sizeof(block_t) * (size_t)total);
    if (!bl) return -2;
    int at = 0;
    for (int i = 0; i < nb; i++)
        for (int t0 = 0; t0 < in[i].n; t0 += MAX_ROWS) {
            block_t b = in[i];
            b.q += (size_t)t0 * b.q_stride;
            b.out += (size_t)t0 * b.o_stride;
            b.n = in[i].n - t0 < MAX_ROWS ? in[i].n - t0 : MAX_ROWS;
            b.s = in[i].s + t0;
            bl[at++] = b;
        }
    *out = bl;
    return total;
}

static int attend_split(const block_t *in, int nb, int H, int KV, int D, float scale, int threads) {
    block_t *bl = NULL;
    const int total = split_blocks(in, nb, &bl);
    if (total < 0) return total;
    const int rc = attend_blocks(bl, total, H, KV, D, scale, threads);
    free(bl);
    return rc;
}

int tandem_attend(const float *restrict q, int q_stride, const void *restrict k, const void *restrict v,
                  float *restrict out, int o_stride, int H, int KV, int n, int D, int s, int cap,
                  float scale, int threads, const unsigned *restrict tree, int half,
                  const void *pk, const void *pv, int pcap, int plen) {
    block_t b = {q, k, v, out, tree, pk, pv, q_stride, o_stride, n, s, cap, pcap, plen, half != 0, 0, 0};
    return attend_split(&b, 1, H, KV, D, scale, threads);
}

/* nb blocks of one layer, block i described by desc[DESC i .. DESC i + DESC - 1]: the addresses of
 * its q, k, v, out and tree (0: causal), q's and out's row strides (floats), its rows n, its start
 * s, its cache's capacity cap, then its shared prefix's pk, pv (0: none), pcap and plen. Each block
 * as tandem_attend takes it; the caller checks every address (tandem/engine/model/llama.py checks
 * them through tandem_attend at layer 0 and moves them by whole layers after). */
#define DESC 14
int tandem_attend_many(int nb, const long long *desc, int H, int KV, int D, float scale, int threads, int half) {
    if (nb <= 0) return 0;
    block_t *bl = malloc(sizeof(block_t) * nb);
    if (!bl) return -2;
    for (int i = 0; i < nb; i++) {
        const long long *d = desc + DESC * (size_t)i;
        bl[i] = (block_t){(const float *)(size_t)d[0], (const char *)(size_t)d[1], (const char *)(size_t)d[2],
                          (float *)(size_t)d[3], (const unsigned *)(size_t)d[4], (const char *)(size_t)d[10],
                          (const char *)(size_t)d[11], (int)d[5], (int)d[6], (int)d[7], (int)d[8], (int)d[9],
                          (int)d[12], (int)d[13], half != 0, 0, 0};
    }
    const int rc = attend_split(bl, nb, H, KV, D, scale, threads);
    free(bl);
    return rc;
}
