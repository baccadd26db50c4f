/* The SIMD kernels of qmatmul.c, included once per instruction set. The includer defines
 *   KSUF                 the suffix of every function name here (_avx2, _avx512vnni, ...)
 *   DOT_ACC(acc, w, x)   acc + eight int32 sums of four u8*s8 products each, from 32 unsigned
 *                        and 32 signed bytes (AVX2: maddubs + madd + add; VNNI: one dpbusd)
 * and selects the target with `#pragma GCC target` around the include.
 *
 * Shapes: x [M, K] activations, weights [N, K] in groups of 32 along K, y [M, N]. Four weight
 * rows are computed together (one activation load serves four), written out by hand: a loop over
 * an array of vector accumulators is not kept in registers. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, KSUF)

#include "vec8.h"

static inline float FN(h2f)(uint16_t h) { return _cvtsh_ss(h); }

/* Two float16 values (a pair's scales) as floats in the two low lanes. */
static inline __m128 FN(load_half2)(const uint16_t *p) {
    int32_t bits;
    memcpy(&bits, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
}

/* One row of activations to int8 in groups of 32 (rule: quantize_row_portable), stored in the
 * order `x_offset` gives (pairs interleaved for 4-bit weights). */
static void FN(quantize_row)(const void *x, int bf16, int64_t K, int pairs, int8_t *q, float *d, float *s) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const int64_t G = K / GROUP;
    for (int64_t g = 0; g < G; g++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = FN(load8)(x, bf16, g * GROUP + j * 8);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
        }
        float a = FN(hmax)(amax);
        float scale = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
        __m256i i[4];
        for (int j = 0; j < 4; j++) /* round to nearest, ties to even, as nearbyintf */
            i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        int32_t sum = FN(hsum_i32)(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
        /* packs work within 128-bit lanes: the dword permute puts the 32 bytes back in order */
        __m256i p = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), order);
        if (pairs && (g < (G & ~(int64_t)1))) { /* halves 0-15 and 16-31 to their places in the pair */
            int8_t *base = q + (g & ~(int64_t)1) * GROUP + (g & 1) * (GROUP / 2);
            _mm_storeu_si128((__m128i *)base, _mm256_castsi256_si128(p));
            _mm_storeu_si128((__m128i *)(base + GROUP), _mm256_extracti128_si256(p, 1));
        } else {
            _mm256_storeu_si256((__m256i *)(q + g * GROUP), p);
        }
        d[g] = scale;
        s[g] = scale * (float)sum;
    }
}

/* Nibbles of 32 packed bytes (a pair of groups of one row): low ones [g0 0-15 | g1 0-15],
 * high ones [g0 16-31 | g1 16-31], which is how the activations of a pair are laid out. */
#define UNPACK_PAIR(p, lo, hi)                                                      \
    do {                                                                            \
        __m256i b_ = _mm256_loadu_si256((const __m256i *)(p));                      \
        lo = _mm256_and_si256(b_, low4);                                            \
        hi = _mm256_and_si256(_mm256_srli_epi16(b_, 4), low4);                      \
    } while (0)

/* acc += (int32 dot of a pair, lanes 0-3 group 0 and 4-7 group 1) * (d_w * d_x per group). */
#define PAIR_FMA(acc, lo, hi, scales_w)                                             \
    do {                                                                            \
        __m256i d_ = DOT_ACC(DOT_ACC(_mm256_setzero_si256(), lo, xa), hi, xb);      \
        __m256 s_ = _mm256_permutevar8x32_ps(                                       \
            _mm256_castps128_ps256(_mm_mul_ps(FN(load_half2)(scales_w), dx)), spread); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_), s_, acc);                     \
    } while (0)

/* One group alone (the last of an odd count), in natural order. */
static inline __m256 FN(q4_single)(__m256 acc, const uint8_t *p, const int8_t *x, float scale) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
    __m256i d = DOT_ACC(_mm256_setzero_si256(), w, _mm256_loadu_si256((const __m256i *)x));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale), acc);
}

