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

/* Every part's rows (`nparts` weights sharing one quantized activation buffer) in one parallel region. */
static void gemm_portable(const struct bmm *parts, int64_t nparts) {
#pragma omp parallel num_threads(parts[0].threads)
    for (int64_t p = 0; p < nparts; p++) {
        const struct bmm *a = parts + p;
#pragma omp for schedule(static) nowait
        for (int64_t n = 0; n < a->N; n++)
            for (int64_t m = 0; m < a->M; m += ROWS) dot_rows_portable(a, n, m, a->M - m < ROWS ? (int)(a->M - m) : ROWS);
    }
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

#define MAX_PARTS 8

/* The variant `isa`'s activation layout for `format` (0 for the portable one: one layout). */
static int x_key(int isa, int format) {
    switch (isa) {
    case ISA_AVX512VNNI: return x_key_avx512vnni(format);
    case ISA_AVXVNNI: return x_key_avxvnni(format);
    case ISA_AVX2: return x_key_avx2(format);
    default: return 0;
    }
}

static void quantize(int isa, const struct bmm *a) {
    switch (isa) {
    case ISA_AVX512VNNI: quantize_avx512vnni(a); break;
    case ISA_AVXVNNI: quantize_avxvnni(a); break;
    case ISA_AVX2: quantize_avx2(a); break;
    default: quantize_portable(a);
    }
}

static void gemm(int isa, const struct bmm *parts, int64_t nparts) {
    switch (isa) {
    case ISA_AVX512VNNI: gemm_avx512vnni(parts, nparts); break;
    case ISA_AVXVNNI: gemm_avxvnni(parts, nparts); break;
    case ISA_AVX2: gemm_avx2(parts, nparts); break;
    default: gemm_portable(parts, nparts);
    }
}

/* A weight of `nparts` parts stacked along its outputs, part i `rows[i]` rows of `formats[i]` at
 * `data[i]` (a fused q/k/v a file stores in two formats): the activations quantized once, every
 * part's rows in one parallel region, y [M, ldy] holding the parts' columns side by side. */
int pd_block_matmul_parts(int isa, int threads, int64_t nparts, const int64_t *formats, const int64_t *rows,
                          const void *const *data, const void *x, int x_bf16, int64_t M, int64_t K, void *y,
                          int64_t ldy) {
    if (nparts < 1 || nparts > MAX_PARTS || K < 1 || M < 0 || threads < 1 || !pd_isa_supported(isa)) return -1;
    int64_t N = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int format = (int)formats[p];
        if (!block_bytes(format) || K % block_elements(format) || rows[p] < 0) return -1;
        N += rows[p];
    }
    if (ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / GROUP;
    struct bmm parts[MAX_PARTS];
    int owner[MAX_PARTS]; /* the part whose quantized activations part p reads (its own, or an earlier one's) */
    int64_t column = 0;
    int rc = 0;
    for (int64_t p = 0; p < nparts; p++) {
        const int format = (int)formats[p];
        parts[p] = (struct bmm){format, threads, x_bf16, M, K, rows[p], ldy, x, data[p],
                                K / block_elements(format) * block_bytes(format), (char *)y + column * (x_bf16 ? 2 : 4),
                                NULL, NULL, NULL, NULL};
        column += rows[p];
        owner[p] = (int)p;
        for (int64_t q = 0; q < p; q++)
            if (owner[q] == q && x_key(isa, (int)formats[q]) == x_key(isa, format)) owner[p] = (int)q;
        if (owner[p] != p) {
            const struct bmm *o = parts + owner[p];
            parts[p].xq = o->xq, parts[p].xd = o->xd, parts[p].xs = o->xs, parts[p].xh = o->xh;
            continue;
        }
        parts[p].xq = malloc(M * K), parts[p].xd = malloc(M * G * sizeof(float));
        parts[p].xs = malloc(M * G * sizeof(float)), parts[p].xh = malloc(M * 2 * G * sizeof(float));
        if (!parts[p].xq || !parts[p].xd || !parts[p].xs || !parts[p].xh) rc = -2;
        else quantize(isa, parts + p);
    }
    if (!rc) gemm(isa, parts, nparts);
    for (int64_t p = 0; p < nparts; p++)
        if (owner[p] == p) free(parts[p].xq), free(parts[p].xd), free(parts[p].xs), free(parts[p].xh);
    return rc;
}

int pd_block_matmul(int isa, int threads, int format, const void *x, int x_bf16, int64_t M, int64_t K,
                    const void *w, int64_t N, void *y, int64_t ldy) {
    const int64_t formats[1] = {format}, rows[1] = {N};
    const void *data[1] = {w};
    return pd_block_matmul_parts(isa, threads, 1, formats, rows, data, x, x_bf16, M, K, y, ldy);
}

static void dequantize_row(int isa, int format, const uint8_t *w, int64_t K, void *out, int bf16) {
    switch (isa) {
    case ISA_AVX512VNNI: dequantize_row_avx512vnni(format, w, K, out, bf16); break;
    case ISA_AVXVNNI: dequantize_row_avxvnni(format, w, K, out, bf16); break;
    case ISA_AVX2: dequantize_row_avx2(format, w, K, out, bf16); break;
    default: dequantize_row_portable(format, w, K, out, bf16);
    }
}

/* Weight rows [0, rows) (at most 16, `row_bytes` apart from `w`), elements [k0, k0 + len) of each
 * (whole blocks, len <= 256), expanded to bfloat16 into out [16, 256], the rows past `rows` zero:
 * how the AMX products expand a block weight as they read it (ops.c's blocks_amx.h). */
void pd_block_expand(int isa, int format, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k0, int64_t len,
                     uint16_t *out) {
    const uint8_t *at = w + k0 / block_elements(format) * block_bytes(format);
    for (int64_t r = 0; r < 16; r++) {
        if (r < rows) dequantize_row(isa, format, at + r * row_bytes, len, out + r * 256, 1);
        else memset(out + r * 256, 0, len * sizeof(uint16_t));
    }
}

/* A row's bytes in `format` (0 where K is not whole blocks of it). */
int64_t pd_block_row_bytes(int format, int64_t K) {
    return block_bytes(format) && K % block_elements(format) == 0 ? K / block_elements(format) * block_bytes(format) : 0;
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
