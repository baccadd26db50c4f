/* The products of one weight row with up to XROWS activation rows: part of blocks_simd.h, included
 * there once per instruction set.
 *
 * A row goes by batches of 256 elements (8 blocks of 32, or one super-block). Per batch, the weight's
 * scales times each activation row's are stored to s[] and read back by broadcast loads, which take
 * no arithmetic port, and the offset and minimum terms are added as vectors; then each group's codes
 * are unpacked once for all the rows, and each (group, row) costs three instructions: the byte
 * products (dpbusd), their conversion to float, and a multiply-add by the scale. The AVX-512 variant
 * takes two groups a 512-bit vector, its activations stored with the groups' 4-byte runs interleaved
 * so that the scales of a lane pair (or quad, per half) come from one broadcast. Each row's groups
 * alternate between two sums: a sum is a chain of multiply-adds, 4 cycles each. The last K % 256
 * elements of a 32-element format go a block at a time. */

/* The int32 sums of 4 byte products of a group's codes q and activations x (unsigned codes, signed
 * ones, or signed codes against activations biased by 128: less 128 times the codes' sum). */
static inline __m256i FN(products)(__m256i q, __m256i x, int signed_q, int biased) {
    const __m256i zero = _mm256_setzero_si256();
    if (biased) return _mm256_sub_epi32(DOT_ACC(zero, x, q), DOT_ACC(zero, _mm256_set1_epi8((char)0x80), q));
    return signed_q ? DOT_SIGNED(zero, q, x) : DOT_ACC(zero, q, x);
}

/* Batch t's scales for rows m .. m + R: s[r] = the weight's scales times row r's activation scales,
 * per group (8) or per half (16), in order; low[r] += its offset and minimum terms (8 lanes, summed
 * at the end). */
static inline __attribute__((always_inline)) void FN(batch_scales)(const struct bmm *a, int format, const uint8_t *b,
                                                                   int64_t m, int R, int64_t t, float (*s)[16],
                                                                   __m256 *low) {
    const int64_t G = a->K / GROUP;
    const int halves = scaled_per_half(format), low_term = !signed_codes(format);
    __m256 sc[2], lo[2];
    if (block_elements(format) == GROUP) FN(scales8)(format, b, &sc[0], &lo[0]);
    else FN(k_scales)(format, b, sc, lo);
    for (int r = 0; r < R; r++) {
        const int64_t g = (m + r) * G + 8 * t;
        const __m256 dx = _mm256_loadu_ps(a->xd + g);
        if (halves) { /* per half: its group's activation scale, and its integer sum */
            const __m256 first = _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
            const __m256 last = _mm256_permutevar8x32_ps(dx, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
            _mm256_storeu_ps(s[r], _mm256_mul_ps(sc[0], first));
            _mm256_storeu_ps(s[r] + 8, _mm256_mul_ps(sc[1], last));
            low[r] = _mm256_fmadd_ps(_mm256_mul_ps(lo[0], first), _mm256_loadu_ps(a->xh + 2 * g), low[r]);
            low[r] = _mm256_fmadd_ps(_mm256_mul_ps(lo[1], last), _mm256_loadu_ps(a->xh + 2 * g + 8), low[r]);
        } else {
            _mm256_storeu_ps(s[r], _mm256_mul_ps(sc[0], dx));
            if (low_term) low[r] = _mm256_fmadd_ps(lo[0], _mm256_loadu_ps(a->xs + g), low[r]);
        }
    }
}

/* The blocks of a 32-element format after its whole batches, one at a time, added to out[R]. */
static inline __attribute__((always_inline)) void FN(tail)(const struct bmm *a, int format, const uint8_t *w,
                                                           int64_t m, int R, float *out) {
    const int64_t G = a->K / GROUP, bytes = block_bytes(format);
    const int min = has_minimum(format), sq = signed_codes(format);
    __m256 acc[XROWS];
    float low[XROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), low[r] = 0.0f;
    for (int64_t g = G / 8 * 8; g < G; g++) {
        const uint8_t *b = w + g * bytes;
        const float d = FN(h2f)(b), wl = min ? FN(h2f)(b + 2) : -(float)code_offset(format) * d;
        const __m256i q = FN(codes32)(format, b);
        for (int r = 0; r < R; r++) {
            const int64_t i = (m + r) * G + g;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + i * GROUP));
            const __m256i p = FN(products)(q, x, sq, X_BIASED(format));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * a->xd[i]), acc[r]);
            if (!sq) low[r] += wl * a->xs[i];
        }
    }
    for (int r = 0; r < R; r++) out[r] += FN(hsum)(acc[r]) + low[r];
}

/* A group's codes in this variant's order for `format`'s activations (as x_layout stores them). */
static inline __m256i FN(group_codes)(int format, const uint8_t *b, int i) {
    return block_elements(format) == GROUP ? FN(codes32)(format, b + i * block_bytes(format))
                                           : FN(k_codes)(format, b, i);
}

#if AVX512

