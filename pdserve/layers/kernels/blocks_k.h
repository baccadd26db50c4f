/* The 256-element formats (Q2_K..Q6_K, IQ4_XS) in SIMD: part of blocks_simd.h, included there once
 * per instruction set. A super-block is 8 groups of 32 elements; its scales are per group (Q4_K,
 * Q5_K, IQ4_XS) or per half group (Q2_K, Q3_K, Q6_K), and the activations' are per group, so each
 * group's int32 lanes are scaled by their product (blocks_dot.h lays the lanes out for that). */

/* Group i's 32 unsigned codes in element order (the true codes plus code_offset; IQ4_XS's signed
 * values). The shifts are of 16-bit words, and each mask keeps only bits that stayed in their byte. */
static inline __m256i FN(k_codes)(int format, const uint8_t *b, int i) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    switch (format) {
    case GGML_Q4_K: case GGML_Q5_K: { /* d dmin scales[12] [qh[32]] qs[128] */
        const int five = format == GGML_Q5_K;
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * five + 32 * (i / 2)));
        const __m256i low = _mm256_and_si256(i % 2 ? _mm256_srli_epi16(qs, 4) : qs, m15);
        if (!five) return low;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16)); /* bit i of each byte: 0x10 */
        const __m256i high = i < 4 ? _mm256_slli_epi16(qh, 4 - i) : _mm256_srli_epi16(qh, i - 4);
        return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x10)));
    }
    case GGML_Q6_K: { /* ql[128] qh[64] scales[16] d; per half: low nibbles of ql 0-63, then high */
        const int h = i / 4, s = i % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s % 2)));
        const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), m15);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)); /* bits 2s, 2s + 1: 0x30 */
        const __m256i high = s < 2 ? _mm256_slli_epi16(qh, 4 - 2 * s) : s == 2 ? qh : _mm256_srli_epi16(qh, 2);
        return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    }
    case GGML_Q2_K: case GGML_Q3_K: { /* 2 bits a code: group i at bits 2 (i % 4) of 32 bytes */
        const int s = i % 4;
        const __m256i qs = _mm256_loadu_si256((const __m256i *)(b + (format == GGML_Q3_K ? 32 : 16) + 32 * (i / 4)));
        const __m256i low = _mm256_and_si256(s ? _mm256_srli_epi16(qs, 2 * s) : qs, m3);
        if (format == GGML_Q2_K) return low;
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b); /* hmask bit i: 4 */
        const __m256i high = i < 2 ? _mm256_slli_epi16(hm, 2 - i) : i == 2 ? hm : _mm256_srli_epi16(hm, i - 2);
        return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(4)));
    }
    default: /* IQ4_XS: d scales_h scales_l[4] qs[128] */
        return _mm256_shuffle_epi8(FN(iq4_table)(), FN(nibbles)(b + 8 + 16 * i));
    }
}

static inline __m256 FN(u8_floats)(uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)bytes)));
}

/* A super-block's scales as floats. Per group (Q4_K, Q5_K, IQ4_XS): sc[0] lane i = d * group i's
 * scale, lo[0] lane i the coefficient of the activations' d * sum (-dmin * min). Per half (Q2_K,
 * Q3_K, Q6_K): sc[0], sc[1] lanes j = d * half j's (j + 8's) scale, lo[] the coefficient of the
 * half's integer sum: -dmin * min, or the code offset times -(d * scale). */
static inline void FN(k_scales)(int format, const uint8_t *b, __m256 *sc, __m256 *lo) {
    switch (format) {
    case GGML_Q4_K: case GGML_Q5_K: {
        uint8_t su[8], mu[8];
        uint64_t scales, mn;
        k4_scales(b + 4, su, mu);
        memcpy(&scales, su, 8), memcpy(&mn, mu, 8);
        sc[0] = _mm256_mul_ps(FN(u8_floats)(scales), _mm256_set1_ps(FN(h2f)(b)));
        lo[0] = _mm256_mul_ps(FN(u8_floats)(mn), _mm256_set1_ps(-FN(h2f)(b + 2)));
        return;
    }
    case GGML_IQ4_XS: { /* 4 low bits two a byte at b + 4, 2 high bits in the word at b + 2; biased by 32 */
        uint32_t low, high = (uint32_t)b[2] | (uint32_t)b[3] << 8;
        memcpy(&low, b + 4, 4);
        const __m256i l = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int32_t)low),
                                                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                           _mm256_set1_epi32(15));
        const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int32_t)high),
                                                             _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                           _mm256_set1_epi32(3));
        const __m256i v = _mm256_sub_epi32(_mm256_or_si256(l, _mm256_slli_epi32(h, 4)), _mm256_set1_epi32(32));
        sc[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(FN(h2f)(b)));
        return;
    }
    case GGML_Q2_K: { /* scales[16]: low nibble the scale, high the minimum */
        const __m128i v = _mm_loadu_si128((const __m128i *)b), m15 = _mm_set1_epi8(15);
        const __m128i scales = _mm_and_si128(v, m15), mins = _mm_and_si128(_mm_srli_epi16(v, 4), m15);
        const __m256 d = _mm256_set1_ps(FN(h2f)(b + 80)), dmin = _mm256_set1_ps(-FN(h2f)(b + 82));
        sc[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scales)), d);
        sc[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scales, 8))), d);
        lo[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)), dmin);
        lo[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))), dmin);
        return;
    }
    default: { /* Q3_K, Q6_K: 16 signed scales, codes offset by 4 or 32 */
        const int q6 = format == GGML_Q6_K;
        __m128i v;
        if (q6) {
            v = _mm_loadu_si128((const __m128i *)(b + 192));
        } else { /* q3_scales in vectors: the low nibbles of bytes 0-7, then 2 bits of byte 8 + i % 4 */
            uint64_t low;
            uint32_t high;
            memcpy(&low, b + 96, 8), memcpy(&high, b + 104, 4);
            const __m128i l = _mm_cvtsi64_si128((int64_t)low), m15 = _mm_set1_epi8(15);
            const __m128i nibbles = _mm_unpacklo_epi64(_mm_and_si128(l, m15), _mm_and_si128(_mm_srli_epi16(l, 4), m15));
            const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int32_t)high), _mm_setr_epi32(0, 2, 4, 6)),
                                              _mm_set1_epi8(3));
            v = _mm_sub_epi8(_mm_or_si128(nibbles, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
        }
        const __m256 d = _mm256_set1_ps(FN(h2f)(b + (q6 ? 208 : 108)));
        sc[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
        sc[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), d);
        lo[0] = _mm256_mul_ps(sc[0], _mm256_set1_ps(-(float)code_offset(format)));
        lo[1] = _mm256_mul_ps(sc[1], _mm256_set1_ps(-(float)code_offset(format)));
    }
    }
}
