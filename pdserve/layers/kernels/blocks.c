/* Matrix products with weights in GGUF's block formats (llama.cpp's), read as the file stores them.
 *
 * A weight is [N, K]: each of its rows is K / E blocks back to back, the raw bytes of a GGUF tensor
 * of GGUF shape [K, N]. E = 32 elements a block for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL; 256 (a
 * super-block) for Q2_K..Q6_K and IQ4_XS (blocks_format.h). Nothing is converted at load, so a
 * decode step reads exactly the file's bytes and costs their size.
 *
 * y[M, N] (rows ldy apart) = x[M, K] @ W^T. Activations are quantized row by row to int8 in groups
 * of 32 (scale = max|x| / 127, rounded to nearest even: qmatmul.c's rule), keeping each group's
 * scale, scale * sum, and the integer sums of its halves of 16. Each group's product is then a sum
 * of byte products of the weight's codes and the activations (dpbusd with VNNI, maddubs + madd with
 * AVX2), scaled in float32 by the weight's scale for the group (or for each half, in Q2_K, Q3_K and
 * Q6_K) times the activations'. A code's offset (Q4_0's 8, Q6_K's 32) or a block's minimum is a term
 * of its own: the offset or minimum times the activations' group or half sum.
 *
 * Decode is memory-bound: each thread takes a range of weight rows and reads each row once, for up
 * to 4 activation rows at a time (8 with AVX-512; more rows reread it from L1); blocks_dot.h tells
 * how a row's products are laid out for the vector units. A row's outputs do not depend on how many
 * rows share its call. Dequantization (pd_block_dequantize, pd_block_rows) gives gguf's float32
 * values bit for bit, and in bfloat16 those rounded to nearest even.
 *
 * Not handled: the other ggml types (the IQ1/IQ2/IQ3 grids, TQ, MXFP4, Q8_K, ...), which are
 * refused: pd_block_format_supported says which are served.
 */
#include "blocks_format.h"

#include <omp.h>

#define ROWS 4                      /* activation rows sharing one read of a weight row (portable) */
#define PARALLEL_QUANTIZE (1 << 16) /* activations below this many values are quantized on one thread */
/* Weight bytes fetched ahead of the products: with the hardware's prefetchers alone, one core of a
 * 2-vCPU Xeon streamed a Q4_K weight from memory at 6.5 GB/s, at 9.9 with these (1-8 kB ahead
 * all did about as well). */
#define PREFETCH 2048

/* How the SIMD kernels store a row's int8 activations, group by group (32 bytes each):
 *   NATURAL      in order
 *   HALVES       the halves' 4-byte runs interleaved [a0 b0 a1 b1 a2 b2 a3 b3], so that lanes
 *                alternate between the halves (formats scaled per half)
 *   PAIRS        two groups a 64-byte vector, their runs interleaved (AVX-512)
 *   PAIR_HALVES  the same by halves: [g0 a0, g0 b0, g1 a0, g1 b0, g0 a1, ...] (AVX-512) */
enum { LAYOUT_NATURAL, LAYOUT_HALVES, LAYOUT_PAIRS, LAYOUT_PAIR_HALVES };

struct bmm {
    int format, threads, x_bf16;
    int64_t M, K, N, ldy;
    const void *x;
    const uint8_t *w; /* [N, K / E blocks] */
    int64_t row_bytes;
    void *y;          /* [M, ldy] */
    int8_t *xq;       /* scratch: [M, K] quantized activations */
    float *xd, *xs;   /* scratch: [M, K / 32] their scales, and scale * sum of each group */
    float *xh;        /* scratch: [M, K / 16] the integer sum of each half group (exact in float) */
};

static inline void store_value(void *out, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)out)[i] = f32_to_bf16(v);
    else ((float *)out)[i] = v;
}

/* ---- portable: plain C, any CPU ---- */