static inline float FN(hsum512)(__m512 v) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return FN(hsum)(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}

/* y[m .. m + R) at one weight row, into out[R]. */
static inline __attribute__((always_inline)) void FN(dot)(const struct bmm *a, int format, const uint8_t *w,
                                                          int64_t m, int R, float *out) {
    const int64_t G = a->K / GROUP;
    const int halves = scaled_per_half(format), sq = signed_codes(format);
    const int64_t step = (block_elements(format) == GROUP ? 8 : 1) * block_bytes(format);
    __m512 acc[2][XROWS];
    float s[XROWS][16];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < G / 8; t++) {
        const uint8_t *b = w + t * step;
        if (m == 0) /* the bytes PREFETCH ahead, on the first pass over the row (the next rows follow it) */
            for (int64_t line = 0; line < step; line += 64) _mm_prefetch((const char *)b + PREFETCH + line, _MM_HINT_T0);
        __m256 low[XROWS]; /* added to the sums at once: 8 more live registers would spill them */
        for (int r = 0; r < R; r++) low[r] = _mm256_setzero_ps();
        FN(batch_scales)(a, format, b, m, R, t, s, low);
        for (int r = 0; r < R; r++) acc[0][r] = _mm512_add_ps(acc[0][r], _mm512_zextps256_ps512(low[r]));
        /* an opaque base: GCC otherwise keeps each scale's address in a register, and spills them */
        const float *sp = s[0];
        __asm__("" : "+r"(sp) : : "memory");
#pragma GCC unroll 4 /* constant indices keep the sums in registers */
        for (int p = 0; p < 4; p++) {
            const __m512i q =
                FN(pair)(FN(group_codes)(format, b, 2 * p), FN(group_codes)(format, b, 2 * p + 1), halves);
            /* signed codes meet activations biased by 128: start from -128 times the codes' sums */
            const __m512i start = sq ? _mm512_sub_epi32(_mm512_setzero_si512(),
                                                        _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                                            _mm512_set1_epi8((char)0x80), q))
                                     : _mm512_setzero_si512();
            for (int r = 0; r < R; r++) {
                const __m512i x = _mm512_loadu_si512(a->xq + ((m + r) * G + 8 * t + 2 * p) * GROUP);
                const __m512i d = sq ? _mm512_dpbusd_epi32(start, x, q) : _mm512_dpbusd_epi32(start, q, x);
                double two; /* group 2p's and 2p + 1's scales, side by side */
                memcpy(&two, sp + 16 * r + 2 * p, 8);
                const __m512 scale = halves ? _mm512_broadcast_f32x4(_mm_loadu_ps(sp + 16 * r + 4 * p))
                                            : _mm512_castpd_ps(_mm512_set1_pd(two));
                acc[p % 2][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[p % 2][r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = FN(hsum512)(_mm512_add_ps(acc[0][r], acc[1][r]));
    if (G % 8) FN(tail)(a, format, w, m, R, out);
}

#else

/* y[m .. m + R) at one weight row, into out[R]. */
static inline __attribute__((always_inline)) void FN(dot)(const struct bmm *a, int format, const uint8_t *w,
                                                          int64_t m, int R, float *out) {
    const int64_t G = a->K / GROUP;
    const int halves = scaled_per_half(format), sq = signed_codes(format);
    const int64_t step = (block_elements(format) == GROUP ? 8 : 1) * block_bytes(format);
    __m256 acc[2][XROWS];
    float s[XROWS][16];
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    for (int64_t t = 0; t < G / 8; t++) {
        const uint8_t *b = w + t * step;
        if (m == 0) /* the bytes PREFETCH ahead, on the first pass over the row (the next rows follow it) */
            for (int64_t line = 0; line < step; line += 64) _mm_prefetch((const char *)b + PREFETCH + line, _MM_HINT_T0);
        FN(batch_scales)(a, format, b, m, R, t, s, acc[0]);
        /* an opaque base: GCC otherwise keeps each scale's address in a register, and spills them */
        const float *sp = s[0];
        __asm__("" : "+r"(sp) : : "memory");
#pragma GCC unroll 8 /* constant indices keep the sums in registers */
        for (int i = 0; i < 8; i++) {
            __m256i q = FN(group_codes)(format, b, i);
            if (halves) /* the halves' 4-byte runs interleaved, as the activations are: lanes alternate halves */
                q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            for (int r = 0; r < R; r++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a->xq + ((m + r) * G + 8 * t + i) * GROUP));
                double two; /* group i's halves' scales, side by side */
                memcpy(&two, sp + 16 * r + 2 * i, 8);
                const __m256 scale = halves ? _mm256_castpd_ps(_mm256_set1_pd(two)) : _mm256_broadcast_ss(sp + 16 * r + i);
                acc[i % 2][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(FN(products)(q, x, sq, 0)), scale, acc[i % 2][r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = FN(hsum)(_mm256_add_ps(acc[0][r], acc[1][r]));
    if (G % 8) FN(tail)(a, format, w, m, R, out);
}

#endif
