/* Causal attention of a prefill chunk over the paged KV cache in AVX512-BF16 dot products, for CPUs
 * that have them without AMX (AMD Zen 4 and later, Intel Cooper Lake): prefill_amx.h's tasks and
 * layouts (attention_bf16.h), each tile product written as vector dot products. A vector holds the
 * 16 queries of a task (one lane each); `vdpbf16ps` adds to each lane the product of a pair of its
 * bfloat16 values with a pair broadcast from memory:
 * - scores^T of key j += Q^T pair p (16 queries) . K[j] pair p, 16 keys with an accumulator each;
 * - output^T of dimension d += P^T pair k (16 queries' weights of keys 2k, 2k+1) . V^T[d] pair k.
 * torch's CPU flash attention (float32 arithmetic on bfloat16 inputs here) took 12 ms a layer on a
 * 1000-token chunk of 9 heads of 64 on a 2-core AMD EPYC (Zen 4); see docs/speed.md for this one. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")

#define BF_DP(acc, a, pair) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)_mm512_set1_epi32((int)(pair)))

/* Scores^T of 16 keys from `k` (their slots `stride` apart) against the task's Q^T, into s[0..15]. */
static inline void bf_scores16(const uint32_t *qt, const uint16_t *k, int64_t stride, int64_t D, __m512 *s) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
    const uint32_t *kp = (const uint32_t *)k;
    const int64_t st = stride / 2; /* in pairs */
    for (int64_t p = 0; p < D / 2; p++, kp++) {
        const __m512i qv = _mm512_loadu_si512(qt + p * 16);
        a0 = BF_DP(a0, qv, kp[0]), a1 = BF_DP(a1, qv, kp[st]), a2 = BF_DP(a2, qv, kp[2 * st]);
        a3 = BF_DP(a3, qv, kp[3 * st]), a4 = BF_DP(a4, qv, kp[4 * st]), a5 = BF_DP(a5, qv, kp[5 * st]);
        a6 = BF_DP(a6, qv, kp[6 * st]), a7 = BF_DP(a7, qv, kp[7 * st]), a8 = BF_DP(a8, qv, kp[8 * st]);
        a9 = BF_DP(a9, qv, kp[9 * st]), a10 = BF_DP(a10, qv, kp[10 * st]), a11 = BF_DP(a11, qv, kp[11 * st]);
        a12 = BF_DP(a12, qv, kp[12 * st]), a13 = BF_DP(a13, qv, kp[13 * st]), a14 = BF_DP(a14, qv, kp[14 * st]);
        a15 = BF_DP(a15, qv, kp[15 * st]);
    }
    s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3, s[4] = a4, s[5] = a5, s[6] = a6, s[7] = a7;
    s[8] = a8, s[9] = a9, s[10] = a10, s[11] = a11, s[12] = a12, s[13] = a13, s[14] = a14, s[15] = a15;
}

/* acc (output^T, 16 head dimensions from `acc`) += V^T (one pf_v_tile: row d the 32 keys of
 * dimension d) . P^T (pt: 16 pairs of keys, a vector each). */
static inline void bf_values16(const uint32_t *pt, const uint16_t *vtile, float *acc) {
    __m512 a[16];
    for (int d = 0; d < 16; d++) a[d] = _mm512_loadu_ps(acc + d * 16);
    const uint32_t *v = (const uint32_t *)vtile; /* row d: 16 pairs of keys */
    for (int k = 0; k < PF_KEYS / 2; k++) {
        const __m512i pv = _mm512_loadu_si512(pt + k * 16);
        for (int d = 0; d < 16; d++) a[d] = BF_DP(a[d], pv, v[d * 16 + k]);
    }
    for (int d = 0; d < 16; d++) _mm512_storeu_ps(acc + d * 16, a[d]);
}

