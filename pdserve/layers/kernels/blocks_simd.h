/* The SIMD kernels of blocks.c, included once per instruction set (as qmatmul_simd.h is). The
 * includer defines
 *   KSUF                 the suffix of every function name here (_avx2, _avx512vnni, ...)
 *   DOT_ACC(acc, w, x)   acc + eight int32 sums of four u8*s8 products each, from 32 unsigned and
 *                        32 signed bytes (AVX2: maddubs + madd + add; VNNI: one dpbusd)
 *   AVX512               1 where AVX-512 (F, BW, VL, VNNI) may be used: 512-bit products, byte masks
 * and selects the target with `#pragma GCC target` around the include. This file holds the
 * activations' quantization, the 32-element formats' codes, dequantization and the row loop;
 * blocks_k.h the 256-element formats' codes and scales; blocks_dot.h the products of a weight row.
 *
 * Shapes: x [M, K] activations (xq int8 [M, K], xd and xs [M, K / 32], xh [M, K / 16]), a weight
 * row's blocks back to back, y [M, ldy]. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, KSUF)

#define XROWS (AVX512 ? 8 : 4) /* activation rows a pass over a weight row */

/* u8*s8 products for signed codes: |w| against x with w's sign (|w| <= 128 and |x| <= 127, so
 * maddubs's int16 pair sums stay below 32767). */
#define DOT_SIGNED(acc, w, x) DOT_ACC((acc), _mm256_sign_epi8((w), (w)), _mm256_sign_epi8((x), (w)))

#include "vec8.h"

static inline float FN(h2f)(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* How this variant stores activations for `format` (LAYOUT_*, blocks.c), and whether biased by 128:
 * the AVX-512 kernels take two groups a vector, and signed codes as the signed operand. */
static inline int FN(x_layout)(int format) {
    const int halves = scaled_per_half(format);
    return AVX512 ? (halves ? LAYOUT_PAIR_HALVES : LAYOUT_PAIRS) : (halves ? LAYOUT_HALVES : LAYOUT_NATURAL);
}

#define X_BIASED(format) (AVX512 && signed_codes(format))

/* Formats of equal keys take the same quantized activations: one quantization serves them all. */
static inline int FN(x_key)(int format) { return FN(x_layout)(format) * 2 + (X_BIASED(format) ? 1 : 0); }

#if AVX512
/* Two groups' 32 bytes (natural order) as the AVX-512 kernels take them: 4-byte runs alternating
 * between the groups, or (`halves`) between the first and last halves of each group in turn
 * [g0 a, g0 b, g1 a, g1 b], so that lane j's scale is a broadcast of 2 or 4 floats. */
static inline __m512i FN(pair)(__m256i g0, __m256i g1, int halves) {
    const __m512i order = halves ? _mm512_setr_epi32(0, 4, 16, 20, 1, 5, 17, 21, 2, 6, 18, 22, 3, 7, 19, 23)
                                 : _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    return _mm512_permutex2var_epi32(_mm512_castsi256_si512(g0), order, _mm512_castsi256_si512(g1));
}
#endif

/* One row of activations to int8 in groups of 32 (rule: quantize_row_portable), with each group's
 * scale d, d * sum, and the sums h of its two halves, stored in `layout` (pairs only within whole
 * batches of 8 groups; the rest in natural order). */
static void FN(quantize_row)(const void *x, int bf16, int64_t K, int layout, int biased, int8_t *q, float *d, float *s,
                             float *h) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    /* packs work within 128-bit lanes, leaving the 4-byte runs in the order 0 2 4 6 1 3 5 7 */
    const __m256i order = layout == LAYOUT_HALVES ? _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
                                                  : _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i bias = _mm256_set1_epi8(biased ? (char)0x80 : 0);
#if AVX512
    const int64_t paired = layout >= LAYOUT_PAIRS ? K / SUPER * 8 : 0;
    __m256i previous = _mm256_setzero_si256();
#endif
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = FN(load8)(x, bf16, g * GROUP + j * 8);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
        }
        const float a = FN(hmax)(amax), scale = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
        __m256i i[4];
        for (int j = 0; j < 4; j++) /* round to nearest, ties to even, as nearbyintf */
            i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        const int32_t h0 = FN(hsum_i32)(_mm256_add_epi32(i[0], i[1])), h1 = FN(hsum_i32)(_mm256_add_epi32(i[2], i[3]));
        const __m256i p = _mm256_xor_si256(bias, _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])), order));
        d[g] = scale;
        s[g] = scale * (float)(h0 + h1);
        h[2 * g] = (float)h0, h[2 * g + 1] = (float)h1;
#if AVX512
        if (g < paired) {
            if (g % 2 == 1)
                _mm512_storeu_si512(q + (g - 1) * GROUP, FN(pair)(previous, p, layout == LAYOUT_PAIR_HALVES));
            previous = p;
            continue;
        }
#endif
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), p);
    }
}