/* sum over groups of m_w * (d_x * sum(q_x)): a 4-bit weight is d * q + m. */
static inline float FN(mins_dot)(const uint16_t *wm, const float *xs, int64_t G) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g))), _mm256_loadu_ps(xs + g), acc);
    float sum = FN(hsum)(acc);
    for (; g < G; g++) sum += FN(h2f)(wm[g]) * xs[g];
    return sum;
}

#if WIDE
/* The 512-bit loops (WIDE: AVX-512 VNNI) take two pairs (4-bit) or two groups (8-bit) a vector and
 * fold their sums into the 256-bit accumulators the rest of the loop continues. */
static inline __m256 FN(fold)(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* acc += weight row r's pairs p and p + 1 (64 bytes) against xa, xb, each group's int32 sum scaled
 * by d_w * d_x (lanes 0-3 group 2p, ..., 12-15 group 2p + 3). */
#define WIDE_PAIRS_FMA(acc, r)                                                                      \
    do {                                                                                            \
        const __m512i b_ = _mm512_loadu_si512(w + (r) * row_bytes + p * GROUP);                     \
        const __m512i lo_ = _mm512_and_si512(b_, low4z), hi_ = _mm512_and_si512(_mm512_srli_epi16(b_, 4), low4z); \
        const __m512i d_ = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo_, xa), hi_, xb); \
        const __m128 ws_ = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wd + (r) * G + 2 * p)));     \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_),                                                 \
                              _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(_mm_mul_ps(ws_, dx))), acc); \
    } while (0)

/* The same for 8-bit weights, groups g and g + 1 (lanes 0-7 and 8-15): |q_w| against q_x negated
 * where q_w is negative (AVX-512 has no byte sign instruction). */
#define WIDE_Q8_FMA(acc, row)                                                                       \
    do {                                                                                            \
        const __m512i w_ = _mm512_loadu_si512(w + (row) * a->K + g * GROUP);                        \
        const __m512i sx_ = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w_), _mm512_setzero_si512(), x); \
        const __m512i d_ = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w_), sx_);   \
        const __m128 ws_ = FN(load_half2)(wd + (row) * G + g);                                       \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d_),                                                 \
                              _mm512_permutexvar_ps(spread2, _mm512_castps128_ps512(_mm_mul_ps(ws_, dx))), acc); \
    } while (0)
#endif

