/* The per-token operations around the matmuls of a decoder layer, for CPUs: RMS norm, SiLU times
 * up, rotary embedding with the KV cache write, and decode attention over the paged cache. In
 * torch each is several operators of a few microseconds of dispatch each on rows of a few
 * hundred values: at batch 1 that overhead, not the arithmetic, is their cost. Here each is one
 * call. x and y are float32 or bfloat16; threads come from OpenMP as in qmatmul.c. Where the CPU
 * has AMX: prefill attention (prefill_amx.h) and quantized products of a decode batch
 * (qmatmul_amx.h) on its tiles; where it has AVX512-BF16 without AMX, prefill attention in its dot
 * products (prefill_bf16.h).
 *
 * Entry points return 0, or -1 for arguments they do not take (the caller then uses torch). */
#define _GNU_SOURCE /* sched_getaffinity, pthread_setaffinity_np */
#include "common.h"

#include <cpuid.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_HEAD_DIM 512
#define MAX_GROUP 64 /* query heads per KV head */
#define MIN_PART_TOKENS 128 /* decode attention: the fewest cached tokens worth a task of their own */

/* What a decode attention task over part of a context leaves for the merge: each query head's
 * largest score, sum of exponentials against it, and unnormalized sum of V ([G], [G], [G * D]). */
struct attn_part { float *top, *sum, *acc; };

/* Walks a context's slots in order through its block table without a division per token. */
struct slot_cursor { const int64_t *table; int64_t block_size, block, offset; };

static inline int64_t next_slot(struct slot_cursor *at) {
    const int64_t slot = at->table[at->block] * at->block_size + at->offset;
    if (++at->offset == at->block_size) at->offset = 0, at->block++;
    return slot;
}

/* The first key a query at context length `len` sees: with a sliding window (window > 0) only
 * the last `window` tokens, its own included. */
static inline int64_t window_start(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* How many parts each row's context is split into for decode attention with few rows, where a row
 * makes `row_tasks` tasks a part: enough tasks to share among the threads, none shorter than
 * MIN_PART_TOKENS. Rows enough to give every thread a few take one part each. */
static int64_t attention_parts(int64_t R, int64_t row_tasks, const int64_t *lens, int64_t window, int threads) {
    if (R >= 2 * threads) return 1;
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) {
        const int64_t seen = lens[r] - window_start(lens[r], window);
        longest = seen > longest ? seen : longest;
    }
    int64_t parts = (4 * threads + R * row_tasks - 1) / (R * row_tasks);
    if (parts > longest / MIN_PART_TOKENS) parts = longest / MIN_PART_TOKENS;
    return parts < 1 ? 1 : parts;
}

#define KSUF _portable /* the compiler's baseline instructions */
#define VEC_LANES 0 /* width of the hand-vectorized loops: 0, plain loops */
#include "ops_body.h"
#undef KSUF
#undef VEC_LANES

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KSUF _avx2
#define VEC_LANES 8
#include "ops_body.h"
#undef KSUF
#undef VEC_LANES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
#define KSUF _avx512
#define VEC_LANES 16
#include "ops_body.h"
#undef KSUF
#undef VEC_LANES
#pragma GCC pop_options

/* AVX512-BF16 intrinsics: GCC 10, clang 9; AMX: GCC 11, clang 12. */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define PD_BF16 1
#include "attention_bf16.h"
#include "prefill_bf16.h"
#endif
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define PD_AMX 1
#include "prefill_amx.h"
#include "qmatmul_amx.h"
#include "blocks_amx.h"
#include "decode_amx.h"
#endif

/* Each operation's variants, by ISA level (the VNNI levels use their vector width's). */
#define DISPATCH(isa, name, ...)                                                            \
    do {                                                                                    \
        if (!pd_isa_supported(isa)) return -1;                                             \
        if ((isa) == ISA_AVX512VNNI) name##_avx512(__VA_ARGS__);                            \
        else if ((isa) == ISA_AVX2 || (isa) == ISA_AVXVNNI) name##_avx2(__VA_ARGS__);        \
        else name##_portable(__VA_ARGS__);                                                          \
        return 0;                                                                           \
    } while (0)

/* delta may be NULL (a plain norm); else x += delta first, in place. */
int pd_rms_norm(int isa, int threads, void *x, const void *delta, const void *w, float eps, int64_t T, int64_t H,
                void *y, int bf16) {
    if (T < 0 || H < 1 || threads < 1) return -1;
    DISPATCH(isa, rms_norm, threads, x, delta, w, eps, T, H, y, bf16);
}