static void FN(quantize)(const struct bmm *a) {
    const int64_t G = a->K / GROUP;
#pragma omp parallel for num_threads(a->M * a->K >= PARALLEL_QUANTIZE ? a->threads : 1) schedule(static)
    for (int64_t m = 0; m < a->M; m++) {
        const void *row = a->x_bf16 ? (const void *)((const uint16_t *)a->x + m * a->K)
                                    : (const void *)((const float *)a->x + m * a->K);
        FN(quantize_row)(row, a->x_bf16, a->K, FN(x_layout)(a->format), X_BIASED(a->format), a->xq + m * a->K,
                         a->xd + m * G, a->xs + m * G, a->xh + m * 2 * G);
    }
}

/* 16 packed bytes as 32 codes in element order: [low nibbles | high nibbles]. */
static inline __m256i FN(nibbles)(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(15));
}

/* 0x10 in byte j where bit j of the little-endian word at p is set: Q5's fifth bits. */
static inline __m256i FN(fifth_bits)(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
#if AVX512
    return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
    /* byte j gets the word's byte j / 8, then keeps its bit j % 8 */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                                                  0x0303030303030303));
    const __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
#endif
}

static inline __m256i FN(iq4_table)(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
}

/* A 32-element block's codes in element order: unsigned (the true codes plus code_offset) or, for
 * Q8_0 and IQ4_NL, signed. */
static inline __m256i FN(codes32)(int format, const uint8_t *b) {
    switch (format) {
    case GGML_Q4_0: return FN(nibbles)(b + 2);
    case GGML_IQ4_NL: return _mm256_shuffle_epi8(FN(iq4_table)(), FN(nibbles)(b + 2));
    case GGML_Q4_1: return FN(nibbles)(b + 4);
    case GGML_Q5_0: return _mm256_or_si256(FN(nibbles)(b + 6), FN(fifth_bits)(b + 2));
    case GGML_Q5_1: return _mm256_or_si256(FN(nibbles)(b + 8), FN(fifth_bits)(b + 4));
    default: return _mm256_loadu_si256((const __m256i *)(b + 2)); /* Q8_0 */
    }
}

/* The scales of 8 blocks of a 32-element format (d, and the coefficient of the activations' d * sum:
 * the minimum, or -offset * d) as vectors, from 8 scalar loads of their float16 side by side. */
static inline void FN(scales8)(int format, const uint8_t *b, __m256 *d, __m256 *low) {
    const int bytes = block_bytes(format), min = has_minimum(format);
    uint16_t dh[8], mh[8];
    for (int i = 0; i < 8; i++) {
        memcpy(dh + i, b + i * bytes, 2);
        if (min) memcpy(mh + i, b + i * bytes + 2, 2);
    }
    *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
    *low = min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh))
               : _mm256_mul_ps(*d, _mm256_set1_ps(-(float)code_offset(format)));
}

/* 8 values to out[i..i + 8): float32, or bfloat16 rounded to nearest even as f32_to_bf16 does (a
 * NaN kept a NaN). */
static inline void FN(store8)(__m256 v, void *out, int64_t i, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)out + i, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), packed);
}

/* A group's 32 codes (int8: the true ones, or unsigned where the format has a minimum) expanded to
 * q * ds + dm into out[i..i + 32), ds and dm lane-broadcast per half. The products are exact in
 * float32, so the fused multiply-add rounds once, as the reference's add does. */
static inline void FN(expand_group)(__m256i q, const __m256 *ds, const __m256 *dm, int min, void *out, int64_t i,
                                    int bf16) {
    const __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
#if AVX512 /* a half a vector */
    for (int k = 0; k < 2; k++) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(half[k]));
        const __m512 d = _mm512_broadcastss_ps(_mm256_castps256_ps128(ds[k]));
        const __m512 m = _mm512_broadcastss_ps(_mm256_castps256_ps128(dm[k]));
        const __m512 e = min ? _mm512_fmadd_ps(v, d, m) : _mm512_mul_ps(v, d);
        if (!bf16) {
            _mm512_storeu_ps((float *)out + i + 16 * k, e);
            continue;
        }
        const __m512i u = _mm512_castps_si512(e), high = _mm512_srli_epi32(u, 16);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                       _mm512_and_si512(high, _mm512_set1_epi32(1))), 16);
        r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q), high, _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i + 16 * k), _mm512_cvtepi32_epi16(r));
    }
#else
    for (int k = 0; k < 4; k++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k % 2 ? _mm_srli_si128(half[k / 2], 8) : half[k / 2]));
        FN(store8)(min ? _mm256_fmadd_ps(v, ds[k / 2], dm[k / 2]) : _mm256_mul_ps(v, ds[k / 2]), out, i + 8 * k, bf16);
    }
#endif
}

#include "blocks_k.h"
#include "blocks_dot.h"

/* One weight row expanded into out[K], a batch of 256 elements at a time: the scales decoded as
 * vectors, each group's broadcast to its lanes. */
