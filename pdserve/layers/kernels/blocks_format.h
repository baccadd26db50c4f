/* GGUF's block formats (ggml's layouts, byte for byte), told in scalar C: each block's size, its
 * scales per 16 elements and its integer codes. blocks.c's portable kernels decode with these, its
 * SIMD ones decode the same bytes in vectors (blocks_simd.h, blocks_k.h), and the tests hold both to
 * gguf's own Python dequantization (gguf/quants.py).
 *
 * Every format's value is ds * q + dm per 16 elements, q a small integer: its code less an offset
 * (Q4_0's 8, Q5_0's 16, Q3_K's 4, Q6_K's 32), or a table's value (IQ4), with dm a minimum where the
 * format has one (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) and ds a float16 scale, times a sub-scale of at most
 * 8 bits in the K formats and IQ4_XS. Each product in there is exact in float32 (11 + 8 + 8 bits at
 * most), so the one rounding is the minimum's add, as in the reference. */
#ifndef PDSERVE_KERNELS_BLOCKS_FORMAT_H
#define PDSERVE_KERNELS_BLOCKS_FORMAT_H

#include "common.h"

#define GROUP 32  /* elements of a block, or of a super-block's sub-block, and of an activation group */
#define SUPER 256 /* elements of a super-block (the K formats, IQ4_XS) */

enum { /* ggml's type ids (gguf.GGMLQuantizationType) */
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q2_K = 10,
    GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_IQ4_NL = 20, GGML_IQ4_XS = 23,
};

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Bytes a block of `format` takes; 0 for formats this family does not serve. */
static inline int block_bytes(int format) {
    switch (format) {
    case GGML_Q4_0: case GGML_IQ4_NL: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q2_K: return 84;
    case GGML_Q3_K: return 110;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    case GGML_IQ4_XS: return 136;
    default: return 0;
    }
}

static inline int block_elements(int format) {
    return (format >= GGML_Q2_K && format <= GGML_Q6_K) || format == GGML_IQ4_XS ? SUPER : GROUP;
}

/* What a format's unsigned codes are above its true ones (the value is d * (code - offset)). */
static inline int code_offset(int format) {
    switch (format) {
    case GGML_Q4_0: return 8;
    case GGML_Q5_0: return 16;
    case GGML_Q6_K: return 32;
    case GGML_Q3_K: return 4;
    default: return 0;
    }
}

/* Whether a format's codes are signed bytes (Q8_0's, the IQ4 table's). */
static inline int signed_codes(int format) {
    return format == GGML_Q8_0 || format == GGML_IQ4_NL || format == GGML_IQ4_XS;
}

/* Whether a format's values have a minimum of their own (d * q + m), rather than an offset. */
static inline int has_minimum(int format) {
    return format == GGML_Q4_1 || format == GGML_Q5_1 || format == GGML_Q2_K || format == GGML_Q4_K ||
           format == GGML_Q5_K;
}

/* Whether a format's scales are per 16 elements, half a group of activations. */
static inline int scaled_per_half(int format) {
    return format == GGML_Q2_K || format == GGML_Q3_K || format == GGML_Q6_K;
}

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline uint32_t word_at(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

/* Q4_K's and Q5_K's 12 bytes of 6-bit sub-scales and minimums: sc[8], mn[8]. Bytes 0-3 hold
 * scales 0-3 in their low 6 bits, 4-7 minimums 0-3; bytes 8-11 hold the low 4 bits of scales 4-7
 * and (high nibble) minimums 4-7, whose top 2 bits are the top bits of bytes 0-3 and 4-7. */
static inline void k4_scales(const uint8_t *p, uint8_t *sc, uint8_t *mn) {
    const uint32_t a = word_at(p), b = word_at(p + 4), c = word_at(p + 8);
    const uint32_t s[2] = {a & 0x3f3f3f3f, (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030)};
    const uint32_t m[2] = {b & 0x3f3f3f3f, ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030)};
    memcpy(sc, s, 8);
    memcpy(mn, m, 8);
}

/* Q3_K's 16 signed 6-bit scales from 12 bytes: low nibbles in bytes 0-7 (scales 0-7 low, 8-15
 * high), the top 2 bits in bytes 8-11, one 2-bit field per scale (scale 4k + j at bits 2k of byte
 * 8 + j); stored biased by 32. */
static inline void q3_scale_words(const uint8_t *p, uint32_t *biased) {
    const uint32_t a = word_at(p), b = word_at(p + 4), c = word_at(p + 8);
    biased[0] = (a & 0x0f0f0f0f) | ((c & 0x03030303) << 4);
    biased[1] = (b & 0x0f0f0f0f) | (((c >> 2) & 0x03030303) << 4);
    biased[2] = ((a >> 4) & 0x0f0f0f0f) | (((c >> 4) & 0x03030303) << 4);
    biased[3] = ((b >> 4) & 0x0f0f0f0f) | (((c >> 6) & 0x03030303) << 4);
}

static inline void q3_scales(const uint8_t *p, int8_t *sc) {
    uint32_t biased[4];
    q3_scale_words(p, biased);
    memcpy(sc, biased, 16);
    for (int i = 0; i < 16; i++) sc[i] = (int8_t)(sc[i] - 32);
}

/* IQ4_XS's 8 signed 6-bit scales: low nibbles two a byte in bytes 2-5, high 2 bits in the 16-bit
 * word at bytes 0-1; biased by 32. p points past the block's d. */