/* y[m, n0 .. n0 + R) for R = 4 or 1 weight rows: 4-bit weights against one activation row. */
static inline __attribute__((always_inline)) void FN(q4_rows)(
        const struct qmm *a, int64_t m, int64_t n0, int R, float *out) {
    const int64_t G = a->K / GROUP, pairs = G / 2, row_bytes = G * (GROUP / 2);
    const int8_t *xq = a->xq + m * a->K;
    const float *xd = a->xd + m * G;
    const uint8_t *w = (const uint8_t *)a->qs + n0 * row_bytes;
    const uint16_t *wd = a->wd + n0 * G;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t p = 0;
#if WIDE
    __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
    const __m512i low4z = _mm512_set1_epi8(0x0f);
    const __m512i spread4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (; p + 2 <= pairs; p += 2) { /* two pairs a vector: [pair p | pair p + 1] */
        const __m512i x0 = _mm512_loadu_si512(xq + p * 2 * GROUP), x1 = _mm512_loadu_si512(xq + p * 2 * GROUP + 2 * GROUP);
        const __m512i xa = _mm512_shuffle_i64x2(x0, x1, 0x44), xb = _mm512_shuffle_i64x2(x0, x1, 0xee);
        const __m128 dx = _mm_loadu_ps(xd + 2 * p);
        WIDE_PAIRS_FMA(z0, 0);
        if (R == 4) {
            WIDE_PAIRS_FMA(z1, 1);
            WIDE_PAIRS_FMA(z2, 2);
            WIDE_PAIRS_FMA(z3, 3);
        }
    }
    a0 = FN(fold)(z0), a1 = FN(fold)(z1), a2 = FN(fold)(z2), a3 = FN(fold)(z3);
#endif
    for (; p < pairs; p++) {
        const __m256i xa = _mm256_loadu_si256((const __m256i *)(xq + p * 2 * GROUP));
        const __m256i xb = _mm256_loadu_si256((const __m256i *)(xq + p * 2 * GROUP + GROUP));
        const __m128 dx = _mm_castpd_ps(_mm_load_sd((const double *)(xd + 2 * p)));
        __m256i lo, hi;
        UNPACK_PAIR(w + p * GROUP, lo, hi);
        PAIR_FMA(a0, lo, hi, wd + 2 * p);
        if (R == 4) {
            UNPACK_PAIR(w + row_bytes + p * GROUP, lo, hi);
            PAIR_FMA(a1, lo, hi, wd + G + 2 * p);
            UNPACK_PAIR(w + 2 * row_bytes + p * GROUP, lo, hi);
            PAIR_FMA(a2, lo, hi, wd + 2 * G + 2 * p);
            UNPACK_PAIR(w + 3 * row_bytes + p * GROUP, lo, hi);
            PAIR_FMA(a3, lo, hi, wd + 3 * G + 2 * p);
        }
    }
    if (G & 1) { /* an odd last group */
        const int64_t g = G - 1;
        const int8_t *xg = xq + g * GROUP;
        a0 = FN(q4_single)(a0, w + g * (GROUP / 2), xg, FN(h2f)(wd[g]) * xd[g]);
        if (R == 4) {
            a1 = FN(q4_single)(a1, w + row_bytes + g * (GROUP / 2), xg, FN(h2f)(wd[G + g]) * xd[g]);
            a2 = FN(q4_single)(a2, w + 2 * row_bytes + g * (GROUP / 2), xg, FN(h2f)(wd[2 * G + g]) * xd[g]);
            a3 = FN(q4_single)(a3, w + 3 * row_bytes + g * (GROUP / 2), xg, FN(h2f)(wd[3 * G + g]) * xd[g]);
        }
    }
    const float *xs = a->xs + m * G;
    const uint16_t *wm = a->wm + n0 * G;
    out[0] = FN(hsum)(a0) + FN(mins_dot)(wm, xs, G);
    if (R == 4) {
        out[1] = FN(hsum)(a1) + FN(mins_dot)(wm + G, xs, G);
        out[2] = FN(hsum)(a2) + FN(mins_dot)(wm + 2 * G, xs, G);
        out[3] = FN(hsum)(a3) + FN(mins_dot)(wm + 3 * G, xs, G);
    }
}

/* Two activation rows against the same four weight rows: each weight pair is read and unpacked
 * once for both (q4_rows unpacks it again for every row), so a decode batch of a few rows costs
 * less than that many batches of one. The same arithmetic as q4_rows, row by row. */
#if WIDE
#define WIDE_PAIRS_FMA2(acc0, acc1, r)                                                              \
    do {                                                                                            \
        const __m512i b_ = _mm512_loadu_si512(w + (r) * row_bytes + p * GROUP);                     \
        const __m512i lo_ = _mm512_and_si512(b_, low4z), hi_ = _mm512_and_si512(_mm512_srli_epi16(b_, 4), low4z); \
        const __m128 ws_ = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(wd + (r) * G + 2 * p)));     \
        const __m512i d0_ = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo_, xa0), hi_, xb0); \
        const __m512i d1_ = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo_, xa1), hi_, xb1); \
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0_),                                               \
                               _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(_mm_mul_ps(ws_, dx0))), acc0); \
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1_),                                               \
                               _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(_mm_mul_ps(ws_, dx1))), acc1); \
    } while (0)
#endif

