/* Matrix products with 4- and 8-bit weights, for CPUs.
 *
 * y[M, N] = x[M, K] @ w[N, K]^T, where w is stored in groups of 32 along K:
 *   4-bit: w = d * q + m, q in 0..15, two values a byte (a group's 16 bytes hold elements 0-15 in
 *          their low nibbles and 16-31 in their high ones, as GGUF's Q4_1 blocks do);
 *   8-bit: w = d * q, q in -127..127 (GGUF's Q8_0);
 * with d and m float16, as in those blocks. Activations are quantized row by row to int8 in groups
 * of 32 (scale = max|x| / 127, rounded to nearest), so each group's product is a sum of byte
 * products: one dpbusd with VNNI, maddubs + madd with AVX2. For 4-bit weights two groups are
 * computed at once: the 32 bytes of a pair unpack into [g0 0-15 | g1 0-15] and [g0 16-31 |
 * g1 16-31], so the activations of a pair are stored in that order. x and y are float32 or bfloat16.
 *
 * One shared library holds every variant; `pd_best_isa` asks the CPU which it can run and the
 * caller passes the level it wants (lower levels always work: the tests run each of them).
 * Threads come from OpenMP, which is torch's own runtime once torch is loaded (same soname), and
 * their number is the caller's (torch's setting).
 */
#include "common.h"

#include <omp.h>

#define GROUP 32
#define TILE 4                     /* weight rows computed together: one activation load for four */
#define PARALLEL_QUANTIZE (1 << 16) /* activations below this many values are quantized on one thread */
#define PANEL 16                   /* output columns of a panel (qmatmul_panel.h) */
#define PANEL_GROUP_BYTES 256      /* a panel's 16 columns x 32 values of a group, two a byte */
#define PANEL8_GROUP_BYTES 512     /* the same, a byte each (8-bit weights) */

struct qmm {
    int bits, threads, x_bf16;
    int64_t M, K, N;
    const void *x;
    const void *qs;  /* [N, K / 2] uint8 (4-bit) or [N, K] int8 */
    const uint16_t *wd, *wm;  /* [N, K / 32] float16 scales, and minimums (4-bit only) */
    void *y;
    int8_t *xq;  /* scratch: [M, K] quantized activations */
    float *xd, *xs;  /* scratch: [M, K / 32] their scales, and scale * sum of each group */
};

/* Where element k of an activation row is stored: for 4-bit weights, each pair of groups as
 * [g0 0-15 | g1 0-15 | g0 16-31 | g1 16-31]; an odd last group, and 8-bit weights, in order. */
static inline int64_t x_offset(int64_t k, int64_t K, int pairs) {
    const int64_t g = k / GROUP, j = k % GROUP;
    if (!pairs || g >= ((K / GROUP) & ~(int64_t)1)) return k;
    return (g & ~(int64_t)1) * GROUP + (j / 16) * GROUP + (g & 1) * 16 + j % 16;
}

static void store_row(const struct qmm *a, int64_t m, int64_t n0, int64_t rows, const float *out) {
    if (a->x_bf16) {
        uint16_t *y = (uint16_t *)a->y + m * a->N + n0;
        for (int64_t r = 0; r < rows; r++) y[r] = f32_to_bf16(out[r]);
    } else {
        memcpy((float *)a->y + m * a->N + n0, out, rows * sizeof(float));
    }
}

/* ---- portable: plain C, any x86-64 (or other) CPU ---- */

static void quantize_row_portable(const void *x, int bf16, int64_t K, int pairs, int8_t *q, float *d, float *s) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        float v[GROUP], a = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            int64_t i = g * GROUP + j;
            v[j] = bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
            a = fmaxf(a, fabsf(v[j]));
        }
        float scale = a / 127.0f, inv = a > 0.0f ? 127.0f / a : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < GROUP; j++) {
            int32_t qi = (int32_t)nearbyintf(v[j] * inv);
            q[x_offset(g * GROUP + j, K, pairs)] = (int8_t)qi;
            sum += qi;
        }
        d[g] = scale;
        s[g] = scale * (float)sum;
    }
}

static void quantize_portable(const struct qmm *a) {
    const int64_t G = a->K / GROUP;
#pragma omp parallel for num_threads(a->M * a->K >= PARALLEL_QUANTIZE ? a->threads : 1) schedule(static)
    for (int64_t m = 0; m < a->M; m++) {
        const void *row = a->x_bf16 ? (const void *)((const uint16_t *)a->x + m * a->K)
                                    : (const void *)((const float *)a->x + m * a->K);
        quantize_row_portable(row, a->x_bf16, a->K, a->bits == 4, a->xq + m * a->K, a->xd + m * G, a->xs + m * G);
    }
}