int pd_silu_mul(int isa, int threads, const void *gate_up, int64_t T, int64_t I, void *out, int bf16) {
    if (T < 0 || I < 1 || threads < 1) return -1;
    DISPATCH(isa, gated_mul, threads, gate_up, T, I, out, bf16, 0);
}

/* GELU (its tanh form, as Gemma's MLP) times up. */
int pd_gelu_mul(int isa, int threads, const void *gate_up, int64_t T, int64_t I, void *out, int bf16) {
    if (T < 0 || I < 1 || threads < 1) return -1;
    DISPATCH(isa, gated_mul, threads, gate_up, T, I, out, bf16, 1);
}

int pd_rotary_store(int isa, int threads, void *qkv, int64_t T, int64_t H, int64_t KV, int64_t D, const void *cos,
                    const void *sin, void *cache, const int64_t *slots, int bf16) {
    if (T < 0 || H < 1 || KV < 1 || D < 2 || D % 2 || D > MAX_HEAD_DIM || threads < 1) return -1;
    DISPATCH(isa, rotary_store, threads, qkv, T, H, KV, D, cos, sin, cache, slots, bf16);
}

static int amx_available(int isa);

int pd_decode_attention(int isa, int threads, const void *q, int64_t q_stride, int64_t R, int64_t H, int64_t KV,
                        int64_t D, const void *cache, int64_t block_size, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lens, int64_t window, float scale, void *out, int bf16) {
    if (window < 0 || R < 0 || KV < 1 || H % KV || H / KV > MAX_GROUP || D < 1 || D > MAX_HEAD_DIM || block_size < 1 ||
        threads < 1)
        return -1;
    for (int64_t r = 0; r < R; r++)
        if (lens[r] < 1 || lens[r] > max_blocks * block_size) return -1;
#ifdef PD_AMX
    if (bf16 && amx_available(isa) && D % 32 == 0 && D <= PF_MAX_HEAD_DIM && H / KV <= 16 &&
        block_size % 16 == 0 &&
        !amx_decode_attention(threads, q, q_stride, R, H, KV, D, cache, block_size, tables, max_blocks, lens, window,
                              scale, out))
        return 0;
#endif
    DISPATCH(isa, decode_attention, threads, q, q_stride, R, H, KV, D, cache, block_size, tables, max_blocks, lens,
             window, scale, out, bf16);
}

/* Where this CPU has AMX for bfloat16 and the AVX-512 variant runs. */
static int amx_available(int isa) {
#ifdef PD_AMX
    return isa == ISA_AVX512VNNI && pd_isa_supported(isa) && amx_usable();
#else
    (void)isa;
    return 0;
#endif
}

enum { PREFILL_VECTORS = 1, PREFILL_TILES = 2 };

/* The kernels of prefill attention this CPU and build run with the variant `isa`, a bit each:
 * PREFILL_VECTORS (AVX512-BF16 dot products, prefill_bf16.h), PREFILL_TILES (AMX, prefill_amx.h). */
int pd_prefill_attention_kinds(int isa) {
    int kinds = 0;
#ifdef PD_BF16
    if (isa == ISA_AVX512VNNI && pd_isa_supported(isa) && bf16_dot_usable()) kinds |= PREFILL_VECTORS;
#endif
    if (amx_available(isa)) kinds |= PREFILL_TILES;
    return kinds;
}

/* A prefill chunk's causal attention (bfloat16) by the kernel `kind` (one of the bits above): -1
 * where this CPU, build or shape does not take it (the caller then uses torch). q [query_len rows
 * of q_stride, H * D used], out [query_len rows of out_stride]; the chunk's K/V already in the cache. */
int pd_prefill_attention(int isa, int threads, int kind, const void *q, int64_t q_stride, int64_t query_len,
                         int64_t H, int64_t KV, int64_t D, const void *cache, int64_t block_size, const int64_t *table,
                         int64_t ctx, float scale, void *out, int64_t out_stride) {
    if (!(pd_prefill_attention_kinds(isa) & kind) || threads < 1 || KV < 1 || H % KV || D < 32 || D % 32 ||
        query_len < 1 || query_len > ctx || block_size % 16)
        return -1;
#ifdef PD_BF16
    if (D > PF_MAX_HEAD_DIM) return -1;
#ifdef PD_AMX
    if (kind == PREFILL_TILES)
        return amx_prefill_attention(threads, q, q_stride, query_len, H, KV, D, cache, block_size, table, ctx, scale,
                                     out, out_stride);
#endif
    if (kind == PREFILL_VECTORS)
        return bf_prefill_attention(threads, q, q_stride, query_len, H, KV, D, cache, block_size, table, ctx, scale,
                                    out, out_stride);
#endif
    return -1;
}