#define PAIR_FMA2(acc0, acc1, r)                                                                    \
    do {                                                                                            \
        __m256i lo_, hi_;                                                                           \
        UNPACK_PAIR(w + (r) * row_bytes + p * GROUP, lo_, hi_);                                     \
        const __m128 ws_ = FN(load_half2)(wd + (r) * G + 2 * p);                                     \
        __m256i d_ = DOT_ACC(DOT_ACC(_mm256_setzero_si256(), lo_, xa0), hi_, xb0);                  \
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_),                                               \
                               _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(ws_, dx0)), spread), acc0); \
        d_ = DOT_ACC(DOT_ACC(_mm256_setzero_si256(), lo_, xa1), hi_, xb1);                           \
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_),                                               \
                               _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_mul_ps(ws_, dx1)), spread), acc1); \
    } while (0)

/* y[m, n0 .. n0 + 4) into out[0..3] and y[m + 1, n0 .. n0 + 4) into out[4..7]. */
static inline __attribute__((always_inline)) void FN(q4_rows2)(const struct qmm *a, int64_t m, int64_t n0,
                                                               float *out) {
    const int64_t G = a->K / GROUP, pairs = G / 2, row_bytes = G * (GROUP / 2);
    const int8_t *xq0 = a->xq + m * a->K, *xq1 = xq0 + a->K;
    const float *xd0 = a->xd + m * G, *xd1 = xd0 + G;
    const uint8_t *w = (const uint8_t *)a->qs + n0 * row_bytes;
    const uint16_t *wd = a->wd + n0 * G;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t p = 0;
#if WIDE
    __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0, y0 = z0, y1 = z0, y2 = z0, y3 = z0;
    const __m512i low4z = _mm512_set1_epi8(0x0f);
    const __m512i spread4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (; p + 2 <= pairs; p += 2) {
        const __m512i u0 = _mm512_loadu_si512(xq0 + p * 2 * GROUP), u1 = _mm512_loadu_si512(xq0 + p * 2 * GROUP + 2 * GROUP);
        const __m512i v0 = _mm512_loadu_si512(xq1 + p * 2 * GROUP), v1 = _mm512_loadu_si512(xq1 + p * 2 * GROUP + 2 * GROUP);
        const __m512i xa0 = _mm512_shuffle_i64x2(u0, u1, 0x44), xb0 = _mm512_shuffle_i64x2(u0, u1, 0xee);
        const __m512i xa1 = _mm512_shuffle_i64x2(v0, v1, 0x44), xb1 = _mm512_shuffle_i64x2(v0, v1, 0xee);
        const __m128 dx0 = _mm_loadu_ps(xd0 + 2 * p), dx1 = _mm_loadu_ps(xd1 + 2 * p);
        WIDE_PAIRS_FMA2(z0, y0, 0);
        WIDE_PAIRS_FMA2(z1, y1, 1);
        WIDE_PAIRS_FMA2(z2, y2, 2);
        WIDE_PAIRS_FMA2(z3, y3, 3);
    }
    a0 = FN(fold)(z0), a1 = FN(fold)(z1), a2 = FN(fold)(z2), a3 = FN(fold)(z3);
    b0 = FN(fold)(y0), b1 = FN(fold)(y1), b2 = FN(fold)(y2), b3 = FN(fold)(y3);
#endif
    for (; p < pairs; p++) {
        const __m256i xa0 = _mm256_loadu_si256((const __m256i *)(xq0 + p * 2 * GROUP));
        const __m256i xb0 = _mm256_loadu_si256((const __m256i *)(xq0 + p * 2 * GROUP + GROUP));
        const __m256i xa1 = _mm256_loadu_si256((const __m256i *)(xq1 + p * 2 * GROUP));
        const __m256i xb1 = _mm256_loadu_si256((const __m256i *)(xq1 + p * 2 * GROUP + GROUP));
        const __m128 dx0 = _mm_castpd_ps(_mm_load_sd((const double *)(xd0 + 2 * p)));
        const __m128 dx1 = _mm_castpd_ps(_mm_load_sd((const double *)(xd1 + 2 * p)));
        PAIR_FMA2(a0, b0, 0);
        PAIR_FMA2(a1, b1, 1);
        PAIR_FMA2(a2, b2, 2);
        PAIR_FMA2(a3, b3, 3);
    }
    if (G & 1) { /* an odd last group */
        const int64_t g = G - 1;
        const int8_t *x0 = xq0 + g * GROUP, *x1 = xq1 + g * GROUP;
        const uint8_t *wg = w + g * (GROUP / 2);
        a0 = FN(q4_single)(a0, wg, x0, FN(h2f)(wd[g]) * xd0[g]);
        a1 = FN(q4_single)(a1, wg + row_bytes, x0, FN(h2f)(wd[G + g]) * xd0[g]);
        a2 = FN(q4_single)(a2, wg + 2 * row_bytes, x0, FN(h2f)(wd[2 * G + g]) * xd0[g]);
        a3 = FN(q4_single)(a3, wg + 3 * row_bytes, x0, FN(h2f)(wd[3 * G + g]) * xd0[g]);
        b0 = FN(q4_single)(b0, wg, x1, FN(h2f)(wd[g]) * xd1[g]);
        b1 = FN(q4_single)(b1, wg + row_bytes, x1, FN(h2f)(wd[G + g]) * xd1[g]);
        b2 = FN(q4_single)(b2, wg + 2 * row_bytes, x1, FN(h2f)(wd[2 * G + g]) * xd1[g]);
        b3 = FN(q4_single)(b3, wg + 3 * row_bytes, x1, FN(h2f)(wd[3 * G + g]) * xd1[g]);
    }
    const float *xs0 = a->xs + m * G, *xs1 = xs0 + G;
    const uint16_t *wm = a->wm + n0 * G;
    out[0] = FN(hsum)(a0) + FN(mins_dot)(wm, xs0, G);
    out[1] = FN(hsum)(a1) + FN(mins_dot)(wm + G, xs0, G);
    out[2] = FN(hsum)(a2) + FN(mins_dot)(wm + 2 * G, xs0, G);
    out[3] = FN(hsum)(a3) + FN(mins_dot)(wm + 3 * G, xs0, G);
    out[4] = FN(hsum)(b0) + FN(mins_dot)(wm, xs1, G);
    out[5] = FN(hsum)(b1) + FN(mins_dot)(wm + G, xs1, G);
    out[6] = FN(hsum)(b2) + FN(mins_dot)(wm + 2 * G, xs1, G);
    out[7] = FN(hsum)(b3) + FN(mins_dot)(wm + 3 * G, xs1, G);
}