static float dot_row_portable(const struct qmm *a, int64_t m, int64_t n) {
    const int64_t G = a->K / GROUP;
    const int8_t *xq = a->xq + m * a->K;
    float acc = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        int32_t dot = 0;
        const float d = half_to_float(a->wd[n * G + g]) * a->xd[m * G + g];
        if (a->bits == 4) {
            const uint8_t *p = (const uint8_t *)a->qs + (n * G + g) * (GROUP / 2);
            for (int j = 0; j < GROUP / 2; j++)
                dot += (p[j] & 15) * xq[x_offset(g * GROUP + j, a->K, 1)] +
                       (p[j] >> 4) * xq[x_offset(g * GROUP + GROUP / 2 + j, a->K, 1)];
            acc += d * (float)dot + half_to_float(a->wm[n * G + g]) * a->xs[m * G + g];
        } else {
            const int8_t *p = (const int8_t *)a->qs + (n * G + g) * GROUP;
            for (int j = 0; j < GROUP; j++) dot += p[j] * xq[g * GROUP + j];
            acc += d * (float)dot;
        }
    }
    return acc;
}

static void gemm_portable(const struct qmm *a) {
#pragma omp parallel for num_threads(a->threads) schedule(static)
    for (int64_t n0 = 0; n0 < a->N; n0 += TILE) {
        const int64_t rows = a->N - n0 < TILE ? a->N - n0 : TILE;
        float out[TILE];
        for (int64_t m = 0; m < a->M; m++) {
            for (int64_t r = 0; r < rows; r++) out[r] = dot_row_portable(a, m, n0 + r);
            store_row(a, m, n0, rows, out);
        }
    }
}

#define WIDE 0 /* the SIMD kernels' 512-bit loops: AVX-512 VNNI only */

/* ---- AVX2 + FMA ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KSUF _avx2
#define DOT_ACC(acc, w, x) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1)))
#include "qmatmul_simd.h"
#include "qmatmul_panel.h"
#undef DOT_ACC
#undef KSUF
#pragma GCC pop_options

/* ---- AVX-512 VNNI (its 256-bit form, with AVX512VL) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define KSUF _avx512vnni
#define DOT_ACC(acc, w, x) _mm256_dpbusd_epi32((acc), (w), (x))
#undef WIDE
#define WIDE 1 /* 512-bit vectors for the bulk of each row */
#include "qmatmul_simd.h"
#include "qmatmul_panel.h"
#undef WIDE
#define WIDE 0
#undef DOT_ACC
#undef KSUF
#pragma GCC pop_options

/* ---- AVX-VNNI (the VEX form: CPUs with VNNI but without AVX-512) ---- */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define KSUF _avxvnni
#define DOT_ACC(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
#include "qmatmul_simd.h"
#define PANEL_DPBUSD _mm256_dpbusd_avx_epi32
#include "qmatmul_panel.h"
#undef PANEL_DPBUSD
#undef DOT_ACC
#undef KSUF
#pragma GCC pop_options

/* ---- entry points ---- */

/* Whether this CPU (and its operating system, which must save the wider registers) runs `isa`. */
int pd_isa_supported(int isa) {
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    switch (isa) {
    case ISA_PORTABLE: return 1;
    case ISA_AVX2: return avx2;
    case ISA_AVX512VNNI:
        return avx2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw");
    case ISA_AVXVNNI: return avx2 && __builtin_cpu_supports("avxvnni");
    default: return 0;
    }
}

/* y = x @ w^T. Returns 0, or -1 for arguments the kernels do not take, -2 when out of memory. */
int pd_qmatmul(int isa, int threads, int bits, const void *x, int x_bf16, int64_t M, int64_t K,
               const void *qs, const uint16_t *wd, const uint16_t *wm, int64_t N, void *y) {
    if ((bits != 4 && bits != 8) || K % GROUP || M < 0 || N < 0 || threads < 1 || (bits == 4 && !wm) ||
        !pd_isa_supported(isa))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t G = K / GROUP;
    struct qmm a = {bits, threads, x_bf16, M, K, N, x, qs, wd, wm, y, NULL, NULL, NULL};
    a.xq = malloc(M * K);
    a.xd = malloc(M * G * sizeof(float));
    a.xs = malloc(M * G * sizeof(float));
    if (!a.xq || !a.xd || !a.xs) {
        free(a.xq), free(a.xd), free(a.xs);
        return -2;
    }
    switch (isa) {
    case ISA_AVX512VNNI: quantize_avx512vnni(&a), gemm_avx512vnni(&a); break;
    case ISA_AVXVNNI: quantize_avxvnni(&a), gemm_avxvnni(&a); break;
    case ISA_AVX2: quantize_avx2(&a), gemm_avx2(&a); break;
    default: quantize_portable(&a), gemm_portable(&a);
    }
    free(a.xq), free(a.xd), free(a.xs);
    return 0;
}