int pd_qmatmul_amx_available(int isa) { return amx_available(isa); }

/* y[M, N] = x[M, K] @ w^T for a 4- or 8-bit weight in qmatmul.c's format, x and y bfloat16, on AMX
 * tiles: -1 where this CPU, build or shape does not take it. */
int pd_qmatmul_amx(int isa, int threads, int bits, const void *x, int64_t M, int64_t K, const void *qs,
                   const void *wd, const void *wm, int64_t N, void *y) {
    if (!pd_qmatmul_amx_available(isa) || threads < 1 || (bits != 4 && bits != 8) || (bits == 4 && !wm) ||
        M < 1 || K < 32 || K % 32 || N < 1)
        return -1;
#ifdef PD_AMX
    return qamx_matmul(threads, bits, x, M, K, qs, wd, wm, N, y);
#else
    return -1;
#endif
}

/* y [M, ldy] = x [M, K] @ w^T for a weight of block parts (blocks.c's formats), bfloat16 rows on
 * AMX tiles: -1 where this CPU, build or shape does not take it, -2 when memory is short. */
int pd_block_matmul_amx(int isa, int threads, int64_t nparts, const int64_t *formats, const int64_t *rows,
                        const void *const *data, const void *x, int64_t M, int64_t K, void *y, int64_t ldy) {
#ifdef PD_AMX
    if (!amx_available(isa) || threads < 1 || nparts < 1 || nparts > BAMX_MAX_PARTS || K < 32 || K % 32 || M < 0)
        return -1;
    int64_t N = 0;
    for (int64_t p = 0; p < nparts; p++) {
        if (rows[p] < 0 || !pd_block_row_bytes((int)formats[p], K)) return -1;
        N += rows[p];
    }
    if (ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    return bamx_matmul(isa, threads, nparts, formats, rows, data, x, M, K, y, ldy);
#else
    (void)isa, (void)threads, (void)nparts, (void)formats, (void)rows, (void)data, (void)x, (void)M, (void)K, (void)y;
    (void)ldy;
    return -1;
#endif
}

/* ---- a decode step's decoder layers in one call ---- */

int pd_qmatmul(int isa, int threads, int bits, const void *x, int x_bf16, int64_t M, int64_t K, const void *qs,
               const uint16_t *wd, const uint16_t *wm, int64_t N, void *y);

int pd_panel_matmul(int isa, int threads, int bits, const void *x, int x_bf16, int64_t M, int64_t K, const void *packed,
                    const uint16_t *pd, const void *pm, int64_t N, void *y);

int pd_block_matmul_parts(int isa, int threads, int64_t nparts, const int64_t *formats, const int64_t *rows,
                          const void *const *data, const void *x, int x_bf16, int64_t M, int64_t K, void *y,
                          int64_t ldy);
#define MAX_BLOCK_PARTS 8 /* blocks.c's MAX_PARTS */

/* One part of a weight in a GGUF block format (blocks.c): `rows` output rows of `format`. */
struct pd_block_part {
    int64_t format, rows;
    const void *data;
};

/* A quantized weight (qmatmul.c's format, and its panel copy or NULLs; or, with bits 0, `nparts`
 * parts in GGUF block formats stacked along the outputs) and one decoder layer's weights, for
 * pd_decode_stack. */
struct pd_qweight {
    int64_t bits;
    const void *qs, *scales, *mins;
    const void *panels;
    const uint16_t *panel_scales; /* float16 */
    const void *panel_mins;       /* 4-bit: float16 minimums; 8-bit: int16 corrections */
    const struct pd_block_part *parts;
    int64_t nparts;
};
struct pd_layer {
    const void *input_norm, *post_norm; /* in the activations' dtype */
    const void *qkv_bias;               /* NULL: none */
    struct pd_qweight qkv, o, gate_up, down;
    const void *q_norm, *k_norm;               /* per head, before rotary (Qwen3, Gemma); NULL: none */
    const void *attn_out_norm, *mlp_out_norm;  /* of the attention's and the MLP's outputs (Gemma); NULL: none */
    int64_t window;                            /* a sliding layer's window; 0: the whole context */
    int64_t local_rope;                        /* rotated by the local table (Gemma 3's sliding layers) */
};

/* Each of T rows' `heads` heads of D values at `at` (rows `stride` elements apart) normed in place
 * (rms_norm over D, through `scratch` [heads, D]): a query/key norm, row by row as the model's
 * norm runs its [T * heads, D] rows. */
static int head_norms(int isa, int threads, char *at, int64_t stride, int64_t T, int64_t heads, int64_t D,
                      const void *w, float eps, void *scratch, int bf16) {
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        char *row = at + t * stride * es;
        const int rc = pd_rms_norm(isa, threads, row, NULL, w, eps, heads, D, scratch, bf16);
        if (rc) return rc;
        memcpy(row, scratch, heads * D * es);
    }
    return 0;
}

