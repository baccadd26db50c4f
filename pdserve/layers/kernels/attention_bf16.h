/* What the bfloat16 attention kernels share, on AMX tiles (prefill_amx.h, decode_amx.h) and in
 * AVX512-BF16 dot products (prefill_bf16.h): the layouts of queries, weights and values, and the
 * softmax's exponential. Included by ops.c after its AVX-512 variant, whose vector helpers they use.
 *
 * A prefill task is 16 queries of one head: scores for 32 keys at a time, an online softmax, then
 * P.V into the running output, rescaled only when a score passes the running maximum by 2^8.
 * Queries are the chunk's tokens, the last `query_len` positions of the context; query i sees keys
 * 0 .. context_len - query_len + i. */

#define PF_QROWS 16 /* queries a task holds (a tile's rows, a vector's lanes) */
#define PF_KEYS 32  /* keys a step takes: two score tiles, one P.V product's depth */
#define PF_MAX_HEAD_DIM 256

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")

/* Products are taken transposed, so that a vector holds one key's (or one head dimension's)
 * values for the 16 queries of a task, and the online softmax is lane-wise arithmetic with no
 * sum or maximum across lanes: scores^T = K . Q^T (K read from the cache in place: the 16 slots
 * of an aligned group of keys lie at one stride), output^T = V^T . P^T. */

/* V^T of KV head g for the 32 keys of step b, 16 head dimensions (dc) a tile: row d holds that
 * dimension of the 32 keys. */
static inline uint16_t *pf_v_tile(uint16_t *vpack, int64_t g, int64_t b, int64_t dc, int64_t steps, int64_t D) {
    return vpack + ((g * steps + b) * (D / 16) + dc) * 512;
}

static void pf_pack_values(const uint16_t *cache, int64_t KV, int64_t D, int64_t block_size, const int64_t *table,
                           int64_t ctx, int64_t steps, uint16_t *vpack, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < KV * steps; task++) {
        const int64_t g = task / steps, b = task % steps;
        for (int64_t n = 0; n < PF_KEYS; n++) {
            const int64_t key = b * PF_KEYS + n;
            const uint16_t *v = NULL; /* keys past the context weigh zero: their values must be 0, not stale */
            if (key < ctx) v = cache + ((table[key / block_size] * block_size + key % block_size) * 2 * KV + KV + g) * D;
            for (int64_t d = 0; d < D; d++) pf_v_tile(vpack, g, b, d / 16, steps, D)[(d % 16) * 32 + n] = v ? v[d] : 0;
        }
    }
}

/* Q^T of the task's 16 queries as the right operand: for each 32 head dimensions c, row dp holds
 * pair dp of each query (so qt + 16 i is pair i of the 16 queries, a vector's worth). */
static void pf_pack_queries(const uint16_t *q, int64_t q_stride, int64_t rows, int64_t D, uint32_t *qt) {
    memset(qt, 0, D / 32 * 256 * 4);
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t *pairs = (const uint32_t *)(q + r * q_stride);
        for (int64_t i = 0; i < D / 2; i++) qt[(i / 16) * 256 + (i % 16) * 16 + r] = pairs[i];
    }
}

/* 2^x for the softmax weights (x <= PF_RESCALE_LOG2; far below zero it gives 0): a degree-4
 * polynomial on the fraction and the exponent applied by scalef, within 5e-5 relative: weights
 * become bfloat16, 4e-3 apart. */
static inline __m512 pf_exp2(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-127.0f)); /* also maps NaN (-inf - -inf, masked later) */
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.618129e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550411e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The running maximum a query's weights are taken against moves only when a score passes it by
 * more than this (log2 units): weights stay below 2^8, and the output is rescaled rarely. */
#define PF_RESCALE_LOG2 8.0f

/* The weights of two keys (p0, p1: a lane per query) as bfloat16 pairs, p0's in the low half of
 * each 32 bits: the operand P^T takes. The CPU's own conversion (AVX512-BF16) rounds to nearest
 * even as f32_to_bf16 does, subnormals to zero: one instruction and a permute, against about
 * fifteen in plain AVX-512. */
static inline __m512i pf_pairs_bf16(__m512 p0, __m512 p1) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
}

/* A step's scores (s[j]: key b * PF_KEYS + j for the task's 16 queries, raw products) masked and
 * scaled to log2 units: key j is seen by the queries at positions >= j (all of them below the
 * diagonal), none sees keys past the context; query r's position is base + r. Returns the step's
 * largest score per query; seen[j] says which queries see key j. */
static inline __m512 pf_mask_scores(__m512 *s, __mmask16 *seen, int64_t b, int64_t base, __mmask16 present,
                                    __m512 sc) {
    const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int below = b * PF_KEYS + PF_KEYS - 1 <= base;
    __m512 step_top = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < PF_KEYS; j++) {
        const float behind = (float)(b * PF_KEYS + j - base); /* the first query (lane) that sees key j */
        seen[j] = below ? present : _mm512_cmp_ps_mask(lane, _mm512_set1_ps(behind), _CMP_GE_OQ) & present;
        s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen[j], s[j], sc);
        step_top = _mm512_max_ps(step_top, s[j]);
    }
    return step_top;
}

/* The factor a task's sums are rescaled by when its running maximum moves from top to new_top
 * (1 where nothing was summed yet: rows not present stay at -inf). */
static inline __m512 pf_rescale(__m512 top, __m512 new_top) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(top, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                               pf_exp2(_mm512_sub_ps(top, new_top)));
}

/* The step's weights against the running maximum into pt (P^T: key pairs as bfloat16 pairs, a
 * vector each), their sum added to *sum. */
static inline void pf_step_weights(const __m512 *s, const __mmask16 *seen, __m512 top, __m512 *sum, uint32_t *pt) {
    for (int j = 0; j < PF_KEYS; j += 2) {
        const __m512 p0 = _mm512_maskz_mov_ps(seen[j], pf_exp2(_mm512_sub_ps(s[j], top)));
        const __m512 p1 = _mm512_maskz_mov_ps(seen[j + 1], pf_exp2(_mm512_sub_ps(s[j + 1], top)));
        *sum = _mm512_add_ps(*sum, _mm512_add_ps(p0, p1));
        _mm512_storeu_si512(pt + (j / 2) * 16, pf_pairs_bf16(p0, p1));
    }
}

/* A task's output^T (acc[d * 16 + r]) over its sums of weights, as bfloat16 rows of `out`. */
static inline void pf_store_rows(const float *acc, __m512 sum, int64_t rows, int64_t D, uint16_t *out,
                                 int64_t out_stride) {
    float inv[16], row[PF_MAX_HEAD_DIM];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sum));
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t d = 0; d < D; d++) row[d] = acc[d * 16 + r] * inv[r];
        for (int64_t d = 0; d < D; d += 16) store_row_avx512(out + r * out_stride, d, _mm512_loadu_ps(row + d), 1);
    }
}

#pragma GCC pop_options