static void FN(dequantize_row)(int format, const uint8_t *w, int64_t K, void *out, int bf16) {
    const int64_t G = K / GROUP, bytes = block_bytes(format);
    const int offset = code_offset(format), halves = scaled_per_half(format), min = has_minimum(format);
    const int64_t step = (block_elements(format) == GROUP ? 8 : 1) * bytes;
    for (int64_t t = 0; t < G / 8; t++) {
        const uint8_t *b = w + t * step;
        __m256 sc[2], lo[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        if (block_elements(format) == GROUP) FN(scales8)(format, b, &sc[0], &lo[0]);
        else FN(k_scales)(format, b, sc, lo);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m256i q = FN(group_codes)(format, b, i);
            if (offset) q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)offset));
            const __m256i lanes[2] = {_mm256_set1_epi32(halves ? 2 * (i % 4) : i),
                                      _mm256_set1_epi32(halves ? 2 * (i % 4) + 1 : i)};
            __m256 ds[2], dm[2];
            for (int j = 0; j < 2; j++) {
                ds[j] = _mm256_permutevar8x32_ps(sc[halves ? i / 4 : 0], lanes[j]);
                dm[j] = _mm256_permutevar8x32_ps(lo[halves ? i / 4 : 0], lanes[j]);
            }
            FN(expand_group)(q, ds, dm, min, out, (8 * t + i) * GROUP, bf16);
        }
    }
    for (int64_t g = G / 8 * 8; g < G; g++) { /* the last G % 8 blocks of a 32-element format */
        const uint8_t *b = w + g * bytes;
        __m256i q = FN(codes32)(format, b);
        if (offset) q = _mm256_sub_epi8(q, _mm256_set1_epi8((char)offset));
        const __m256 d = _mm256_set1_ps(FN(h2f)(b)), m = _mm256_set1_ps(min ? FN(h2f)(b + 2) : 0.0f);
        const __m256 ds[2] = {d, d}, dm[2] = {m, m};
        FN(expand_group)(q, ds, dm, min, out, g * GROUP, bf16);
    }
}

/* One weight row for R (1, 2, 4 or, with AVX-512, 8) activation rows: the format and R made
 * constants, so each kernel keeps its sums in registers. */
#if AVX512
#define ROWS8(fmt) if (R == 8) FN(dot)(a, fmt, w, m, 8, out); else
#else
#define ROWS8(fmt)
#endif
#define BLOCK_ROWS(fmt)                                                    \
    case fmt:                                                              \
        ROWS8(fmt)                                                         \
        if (R == 4) FN(dot)(a, fmt, w, m, 4, out);                         \
        else if (R == 2) FN(dot)(a, fmt, w, m, 2, out);                    \
        else FN(dot)(a, fmt, w, m, 1, out);                                \
        break;

static void FN(dot_rows)(const struct bmm *a, const uint8_t *w, int64_t m, int R, float *out) {
    switch (a->format) {
        BLOCK_ROWS(GGML_Q4_0)
        BLOCK_ROWS(GGML_Q4_1)
        BLOCK_ROWS(GGML_Q5_0)
        BLOCK_ROWS(GGML_Q5_1)
        BLOCK_ROWS(GGML_Q8_0)
        BLOCK_ROWS(GGML_IQ4_NL)
        BLOCK_ROWS(GGML_Q2_K)
        BLOCK_ROWS(GGML_Q3_K)
        BLOCK_ROWS(GGML_Q4_K)
        BLOCK_ROWS(GGML_Q5_K)
        BLOCK_ROWS(GGML_Q6_K)
        BLOCK_ROWS(GGML_IQ4_XS)
    }
}

#undef BLOCK_ROWS
#undef ROWS8

/* Each thread a range of weight rows, each row read from memory once: activation rows XROWS at a
 * time (a row of a few kB stays in L1 for the next ones). */
/* Every part's rows (`nparts` weights sharing one quantized activation buffer) in one parallel region. */
static void FN(gemm)(const struct bmm *parts, int64_t nparts) {
#pragma omp parallel num_threads(parts[0].threads)
    for (int64_t p = 0; p < nparts; p++) {
        const struct bmm *a = parts + p;
#pragma omp for schedule(static) nowait
        for (int64_t n = 0; n < a->N; n++) {
            const uint8_t *w = a->w + n * a->row_bytes;
            float out[XROWS];
            for (int64_t m = 0; m < a->M;) {
                const int R = a->M - m >= XROWS ? XROWS : a->M - m >= 4 ? 4 : a->M - m >= 2 ? 2 : 1;
                FN(dot_rows)(a, w, m, R, out);
                for (int r = 0; r < R; r++) store_value(a->y, (m + r) * a->ldy + n, out[r], a->x_bf16);
                m += R;
            }
        }
    }
}

#undef DOT_SIGNED
#undef XROWS
#undef X_BIASED
#undef FN
#undef CAT
#undef CAT_