/* `v` [T, H] replaced by its norm (through `scratch` [T, H]): Gemma's norm of a sublayer's output. */
static int norm_in_place(int isa, int threads, void *v, const void *w, float eps, int64_t T, int64_t H, void *scratch,
                         int bf16) {
    const int rc = pd_rms_norm(isa, threads, v, NULL, w, eps, T, H, scratch, bf16);
    if (!rc) memcpy(v, scratch, T * H * (bf16 ? 2 : 4));
    return rc;
}

enum { STACK_BYTES = 0, STACK_TILES = 1, STACK_PANELS = 2 }; /* where a stack's products run */

/* `on`: where quantized weights' products run (its low 4 bits) and block weights' (the next 4). */
static int stack_product(int isa, int threads, int on, const struct pd_qweight *w, const void *x, int bf16,
                         int64_t M, int64_t K, int64_t N, void *y) {
    if (w->bits == 0) { /* block parts, each into its columns of y, in one call */
        on >>= 4;
        int64_t formats[MAX_BLOCK_PARTS], rows[MAX_BLOCK_PARTS], total = 0;
        const void *data[MAX_BLOCK_PARTS];
        if (w->nparts < 1 || w->nparts > MAX_BLOCK_PARTS) return -1;
        for (int64_t i = 0; i < w->nparts; i++) {
            formats[i] = w->parts[i].format, rows[i] = w->parts[i].rows, data[i] = w->parts[i].data;
            total += rows[i];
        }
        if (total != N) return -1;
        if (on == STACK_TILES) return pd_block_matmul_amx(isa, threads, w->nparts, formats, rows, data, x, M, K, y, N);
        return pd_block_matmul_parts(isa, threads, w->nparts, formats, rows, data, x, bf16, M, K, y, N);
    }
    on &= 15;
    if (on == STACK_TILES) return pd_qmatmul_amx(isa, threads, (int)w->bits, x, M, K, w->qs, w->scales, w->mins, N, y);
    if (on == STACK_PANELS && w->panels)
        return pd_panel_matmul(isa, threads, (int)w->bits, x, bf16, M, K, w->panels, w->panel_scales, w->panel_mins,
                               N, y);
    return pd_qmatmul(isa, threads, (int)w->bits, x, bf16, M, K, w->qs, w->scales, w->mins, N, y);
}

/* y += bias, row by row, rounded as torch adds in bfloat16 (in float32, then to nearest even). */
static void add_bias(void *y, const void *bias, int64_t T, int64_t N, int bf16) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < N; j++) {
            if (bf16) {
                uint16_t *v = (uint16_t *)y + t * N + j;
                *v = f32_to_bf16(bf16_to_f32(*v) + bf16_to_f32(((const uint16_t *)bias)[j]));
            } else {
                ((float *)y)[t * N + j] += ((const float *)bias)[j];
            }
        }
}

/* The decoder layers of a decode-only step (T rows, one new token each), the same operations in the
 * same order as the model's layers run them one call at a time: input x [T, H] (the embeddings;
 * the final x and delta, whose sum the final norm takes, are left in x and delta), scratch h
 * [T, H], qkv [T, (heads + 2 kv_heads) D], att [T, heads D], gu [T, 2 I], s [T, I], scratch
 * [T, max(H, heads D)]. Each layer's cache is `layer_bytes` after the one before. A layer's
 * query/key norms, output norms, window and local rotary table (cos_local, sin_local) where it has
 * them; the MLP's gate SiLU, or GELU with `gelu`. Products where `on` says (STACK_*: quantized
 * weights' in its low 4 bits, block weights' in the next 4; a weight without panels runs byte
 * products). At batch 1 the model's calls cost more than its arithmetic: this is one call. */