static inline void iq4xs_scales(const uint8_t *p, int8_t *sc) {
    const uint32_t high = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    for (int i = 0; i < 8; i++)
        sc[i] = (int8_t)((((p[2 + i / 2] >> 4 * (i % 2)) & 15) | (((high >> 2 * i) & 3) << 4)) - 32);
}

/* A block's scales per 16 elements: its value e is ds[e / 16] * q[e] + dm[e / 16], q its true
 * integer code (decode_block). Returns whether the format has a minimum (dm); without one dm is 0
 * and is not added, so a product that is -0 in the reference stays -0. */
static int block_scales(int format, const uint8_t *b, float *ds, float *dm) {
    int8_t sc[16];
    uint8_t su[8], mu[8];
    const int min = has_minimum(format);
    for (int j = 0; j < 16; j++) dm[j] = 0.0f;
    switch (format) {
    case GGML_Q2_K: /* scales[16] qs[64] d dmin */
        for (int j = 0; j < 16; j++) {
            ds[j] = half_at(b + 80) * (float)(b[j] & 15);
            dm[j] = -(half_at(b + 82) * (float)(b[j] >> 4));
        }
        break;
    case GGML_Q3_K: /* hmask[32] qs[64] scales[12] d */
        q3_scales(b + 96, sc);
        for (int j = 0; j < 16; j++) ds[j] = half_at(b + 108) * (float)sc[j];
        break;
    case GGML_Q4_K: case GGML_Q5_K: /* d dmin scales[12] ... */
        k4_scales(b + 4, su, mu);
        for (int j = 0; j < 16; j++) {
            ds[j] = half_at(b) * (float)su[j / 2];
            dm[j] = -(half_at(b + 2) * (float)mu[j / 2]);
        }
        break;
    case GGML_Q6_K: /* ql[128] qh[64] scales[16] d */
        for (int j = 0; j < 16; j++) ds[j] = half_at(b + 208) * (float)(int8_t)b[192 + j];
        break;
    case GGML_IQ4_XS: /* d scales_h scales_l[4] qs[128] */
        iq4xs_scales(b + 2, sc);
        for (int j = 0; j < 16; j++) ds[j] = half_at(b) * (float)sc[j / 2];
        break;
    default: /* the 32-element formats: d [m] ... */
        ds[0] = ds[1] = half_at(b);
        if (min) dm[0] = dm[1] = half_at(b + 2);
    }
    return min;
}

/* One block's true integer codes q[E] (the codes less their offset, or the IQ4 table's values). */
static void decode_block(int format, const uint8_t *b, int8_t *q) {
    switch (format) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_IQ4_NL: {
        const int min = format == GGML_Q4_1 || format == GGML_Q5_1, five = format == GGML_Q5_0 || format == GGML_Q5_1;
        const uint8_t *qs = b + 2 + 2 * min + 4 * five; /* elements 0-15 the low nibbles, 16-31 the high */
        const uint32_t high = five ? word_at(b + 2 + 2 * min) : 0;
        const int offset = format == GGML_Q4_0 ? 8 : format == GGML_Q5_0 ? 16 : 0;
        for (int j = 0; j < GROUP; j++) {
            const int code = ((j < 16 ? qs[j] : qs[j - 16] >> 4) & 15) | (((high >> j) & 1) << 4);
            q[j] = format == GGML_IQ4_NL ? IQ4_VALUES[code] : (int8_t)(code - offset);
        }
        break;
    }
    case GGML_Q8_0: memcpy(q, b + 2, GROUP); break;
    case GGML_Q2_K: case GGML_Q3_K: /* 2-bit codes, 4 a byte: group g a shift of 32 bytes; Q3_K's are 4
                                     * less where bit g of their hmask byte is clear */
        for (int e = 0; e < SUPER; e++) {
            const uint8_t *qs = b + (format == GGML_Q3_K ? 32 : 16);
            const int g = e / 32, low = (qs[(g / 4) * 32 + e % 32] >> (2 * (g % 4))) & 3;
            q[e] = (int8_t)(format == GGML_Q2_K ? low : low - ((b[e % 32] >> g) & 1 ? 0 : 4));
        }
        break;
    case GGML_Q4_K: case GGML_Q5_K: { /* groups 2c and 2c + 1 the nibbles of 32 bytes; Q5_K's fifth bit: bit g of qh */
        const int five = format == GGML_Q5_K;
        const uint8_t *qs = b + 16 + 32 * five;
        for (int e = 0; e < SUPER; e++) {
            const int g = e / 32, low = (qs[(g / 2) * 32 + e % 32] >> (4 * (g % 2))) & 15;
            q[e] = (int8_t)(low | (five ? ((b[16 + e % 32] >> g) & 1) << 4 : 0));
        }
        break;
    }
    case GGML_Q6_K: /* each half of 128: ql's 64 bytes low then high nibbles, qh's 32 bytes 2 bits a group */
        for (int e = 0; e < SUPER; e++) {
            const int h = e / 128, i = e % 128;
            const int low = (b[64 * h + i % 64] >> (4 * (i / 64))) & 15;
            const int high = (b[128 + 32 * h + i % 32] >> (2 * (i / 32))) & 3;
            q[e] = (int8_t)((low | high << 4) - 32);
        }
        break;
    case GGML_IQ4_XS: /* group i the nibbles of 16 bytes, through the IQ4 table */
        for (int e = 0; e < SUPER; e++)
            q[e] = IQ4_VALUES[(b[8 + 16 * (e / 32) + e % 16] >> (4 * ((e % 32) / 16))) & 15];
        break;
    }
}

#endif
