/* The SIMD kernels of qmatmul.c, included once per instruction set. The includer defines
 *   KSUF             the suffix of every function name here (_avx2, _avx512vnni, ...)
 *   DOT_U8S8(w, x)   eight int32 sums of four u8*s8 products each, from 32 unsigned and 32
 *                    signed bytes (AVX2: maddubs + madd; VNNI: one dpbusd)
 * and selects the target with `#pragma GCC target` around the include.
 *
 * Shapes: x [M, K] activations, weights [N, K] in groups of 32 along K, y [M, N]. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, KSUF)

static inline __m256 FN(load8)(const void *x, int bf16, int64_t i) {
    if (bf16) {  /* bfloat16 is the top half of a float32 */
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

static inline float FN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float FN(hmax)(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline int32_t FN(hsum_i32)(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* One row of activations to int8 in groups of 32 (see quantize_row_portable for the rule). */
static void FN(quantize_row)(const void *x, int bf16, int64_t K, int8_t *q, float *d, float *s) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < K / GROUP; g++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = FN(load8)(x, bf16, g * GROUP + j * 8);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
        }
        float a = FN(hmax)(amax);
        float scale = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
        __m256i i[4];
        for (int j = 0; j < 4; j++)  /* round to nearest, ties to even, as nearbyintf */
            i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));
        int32_t sum = FN(hsum_i32)(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
        /* packs work within 128-bit lanes: the dword permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(q + g * GROUP), _mm256_permutevar8x32_epi32(p, order));
        d[g] = scale;
        s[g] = scale * (float)sum;
    }
}

/* A group of 16 packed bytes as 32 unsigned 4-bit values: low nibbles are elements 0-15, high
 * nibbles 16-31. */
static inline __m256i FN(unpack_q4)(const uint8_t *p) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low4), _mm_and_si128(b, low4));
}

/* y[n] for R weight rows starting at row n of one activation row: a 4-bit weight is
 * d * q + m, so each group adds d_w * d_x * sum(q_w q_x) + m_w * (d_x * sum(q_x)). */
static inline __attribute__((always_inline)) void FN(q4_rows)(
        const int8_t *xq, const float *xd, const float *xs, int64_t G,
        const uint8_t *qs, const float *wd, const float *wm, float *out, const int R) {
    __m256 acc[4];
    float mins[4];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); mins[r] = 0.0f; }
    for (int64_t g = 0; g < G; g++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + g * GROUP));
        for (int r = 0; r < R; r++) {
            __m256i w = FN(unpack_q4)(qs + r * G * (GROUP / 2) + g * (GROUP / 2));
            __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(w, x));
            acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd[r * G + g] * xd[g]), acc[r]);
            mins[r] += wm[r * G + g] * xs[g];
        }
    }
    for (int r = 0; r < R; r++) out[r] = FN(hsum)(acc[r]) + mins[r];
}

/* The same for signed 8-bit weights (d * q): u8*s8 instructions take |q_w| and q_x with q_w's sign. */
static inline __attribute__((always_inline)) void FN(q8_rows)(
        const int8_t *xq, const float *xd, int64_t G, const int8_t *qs, const float *wd, float *out, const int R) {
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + g * GROUP));
        for (int r = 0; r < R; r++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(qs + r * G * GROUP + g * GROUP));
            __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)));
            acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd[r * G + g] * xd[g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = FN(hsum)(acc[r]);
}

static void FN(gemm)(const struct qmm *a) {
    const int64_t G = a->K / GROUP, tiles = (a->N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(a->threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * TILE, rows = a->N - n0 < TILE ? a->N - n0 : TILE;
        float out[TILE];
        for (int64_t m = 0; m < a->M; m++) {
            const int8_t *xq = a->xq + m * a->K;
            const float *xd = a->xd + m * G, *xs = a->xs + m * G;
            if (a->bits == 4) {
                const uint8_t *qs = (const uint8_t *)a->qs + n0 * G * (GROUP / 2);
                if (rows == TILE)
                    FN(q4_rows)(xq, xd, xs, G, qs, a->wd + n0 * G, a->wm + n0 * G, out, TILE);
                else
                    for (int64_t r = 0; r < rows; r++)
                        FN(q4_rows)(xq, xd, xs, G, qs + r * G * (GROUP / 2), a->wd + (n0 + r) * G,
                                    a->wm + (n0 + r) * G, out + r, 1);
            } else {
                const int8_t *qs = (const int8_t *)a->qs + n0 * G * GROUP;
                if (rows == TILE)
                    FN(q8_rows)(xq, xd, G, qs, a->wd + n0 * G, out, TILE);
                else
                    for (int64_t r = 0; r < rows; r++)
                        FN(q8_rows)(xq, xd, G, qs + r * G * GROUP, a->wd + (n0 + r) * G, out + r, 1);
            }
            store_row(a, m, n0, rows, out);
        }
    }
}

static void FN(quantize)(const struct qmm *a) {
    const int64_t G = a->K / GROUP;
#pragma omp parallel for num_threads(a->M * a->K >= PARALLEL_QUANTIZE ? a->threads : 1) schedule(static)
    for (int64_t m = 0; m < a->M; m++) {
        const void *row = a->x_bf16 ? (const void *)((const uint16_t *)a->x + m * a->K)
                                    : (const void *)((const float *)a->x + m * a->K);
        FN(quantize_row)(row, a->x_bf16, a->K, a->xq + m * a->K, a->xd + m * G, a->xs + m * G);
    }
}

#undef FN
#undef CAT
#undef CAT_
