/* 4- and 8-bit products with output columns in the lanes, for batches of rows: included by qmatmul.c once
 * per instruction set after qmatmul_simd.h (KSUF, DOT_ACC and WIDE as there).
 *
 * qmatmul_simd.h puts a row's K values in the lanes: each group of 32 ends in a sum across lanes,
 * scaled by its own pair of scales, and each pass over the weights unpacks them for two rows. Here
 * a vector holds output columns of a panel of 16 weight rows (all 16 in a 512-bit vector, 8 in each
 * half of a 256-bit pass), so one group's scaling serves all of them, and a group's unpacked
 * weights serve a block of activation rows held in registers. The weights are repacked once, at
 * load (`pd_panel_pack`; 8-bit weights as described there):
 *   panel p, group g: 4 blocks of 16 lanes x 4 bytes; block i, lane l, byte b holds weight row
 *   16 p + l's element g * 32 + 8 i + b in its low nibble and g * 32 + 8 i + 4 + b in its high one;
 *   scales and minimums in float16 as the weight stores them, [panel, group, 16] (widened in registers).
 * The byte products of the low (or high) nibbles with 4 activation bytes broadcast add each
 * column's sum of 4 products (a dpbusd with VNNI; with AVX2 maddubs pairs summed in 16 bits, at
 * most 8 * 2 * 15 * 127 = 30480, then one madd). Activations are quantized as for qmatmul_simd.h
 * (groups of 32, natural order), so the result is the same integer sums in another order. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, KSUF)

/* Groups ahead of the one multiplied that each pass fetches into L1: at one or two rows a product
 * streams its weight from memory, and the hardware's prefetchers alone leave its start to misses
 * (a decode step of the default model: 30 layers x 4 weights of 0.2-1.1 MB). */
#define PANEL_AHEAD 4
#if WIDE
#define PANEL_ROWS 8 /* activation rows a group's unpacked weights serve */

/* The 16 lanes of v as bfloat16 (round to nearest even, NaN kept a NaN) or float32, into y. */
static inline void FN(panel_store)(void *y, int64_t offset, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)y + offset, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                      _mm512_and_si512(high, _mm512_set1_epi32(1))), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + offset), _mm512_cvtepi32_epi16(bits));
}

/* y[m0 .. m0 + rows, 16 p .. 16 p + 16) for rows <= PANEL_ROWS. */
static inline __attribute__((always_inline)) void FN(panel_block)(const struct qmm *a, const uint8_t *packed,
                                                                  const uint16_t *pd, const uint16_t *pm, int64_t p,
                                                                  int64_t m0, int rows) {
    const int64_t G = a->K / GROUP;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[PANEL_ROWS];
    for (int r = 0; r < PANEL_ROWS; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *w = packed + p * G * PANEL_GROUP_BYTES;
    const uint16_t *wd = pd + p * G * PANEL, *wm = pm + p * G * PANEL;
    for (int64_t g = 0; g < G; g++, w += PANEL_GROUP_BYTES) {
        for (int i = 0; i < 4; i++) _mm_prefetch((const char *)w + PANEL_AHEAD * PANEL_GROUP_BYTES + i * 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(wd + (g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(wm + (g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
        __m512i q[8];
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512(w + i * 64);
            q[2 * i] = _mm512_and_si512(v, low4);
            q[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wd + g * PANEL)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wm + g * PANEL)));
        for (int r = 0; r < PANEL_ROWS; r++) {
            if (r >= rows) break;
            const int64_t m = m0 + r;
            const int32_t *x = (const int32_t *)(a->xq + m * a->K + g * GROUP);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_set1_epi32(x[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], _mm512_set1_epi32(x[1]));
            s0 = _mm512_dpbusd_epi32(s0, q[2], _mm512_set1_epi32(x[2]));
            s1 = _mm512_dpbusd_epi32(s1, q[3], _mm512_set1_epi32(x[3]));
            s0 = _mm512_dpbusd_epi32(s0, q[4], _mm512_set1_epi32(x[4]));
            s1 = _mm512_dpbusd_epi32(s1, q[5], _mm512_set1_epi32(x[5]));
            s0 = _mm512_dpbusd_epi32(s0, q[6], _mm512_set1_epi32(x[6]));
            s1 = _mm512_dpbusd_epi32(s1, q[7], _mm512_set1_epi32(x[7]));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->xd[m * G + g])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->xs[m * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) FN(panel_store)(a->y, (m0 + r) * a->N + p * PANEL, acc[r], a->x_bf16);
}

/* 8-bit weights: the activations biased to unsigned bytes (x + 128) against the signed weights;
 * each column's group sum starts at its correction, -128 times the sum of its weights (pc holds
 * minus that sum, at most 32 x 127 in magnitude). */
static inline __attribute__((always_inline)) void FN(panel8_block)(const struct qmm *a, const int8_t *packed,
                                                                   const uint16_t *pd, const int16_t *pc, int64_t p,
                                                                   int64_t m0, int rows) {
    const int64_t G = a->K / GROUP;
    __m512 acc[PANEL_ROWS];
    for (int r = 0; r < PANEL_ROWS; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *w = packed + p * G * PANEL8_GROUP_BYTES;
    for (int64_t g = 0; g < G; g++, w += PANEL8_GROUP_BYTES) {
        for (int i = 0; i < 8; i++) _mm_prefetch((const char *)w + PANEL_AHEAD * PANEL8_GROUP_BYTES + i * 64, _MM_HINT_T0);
        _mm_prefetch((const char *)(pd + (p * G + g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
        _mm_prefetch((const char *)(pc + (p * G + g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
        __m512i q[8];
        for (int i = 0; i < 8; i++) q[i] = _mm512_loadu_si512(w + i * 64);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pd + (p * G + g) * PANEL)));
        const __m512i c = _mm512_slli_epi32(
            _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(pc + (p * G + g) * PANEL))), 7);
        for (int r = 0; r < PANEL_ROWS; r++) {
            if (r >= rows) break;
            const int64_t m = m0 + r;
            const int32_t *x = (const int32_t *)(a->xq + m * a->K + g * GROUP);
            __m512i s0 = _mm512_dpbusd_epi32(c, _mm512_set1_epi32(x[0]), q[0]);
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(x[1]), q[1]);
            s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x[2]), q[2]);
            s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x[3]), q[3]);
            s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x[4]), q[4]);
            s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x[5]), q[5]);
            s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x[6]), q[6]);
            s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x[7]), q[7]);
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->xd[m * G + g])), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) FN(panel_store)(a->y, (m0 + r) * a->N + p * PANEL, acc[r], a->x_bf16);
}
#define PANEL8 1 /* this variant has 8-bit panels */
#else
#define PANEL_ROWS 4 /* 16 vector registers: 8 unpacked weights, 4 rows' sums and the scales */