int pd_decode_stack(int isa, int threads, const struct pd_layer *layers, int64_t L, int64_t T, int64_t H,
                    int64_t heads, int64_t kv_heads, int64_t D, int64_t I, float eps, float scale, int on, void *x,
                    void *delta, void *h, void *qkv, void *att, void *gu, void *s, const void *cos, const void *sin,
                    const void *cos_local, const void *sin_local, int gelu, void *scratch, void *cache,
                    int64_t layer_bytes, const int64_t *slots, int64_t block_size, const int64_t *tables,
                    int64_t max_blocks, const int64_t *lens, int bf16) {
    const int64_t width = (heads + 2 * kv_heads) * D, q_size = heads * D, es = bf16 ? 2 : 4;
    if (L < 1 || T < 1 || H < 1 || I < 1 || kv_heads < 1 || heads % kv_heads) return -1;
    for (int64_t i = 0; i < L; i++) {
        const struct pd_layer *w = layers + i;
        char *layer_cache = (char *)cache + i * layer_bytes;
        const int local = w->local_rope && cos_local && sin_local;
        int rc = pd_rms_norm(isa, threads, x, i ? delta : NULL, w->input_norm, eps, T, H, h, bf16);
        if (!rc) rc = stack_product(isa, threads, on, &w->qkv, h, bf16, T, H, width, qkv);
        if (!rc && w->qkv_bias) add_bias(qkv, w->qkv_bias, T, width, bf16);
        if (!rc && w->q_norm) rc = head_norms(isa, threads, qkv, width, T, heads, D, w->q_norm, eps, scratch, bf16);
        if (!rc && w->k_norm)
            rc = head_norms(isa, threads, (char *)qkv + q_size * es, width, T, kv_heads, D, w->k_norm, eps, scratch, bf16);
        if (!rc) rc = pd_rotary_store(isa, threads, qkv, T, heads, kv_heads, D, local ? cos_local : cos,
                                      local ? sin_local : sin, layer_cache, slots, bf16);
        if (!rc) rc = pd_decode_attention(isa, threads, qkv, width, T, heads, kv_heads, D, layer_cache, block_size,
                                          tables, max_blocks, lens, w->window, scale, att, bf16);
        if (!rc) rc = stack_product(isa, threads, on, &w->o, att, bf16, T, q_size, H, delta);
        if (!rc && w->attn_out_norm) rc = norm_in_place(isa, threads, delta, w->attn_out_norm, eps, T, H, scratch, bf16);
        if (!rc) rc = pd_rms_norm(isa, threads, x, delta, w->post_norm, eps, T, H, h, bf16);
        if (!rc) rc = stack_product(isa, threads, on, &w->gate_up, h, bf16, T, H, 2 * I, gu);
        if (!rc) rc = (gelu ? pd_gelu_mul : pd_silu_mul)(isa, threads, gu, T, I, s, bf16);
        if (!rc) rc = stack_product(isa, threads, on, &w->down, s, bf16, T, I, H, delta);
        if (!rc && w->mlp_out_norm) rc = norm_in_place(isa, threads, delta, w->mlp_out_norm, eps, T, H, scratch, bf16);
        if (rc) return rc;
    }
    return 0;
}

/* Pins each thread of the calling thread's OpenMP team of `threads` to its own CPU of the calling
 * thread's allowed set, in order (the caller on the first). -1 where the set has fewer CPUs. */
int pd_bind_team(int threads) {
    cpu_set_t allowed;
    if (threads < 1 || sched_getaffinity(0, sizeof allowed, &allowed)) return -1;
    int cpus[CPU_SETSIZE], n = 0;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
    if (n < threads) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[omp_get_thread_num()], &one);
        if (pthread_setaffinity_np(pthread_self(), sizeof one, &one)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

/* Parallel regions started from the calling thread run on it alone (OpenMP's team size is a
 * per-thread setting): see native.serial_torch_on_this_thread. */
void pd_openmp_serial_here(void) { omp_set_num_threads(1); }