/* A 4- or 8-bit weight (the layouts above) repacked for the panel kernel (qmatmul_panel.h):
 *   4-bit: packed [N / 16, K / 32, 256] bytes, pd and pm [N / 16, K / 32, 16] float16 scales and
 *          minimums;
 *   8-bit: packed [N / 16, K / 32, 512]: block i, lane l, byte b holds weight row 16 p + l's element
 *          g * 32 + 4 i + b; pd the float16 scales, pm int16 minus each column's group sum (the
 *          kernel's correction is 128 times that: the activations are biased by 128 to be unsigned
 *          bytes).
 * Scales and minimums stay in float16, as the weight holds them: a decode step reads every byte of
 * the panels, and float32 copies would add a fifth to a 4-bit weight's. */
int pd_panel_pack(int bits, const void *qs, const uint16_t *wd, const uint16_t *wm, int64_t N, int64_t K,
                  void *packed, uint16_t *pd, void *pm) {
    if ((bits != 4 && bits != 8) || (bits == 4 && !wm) || N < 1 || N % PANEL || K < GROUP || K % GROUP) return -1;
    const int64_t G = K / GROUP;
    for (int64_t p = 0; p < N / PANEL; p++)
        for (int64_t g = 0; g < G; g++)
            for (int l = 0; l < PANEL; l++) {
                const int64_t n = p * PANEL + l, at = (p * G + g) * PANEL + l;
                pd[at] = wd[n * G + g];
                if (bits == 8) {
                    const int8_t *src = (const int8_t *)qs + n * K + g * GROUP;
                    int32_t sum = 0;
                    for (int k = 0; k < GROUP; k++) {
                        ((int8_t *)packed)[(p * G + g) * PANEL8_GROUP_BYTES + (k / 4) * 64 + l * 4 + k % 4] = src[k];
                        sum += src[k];
                    }
                    ((int16_t *)pm)[at] = (int16_t)-sum;
                    continue;
                }
                const uint8_t *src = (const uint8_t *)qs + (n * G + g) * (GROUP / 2); /* 0-15 low, 16-31 high */
                ((uint16_t *)pm)[at] = wm[n * G + g];
                for (int i = 0; i < 4; i++)
                    for (int b = 0; b < 4; b++) {
                        const int k0 = 8 * i + b, k1 = k0 + 4;
                        const uint8_t q0 = k0 < 16 ? src[k0] & 15 : src[k0 - 16] >> 4;
                        const uint8_t q1 = k1 < 16 ? src[k1] & 15 : src[k1 - 16] >> 4;
                        ((uint8_t *)packed)[(p * G + g) * PANEL_GROUP_BYTES + i * 64 + l * 4 + b] = (uint8_t)(q0 | q1 << 4);
                    }
            }
    return 0;
}

/* Whether the variant `isa` runs panels of `bits`-bit weights: 4-bit with any SIMD variant, 8-bit
 * with the VNNI ones (AVX2's maddubs would saturate on the biased bytes). */
int pd_panels_available(int isa, int bits) {
    if (!pd_isa_supported(isa) || isa == ISA_PORTABLE) return 0;
    return bits == 4 || (bits == 8 && (isa == ISA_AVX512VNNI || isa == ISA_AVXVNNI));
}

/* y = x @ w^T for a weight packed by pd_panel_pack: 0, -1 for what it does not take, -2 when out
 * of memory. */
int pd_panel_matmul(int isa, int threads, int bits, const void *x, int x_bf16, int64_t M, int64_t K, const void *packed,
                    const uint16_t *pd, const void *pm, int64_t N, void *y) {
    if (!pd_panels_available(isa, bits) || M < 0 || N < 1 || N % PANEL || K < GROUP || K % GROUP || threads < 1)
        return -1;
    if (M == 0) return 0;
    const int64_t G = K / GROUP;
    struct qmm a = {bits, threads, x_bf16, M, K, N, x, NULL, NULL, NULL, y, NULL, NULL, NULL};
    a.xq = malloc(M * K);
    a.xd = malloc(M * G * sizeof(float));
    a.xs = malloc(M * G * sizeof(float));
    if (a.xq && a.xd && a.xs) {
        switch (isa) {
        case ISA_AVX512VNNI: panel_quantize_avx512vnni(&a), panel_gemm_avx512vnni(&a, packed, pd, pm); break;
        case ISA_AVXVNNI: panel_quantize_avxvnni(&a), panel_gemm_avxvnni(&a, packed, pd, pm); break;
        default: panel_quantize_avx2(&a), panel_gemm_avx2(&a, packed, pd, pm);
        }
    }
    const int rc = a.xq && a.xd && a.xs ? 0 : -2;
    free(a.xq), free(a.xd), free(a.xs);
    return rc;
}