/* The 8 lanes of v as bfloat16 (as above) or float32, into y. */
static inline void FN(panel_store)(void *y, int64_t offset, __m256 v, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)y + offset, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
    __m256i bits = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                                      _mm256_and_si256(high, _mm256_set1_epi32(1))), 16);
    bits = _mm256_blendv_epi8(bits, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                              _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* pack within 128-bit lanes, then the two lanes' low halves side by side */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + offset), _mm256_castsi256_si128(packed));
}

/* y[m0 .. m0 + rows, 16 p + 8 half .. + 8) for rows <= PANEL_ROWS: columns of one half a pass. */
static inline __attribute__((always_inline)) void FN(panel_block)(const struct qmm *a, const uint8_t *packed,
                                                                  const uint16_t *pd, const uint16_t *pm, int64_t p,
                                                                  int64_t m0, int rows) {
    const int64_t G = a->K / GROUP;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) {
        __m256 acc[PANEL_ROWS];
        for (int r = 0; r < PANEL_ROWS; r++) acc[r] = _mm256_setzero_ps();
        const uint8_t *w = packed + p * G * PANEL_GROUP_BYTES + half * 32;
        const uint16_t *wd = pd + p * G * PANEL + half * 8, *wm = pm + p * G * PANEL + half * 8;
        for (int64_t g = 0; g < G; g++, w += PANEL_GROUP_BYTES) {
            if (!half) { /* the second half's pass finds the lines in cache */
                for (int i = 0; i < 4; i++)
                    _mm_prefetch((const char *)w + PANEL_AHEAD * PANEL_GROUP_BYTES + i * 64, _MM_HINT_T0);
                _mm_prefetch((const char *)(wd + (g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
                _mm_prefetch((const char *)(wm + (g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
            }
            __m256i q[8];
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + i * 64));
                q[2 * i] = _mm256_and_si256(v, low4);
                q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + g * PANEL)));
            const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + g * PANEL)));
            for (int r = 0; r < PANEL_ROWS; r++) {
                if (r >= rows) break;
                const int64_t m = m0 + r;
                const int32_t *x = (const int32_t *)(a->xq + m * a->K + g * GROUP);
                __m256i sum;
#ifdef PANEL_DPBUSD
                sum = PANEL_DPBUSD(_mm256_setzero_si256(), q[0], _mm256_set1_epi32(x[0]));
                for (int j = 1; j < 8; j++) sum = PANEL_DPBUSD(sum, q[j], _mm256_set1_epi32(x[j]));
#else
                __m256i s16 = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(x[0]));
                for (int j = 1; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q[j], _mm256_set1_epi32(x[j])));
                sum = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
                const __m256 dot = _mm256_cvtepi32_ps(sum);
                acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(a->xd[m * G + g])), acc[r]);
                acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->xs[m * G + g]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            FN(panel_store)(a->y, (m0 + r) * a->N + p * PANEL + half * 8, acc[r], a->x_bf16);
    }
}
#ifdef PANEL_DPBUSD
/* 8-bit weights, as above, one half of the panel's columns a pass. */
static inline __attribute__((always_inline)) void FN(panel8_block)(const struct qmm *a, const int8_t *packed,
                                                                   const uint16_t *pd, const int16_t *pc, int64_t p,
                                                                   int64_t m0, int rows) {
    const int64_t G = a->K / GROUP;
    for (int half = 0; half < 2; half++) {
        __m256 acc[PANEL_ROWS];
        for (int r = 0; r < PANEL_ROWS; r++) acc[r] = _mm256_setzero_ps();
        const int8_t *w = packed + p * G * PANEL8_GROUP_BYTES + half * 32;
        for (int64_t g = 0; g < G; g++, w += PANEL8_GROUP_BYTES) {
            if (!half) {
                for (int i = 0; i < 8; i++)
                    _mm_prefetch((const char *)w + PANEL_AHEAD * PANEL8_GROUP_BYTES + i * 64, _MM_HINT_T0);
                _mm_prefetch((const char *)(pd + (p * G + g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
                _mm_prefetch((const char *)(pc + (p * G + g + PANEL_AHEAD) * PANEL), _MM_HINT_T0);
            }
            __m256i q[8];
            for (int i = 0; i < 8; i++) q[i] = _mm256_loadu_si256((const __m256i *)(w + i * 64));
            const uint16_t *at = pd + (p * G + g) * PANEL + half * 8;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
            const __m256i c = _mm256_slli_epi32(
                _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(pc + (p * G + g) * PANEL + half * 8))), 7);
            for (int r = 0; r < PANEL_ROWS; r++) {
                if (r >= rows) break;
                const int64_t m = m0 + r;
                const int32_t *x = (const int32_t *)(a->xq + m * a->K + g * GROUP);
                __m256i sum = c;
                for (int j = 0; j < 8; j++) sum = PANEL_DPBUSD(sum, _mm256_set1_epi32(x[j]), q[j]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(a->xd[m * G + g])),
                                         acc[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            FN(panel_store)(a->y, (m0 + r) * a->N + p * PANEL + half * 8, acc[r], a->x_bf16);
    }
}
#define PANEL8 1
#endif
#endif

/* Each thread takes a range of panels and runs every block of rows over them: its panels' weights
 * stay in its own cache while the activations stream. pm: the 4-bit minimums (float16) or the 8-bit
 * corrections (int16). */
static void FN(panel_gemm)(const struct qmm *a, const void *packed, const uint16_t *pd, const void *pm) {
    const int64_t panels = a->N / PANEL;
#pragma omp parallel num_threads(a->threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        for (int64_t m0 = 0; m0 < a->M; m0 += PANEL_ROWS) {
            const int rows = a->M - m0 < PANEL_ROWS ? (int)(a->M - m0) : PANEL_ROWS;
            for (int64_t p = p0; p < p1; p++) {
#ifdef PANEL8
                if (a->bits == 8) {
                    if (rows == PANEL_ROWS) FN(panel8_block)(a, packed, pd, pm, p, m0, PANEL_ROWS);
                    else FN(panel8_block)(a, packed, pd, pm, p, m0, rows);
                    continue;
                }
#endif
                if (rows == PANEL_ROWS) FN(panel_block)(a, packed, pd, pm, p, m0, PANEL_ROWS);
                else FN(panel_block)(a, packed, pd, pm, p, m0, rows);
            }
        }
    }
}

/* A batch's activations quantized in natural order (the panel kernel's), a row per task; for 8-bit
 * weights biased to unsigned bytes (x + 128: the sign bit flipped). */
static void FN(panel_quantize)(const struct qmm *a) {
    const int64_t G = a->K / GROUP;
#pragma omp parallel for num_threads(a->M * a->K >= PARALLEL_QUANTIZE ? a->threads : 1) schedule(static)
    for (int64_t m = 0; m < a->M; m++) {
        const void *row = a->x_bf16 ? (const void *)((const uint16_t *)a->x + m * a->K)
                                    : (const void *)((const float *)a->x + m * a->K);
        int8_t *q = a->xq + m * a->K;
        FN(quantize_row)(row, a->x_bf16, a->K, 0, q, a->xd + m * G, a->xs + m * G);
        if (a->bits == 8)
            for (int64_t k = 0; k < a->K; k++) q[k] = (int8_t)((uint8_t)q[k] ^ 0x80);
    }
}

#undef PANEL_ROWS
#undef PANEL_AHEAD
#ifdef PANEL8
#undef PANEL8
#endif
#undef FN
#undef CAT
#undef CAT_