#undef PAIR_FMA2
#if WIDE
#undef WIDE_PAIRS_FMA2
#endif

/* 8-bit weights (d * q, natural order): u8*s8 instructions take |q_w| and q_x with q_w's sign. */
#define Q8_FMA(acc, row)                                                                        \
    do {                                                                                        \
        __m256i w_ = _mm256_loadu_si256((const __m256i *)(w + (row) * a->K + g * GROUP));        \
        __m256i d_ = DOT_ACC(_mm256_setzero_si256(), _mm256_sign_epi8(w_, w_), _mm256_sign_epi8(x, w_)); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_), _mm256_set1_ps(FN(h2f)(wd[(row) * G + g]) * dx), acc); \
    } while (0)

static inline __attribute__((always_inline)) void FN(q8_rows)(
        const struct qmm *a, int64_t m, int64_t n0, int R, float *out) {
    const int64_t G = a->K / GROUP;
    const int8_t *xq = a->xq + m * a->K;
    const int8_t *w = (const int8_t *)a->qs + n0 * a->K;
    const uint16_t *wd = a->wd + n0 * G;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t g = 0;
#if WIDE
    __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
    const __m512i spread2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (; g + 2 <= G; g += 2) {
        const __m512i x = _mm512_loadu_si512(xq + g * GROUP);
        const __m128 dx = _mm_castpd_ps(_mm_load_sd((const double *)(a->xd + m * G + g)));
        WIDE_Q8_FMA(z0, 0);
        if (R == 4) {
            WIDE_Q8_FMA(z1, 1);
            WIDE_Q8_FMA(z2, 2);
            WIDE_Q8_FMA(z3, 3);
        }
    }
    a0 = FN(fold)(z0), a1 = FN(fold)(z1), a2 = FN(fold)(z2), a3 = FN(fold)(z3);
#endif
    for (; g < G; g++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + g * GROUP));
        const float dx = a->xd[m * G + g];
        Q8_FMA(a0, 0);
        if (R == 4) {
            Q8_FMA(a1, 1);
            Q8_FMA(a2, 2);
            Q8_FMA(a3, 3);
        }
    }
    out[0] = FN(hsum)(a0);
    if (R == 4) {
        out[1] = FN(hsum)(a1);
        out[2] = FN(hsum)(a2);
        out[3] = FN(hsum)(a3);
    }
}

