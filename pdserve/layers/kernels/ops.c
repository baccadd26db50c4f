/* The per-token operations around the matmuls of a decoder layer, for CPUs: RMS norm, SiLU times
 * up, rotary embedding with the KV cache write, and decode attention over the paged cache. In
 * torch each is several operators of a few microseconds of dispatch each on rows of a few
 * hundred values: at batch 1 that overhead, not the arithmetic, is their cost. Here each is one
 * call. x and y are float32 or bfloat16; threads come from OpenMP as in qmatmul.c. Where the CPU
 * has AMX: prefill attention (prefill_amx.h) and quantized products of a decode batch
 * (qmatmul_amx.h) on its tiles.
 *
 * Entry points return 0, or -1 for arguments they do not take (the caller then uses torch). */
#include "common.h"

#include <cpuid.h>
#include <omp.h>
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

/* AMX intrinsics: GCC 11, clang 12. */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define PD_AMX 1
#include "prefill_amx.h"
#include "qmatmul_amx.h"
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
    DISPATCH(isa, silu_mul, threads, gate_up, T, I, out, bf16);
}

int pd_rotary_store(int isa, int threads, void *qkv, int64_t T, int64_t H, int64_t KV, int64_t D, const void *cos,
                    const void *sin, void *cache, const int64_t *slots, int bf16) {
    if (T < 0 || H < 1 || KV < 1 || D < 2 || D % 2 || D > MAX_HEAD_DIM || threads < 1) return -1;
    DISPATCH(isa, rotary_store, threads, qkv, T, H, KV, D, cos, sin, cache, slots, bf16);
}

int pd_decode_attention(int isa, int threads, const void *q, int64_t q_stride, int64_t R, int64_t H, int64_t KV,
                        int64_t D, const void *cache, int64_t block_size, const int64_t *tables, int64_t max_blocks,
                        const int64_t *lens, float scale, void *out, int bf16) {
    if (R < 0 || KV < 1 || H % KV || H / KV > MAX_GROUP || D < 1 || D > MAX_HEAD_DIM || block_size < 1 ||
        threads < 1)
        return -1;
    for (int64_t r = 0; r < R; r++)
        if (lens[r] < 1 || lens[r] > max_blocks * block_size) return -1;
    DISPATCH(isa, decode_attention, threads, q, q_stride, R, H, KV, D, cache, block_size, tables, max_blocks, lens,
             scale, out, bf16);
}

int pd_prefill_attention_available(int isa) {
#ifdef PD_AMX
    return isa == ISA_AVX512VNNI && pd_isa_supported(isa) && amx_usable();
#else
    (void)isa;
    return 0;
#endif
}

/* A prefill chunk's causal attention (bfloat16) on AMX tiles: -1 where this CPU, build or shape
 * does not take it (the caller then uses torch). q [query_len rows of q_stride, H * D used], out
 * [query_len rows of out_stride]; the chunk's K/V already in the cache. */
int pd_prefill_attention(int isa, int threads, const void *q, int64_t q_stride, int64_t query_len, int64_t H,
                         int64_t KV, int64_t D, const void *cache, int64_t block_size, const int64_t *table,
                         int64_t ctx, float scale, void *out, int64_t out_stride) {
    if (!pd_prefill_attention_available(isa) || threads < 1 || KV < 1 || H % KV || D < 32 || D % 32 ||
        query_len < 1 || query_len > ctx || block_size % 16)
        return -1;
#ifdef PD_AMX
    if (D > AMX_MAX_HEAD_DIM) return -1;
    return amx_prefill_attention(threads, q, q_stride, query_len, H, KV, D, cache, block_size, table, ctx, scale, out,
                                 out_stride);
#else
    return -1;
#endif
}

int pd_qmatmul_amx_available(int isa) {
#ifdef PD_AMX
    return pd_prefill_attention_available(isa) && __builtin_cpu_supports("avx512bf16");
#else
    (void)isa;
    return 0;
#endif
}

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

/* Parallel regions started from the calling thread run on it alone (OpenMP's team size is a
 * per-thread setting): see native.serial_torch_on_this_thread. */
void pd_openmp_serial_here(void) { omp_set_num_threads(1); }