static void dequantize_row_portable(int format, const uint8_t *w, int64_t K, void *out, int bf16) {
    int8_t q[SUPER];
    float ds[16], dm[16];
    const int E = block_elements(format), bytes = block_bytes(format);
    for (int64_t b = 0; b < K / E; b++) {
        const int min = block_scales(format, w + b * bytes, ds, dm);
        decode_block(format, w + b * bytes, q);
        for (int e = 0; e < E; e++)
            store_value(out, b * E + e, min ? ds[e / 16] * (float)q[e] + dm[e / 16] : ds[e / 16] * (float)q[e], bf16);
    }
}

static void quantize_row_portable(const void *x, int bf16, int64_t K, int8_t *q, float *d, float *s, float *h) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float v[GROUP], a = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            v[j] = bf16 ? bf16_to_f32(((const uint16_t *)x)[g * GROUP + j]) : ((const float *)x)[g * GROUP + j];
            a = fmaxf(a, fabsf(v[j]));
        }
        const float scale = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
        int32_t half[2] = {0, 0};
        for (int j = 0; j < GROUP; j++) {
            const int32_t qi = (int32_t)nearbyintf(v[j] * inv);
            q[g * GROUP + j] = (int8_t)qi;
            half[j / 16] += qi;
        }
        d[g] = scale;
        s[g] = scale * (float)(half[0] + half[1]);
        h[2 * g] = (float)half[0], h[2 * g + 1] = (float)half[1];
    }
}

static void quantize_portable(const struct bmm *a) {
    const int64_t G = a->K / GROUP;
#pragma omp parallel for num_threads(a->M * a->K >= PARALLEL_QUANTIZE ? a->threads : 1) schedule(static)
    for (int64_t m = 0; m < a->M; m++) {
        const void *row = a->x_bf16 ? (const void *)((const uint16_t *)a->x + m * a->K)
                                    : (const void *)((const float *)a->x + m * a->K);
        quantize_row_portable(row, a->x_bf16, a->K, a->xq + m * a->K, a->xd + m * G, a->xs + m * G, a->xh + m * 2 * G);
    }
}

/* Rows m .. m + R of y at weight row n: per half group, the integer dot of the true codes times ds
 * and the activations' scale, plus dm times the half's sum (the same terms the SIMD kernels add). */
static void dot_rows_portable(const struct bmm *a, int64_t n, int64_t m, int R) {
    int8_t q[SUPER];
    float ds[16], dm[16], acc[ROWS] = {0};
    const int E = block_elements(a->format), bytes = block_bytes(a->format);
    const int64_t G = a->K / GROUP;
    for (int64_t b = 0; b < a->K / E; b++) {
        block_scales(a->format, a->w + n * a->row_bytes + b * bytes, ds, dm);
        decode_block(a->format, a->w + n * a->row_bytes + b * bytes, q);
        for (int r = 0; r < R; r++) {
            const int8_t *x = a->xq + (m + r) * a->K + b * E;
            for (int j = 0; j < E / 16; j++) {
                int32_t dot = 0;
                for (int e = 16 * j; e < 16 * j + 16; e++) dot += q[e] * x[e];
                const int64_t g = (b * E + 16 * j) / GROUP;
                const float dx = a->xd[(m + r) * G + g];
                acc[r] += ds[j] * dx * (float)dot + dm[j] * dx * a->xh[(m + r) * 2 * G + 2 * g + j % 2];
            }
        }
    }
    for (int r = 0; r < R; r++) store_value(a->y, (m + r) * a->ldy + n, acc[r], a->x_bf16);
}

static void gemm_portable(const struct bmm *a) {
#pragma omp parallel for num_threads(a->threads) schedule(static)
    for (int64_t n = 0; n < a->N; n++)
        for (int64_t m = 0; m < a->M; m += ROWS) dot_rows_portable(a, n, m, a->M - m < ROWS ? (int)(a->M - m) : ROWS);
}