/* One task: queries r0 .. r0 + rows - 1 of the chunk for head h (amx_attend_block's arithmetic). */
static void bf_attend_block(const uint16_t *q, int64_t q_stride, int64_t h, int64_t G, int64_t KV, int64_t D,
                            int64_t r0, int64_t rows, int64_t first_pos, const uint16_t *cache, int64_t block_size,
                            const int64_t *table, const uint16_t *vpack, int64_t steps, float scale, uint16_t *out,
                            int64_t out_stride) {
    const int64_t g = h / G, slot_stride = 2 * KV * D;
    float acc[PF_MAX_HEAD_DIM * 16];
    uint32_t qt[PF_MAX_HEAD_DIM / 2 * 16], pt[16 * 16];
    pf_pack_queries(q + r0 * q_stride + h * D, q_stride, rows, D, qt);
    memset(acc, 0, D * 16 * sizeof(float));
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    /* scores in log2 units: the weights are powers of two */
    const __m512 sc = _mm512_set1_ps(scale * 1.4426950408889634f);
    const __mmask16 present = rows == 16 ? 0xffff : (__mmask16)((1u << rows) - 1);
    const int64_t base = first_pos + r0; /* query r's position is base + r */
    const int64_t last_pos = base + rows - 1, last = last_pos / PF_KEYS; /* the last step any query sees */
    for (int64_t b = 0; b <= last; b++) {
        __m512 s[PF_KEYS];
        for (int half = 0; half < 2; half++) {
            const int64_t key = b * PF_KEYS + half * 16;
            if (key > last_pos) { /* past the context (and its block table): masked out below */
                for (int j = 0; j < 16; j++) s[half * 16 + j] = _mm512_setzero_ps();
                continue;
            }
            const uint16_t *k = cache + ((table[key / block_size] * block_size + key % block_size) * 2 * KV + g) * D;
            bf_scores16(qt, k, slot_stride, D, s + half * 16);
        }
        __mmask16 seen[PF_KEYS];
        const __m512 step_top = pf_mask_scores(s, seen, b, base, present, sc);
        if (_mm512_cmp_ps_mask(step_top, _mm512_add_ps(top, _mm512_set1_ps(PF_RESCALE_LOG2)), _CMP_GT_OQ)) {
            const __m512 new_top = _mm512_max_ps(top, step_top), alpha = pf_rescale(top, new_top);
            sum = _mm512_mul_ps(sum, alpha);
            for (int64_t d = 0; d < D; d++) _mm512_storeu_ps(acc + d * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + d * 16), alpha));
            top = new_top;
        }
        pf_step_weights(s, seen, top, &sum, pt);
        for (int64_t dc = 0; dc < D / 16; dc++)
            bf_values16(pt, pf_v_tile((uint16_t *)vpack, g, b, dc, steps, D), acc + dc * 256);
    }
    pf_store_rows(acc, sum, rows, D, out + r0 * out_stride + h * D, out_stride);
}

static int bf_prefill_attention(int threads, const uint16_t *q, int64_t q_stride, int64_t query_len, int64_t H,
                                int64_t KV, int64_t D, const uint16_t *cache, int64_t block_size, const int64_t *table,
                                int64_t ctx, float scale, uint16_t *out, int64_t out_stride) {
    const int64_t steps = (ctx + PF_KEYS - 1) / PF_KEYS, G = H / KV;
    uint16_t *vpack = malloc(KV * steps * PF_KEYS * D * 2);
    if (!vpack) return -2;
    pf_pack_values(cache, KV, D, block_size, table, ctx, steps, vpack, threads);
    const int64_t qblocks = (query_len + PF_QROWS - 1) / PF_QROWS, first_pos = ctx - query_len;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < H * qblocks; task++) { /* the longest (last) query blocks first */
        const int64_t h = task % H, qb = qblocks - 1 - task / H, r0 = qb * PF_QROWS;
        const int64_t rows = query_len - r0 < PF_QROWS ? query_len - r0 : PF_QROWS;
        bf_attend_block(q, q_stride, h, G, KV, D, r0, rows, first_pos, cache, block_size, table, vpack, steps, scale,
                        out, out_stride);
    }
    free(vpack);
    return 0;
}

#undef BF_DP
#pragma GCC pop_options

/* Whether this CPU has AVX512-BF16 (with the AVX-512 variant's instructions). */
static int bf16_dot_usable(void) {
    return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
}