/* TILE (four) outputs of row m into y: float32, or bfloat16 rounded to nearest even as f32_to_bf16
 * rounds (NaN kept a NaN), four at a time: a call a tile to the scalar store_row cost ~5% of a
 * one-row decode step. */
static inline void FN(store_tile)(const struct qmm *a, int64_t m, int64_t n0, const float *out) {
    const __m128 v = _mm_loadu_ps(out);
    if (!a->x_bf16) {
        _mm_storeu_ps((float *)a->y + m * a->N + n0, v);
        return;
    }
    const __m128i u = _mm_castps_si128(v), high = _mm_srli_epi32(u, 16);
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)),
                                                         _mm_and_si128(high, _mm_set1_epi32(1))), 16);
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(v, v));
    const __m128i bits = _mm_or_si128(_mm_andnot_si128(nan, rounded),
                                      _mm_and_si128(nan, _mm_or_si128(high, _mm_set1_epi32(0x40))));
    _mm_storel_epi64((__m128i *)((uint16_t *)a->y + m * a->N + n0), _mm_packus_epi32(bits, bits));
}

static void FN(gemm)(const struct qmm *a) {
    const int64_t tiles = (a->N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(a->threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE, rows = a->N - n0 < TILE ? a->N - n0 : TILE;
        float out[2 * TILE];
        int64_t m = 0;
        if (rows == TILE && a->bits == 4)
            for (; m + 2 <= a->M; m += 2) { /* two activation rows a pass over the weights */
                FN(q4_rows2)(a, m, n0, out);
                FN(store_tile)(a, m, n0, out);
                FN(store_tile)(a, m + 1, n0, out + TILE);
            }
        for (; m < a->M; m++) {
            if (rows == TILE) {
                if (a->bits == 4) FN(q4_rows)(a, m, n0, TILE, out);
                else FN(q8_rows)(a, m, n0, TILE, out);
            } else {
                for (int64_t r = 0; r < rows; r++) {
                    if (a->bits == 4) FN(q4_rows)(a, m, n0 + r, 1, out + r);
                    else FN(q8_rows)(a, m, n0 + r, 1, out + r);
                }
            }
            if (rows == TILE) FN(store_tile)(a, m, n0, out);
            else store_row(a, m, n0, rows, out);
        }
    }
}

static void FN(quantize)(const struct qmm *a) {
    const int64_t G = a->K / GROUP;
#pragma omp parallel for num_threads(a->M * a->K >= PARALLEL_QUANTIZE ? a->threads : 1) schedule(static)
    for (int64_t m = 0; m < a->M; m++) {
        const void *row = a->x_bf16 ? (const void *)((const uint16_t *)a->x + m * a->K)
                                    : (const void *)((const float *)a->x + m * a->K);
        FN(quantize_row)(row, a->x_bf16, a->K, a->bits == 4, a->xq + m * a->K, a->xd + m * G, a->xs + m * G);
    }
}

#undef UNPACK_PAIR
#undef PAIR_FMA
#undef Q8_FMA
#ifdef WIDE_PAIRS_FMA
#undef WIDE_PAIRS_FMA
#undef WIDE_Q8_FMA
#endif
#undef FN
#undef CAT
#undef CAT_