/* ---- the SIMD variants (blocks_simd.h, with blocks_k.h for the 256-element formats) ---- */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KSUF _avx2
#define DOT_ACC(acc, w, x) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1)))
#define AVX512 0
#include "blocks_simd.h"
#undef AVX512
#undef DOT_ACC
#undef KSUF
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define KSUF _avx512vnni
#define DOT_ACC(acc, w, x) _mm256_dpbusd_epi32((acc), (w), (x))
#define AVX512 1
#include "blocks_simd.h"
#undef AVX512
#undef DOT_ACC
#undef KSUF
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define KSUF _avxvnni
#define DOT_ACC(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
#define AVX512 0
#include "blocks_simd.h"
#undef AVX512
#undef DOT_ACC
#undef KSUF
#pragma GCC pop_options

/* ---- entry points: 0, or -1 for arguments refused, -2 when out of memory ---- */

int pd_block_format_supported(int format) { return block_bytes(format) != 0; }

int pd_block_matmul(int isa, int threads, int format, const void *x, int x_bf16, int64_t M, int64_t K,
                    const void *w, int64_t N, void *y, int64_t ldy) {
    if (!block_bytes(format) || K < 1 || K % block_elements(format) || M < 0 || N < 0 || ldy < N || threads < 1 ||
        !pd_isa_supported(isa))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / GROUP;
    struct bmm a = {format, threads, x_bf16, M, K, N, ldy, x, w, K / block_elements(format) * block_bytes(format), y,
                    malloc(M * K), malloc(M * G * sizeof(float)), malloc(M * G * sizeof(float)),
                    malloc(M * 2 * G * sizeof(float))};
    const int rc = a.xq && a.xd && a.xs && a.xh ? 0 : -2;
    if (!rc) {
        switch (isa) {
        case ISA_AVX512VNNI: quantize_avx512vnni(&a), gemm_avx512vnni(&a); break;
        case ISA_AVXVNNI: quantize_avxvnni(&a), gemm_avxvnni(&a); break;
        case ISA_AVX2: quantize_avx2(&a), gemm_avx2(&a); break;
        default: quantize_portable(&a), gemm_portable(&a);
        }
    }
    free(a.xq), free(a.xd), free(a.xs), free(a.xh);
    return rc;
}

static void dequantize_row(int isa, int format, const uint8_t *w, int64_t K, void *out, int bf16) {
    switch (isa) {
    case ISA_AVX512VNNI: dequantize_row_avx512vnni(format, w, K, out, bf16); break;
    case ISA_AVXVNNI: dequantize_row_avxvnni(format, w, K, out, bf16); break;
    case ISA_AVX2: dequantize_row_avx2(format, w, K, out, bf16); break;
    default: dequantize_row_portable(format, w, K, out, bf16);
    }
}

int pd_block_dequantize(int isa, int threads, int format, const void *w, int64_t N, int64_t K, void *out,
                        int out_bf16) {
    if (!block_bytes(format) || K < 1 || K % block_elements(format) || N < 0 || threads < 1 || !pd_isa_supported(isa))
        return -1;
    const int64_t row_bytes = K / block_elements(format) * block_bytes(format), size = out_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        dequantize_row(isa, format, (const uint8_t *)w + n * row_bytes, K, (char *)out + n * K * size, out_bf16);
    return 0;
}

/* An embedding lookup: a few rows, so threads only where there is much to expand. ids are the
 * caller's to check against the weight's row count. */
int pd_block_rows(int isa, int threads, int format, const void *w, int64_t K, const int64_t *ids, int64_t count,
                  void *out, int out_bf16) {
    if (!block_bytes(format) || K < 1 || K % block_elements(format) || count < 0 || threads < 1 ||
        !pd_isa_supported(isa))
        return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0) return -1;
    const int64_t row_bytes = K / block_elements(format) * block_bytes(format), size = out_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(count * K >= PARALLEL_QUANTIZE ? threads : 1) schedule(static)
    for (int64_t i = 0; i < count; i++)
        dequantize_row(isa, format, (const uint8_t *)w + ids[i] * row_bytes, K, (char *)out + i * K * size, out_bf16);
    return 0;
}
