/* Decode attention (one new query a row) over the paged KV cache on AMX tiles, bfloat16; included
 * by ops.c after prefill_amx.h, whose query packing and 2^x it uses.
 *
 * In vectors a decode step's attention is arithmetic-bound: each cached key and value is widened
 * to float32 and multiplied once per query head of its group, about 11 GB/s on two cores where
 * the memory gives twice that. On tiles the arithmetic is small and the cost is reading the cache:
 * a task is one row (or a range of its context) with all its KV heads, in one pass over its keys,
 * 32 at a time, fetching the slots of a later step ahead (14-15 GB/s of the ~23 two cores read in
 * sequence: the fetches are bound by the cores' outstanding misses):
 * - scores^T = K . Q^T, 16 keys a product, K read from the cache in place (the 16 slots of an
 *   aligned group of keys lie at one stride in one block); each head's scores gathered into a row;
 * - an online softmax per head whose running maximum moves only when a score passes it by 2^8
 *   (the output then rescaled); weights rounded to bfloat16, the sum taken of the rounded weights
 *   (so that a weight alone keeps its value's exactly);
 * - out += P . V: V's rows interleaved by key pairs as the right operand needs them (an unpack,
 *   which permutes the head dimensions within each 32: the sums are kept in that order and put
 *   back in the end).
 * A task leaves its heads' outputs, or for the merge of a context split among threads its part
 * (attn_part, in natural-log units as the vector kernels' parts). */

#define DAMX_KEYS 32 /* keys a step takes: two score products, one P.V product's depth */
#define DAMX_AHEAD 2 /* steps a task fetches ahead */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")

/* Scores: 0 keys, 1 queries, 2 scores (16 x 64 bytes). P.V: 3 P [G heads, 32 keys], 4 V [16 key
 * pairs, 16 dims, 2], 5-7 output sums [G, 16 dims], taken in turns. */
static void damx_configure(int64_t G) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = t == 3 || t >= 5 ? (uint8_t)G : 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* What a task keeps: per query head its running maximum (log2 units) and sum of weights, its sum
 * of weighted V ([H, D], head dimensions in the tiles' order), the queries packed per KV head,
 * one step's scores, weights and values. */
struct damx_state {
    float *top, *sum, *acc, *scores;
    uint32_t *qt;
    uint16_t *p, *vt;
};

static int64_t damx_state_bytes(int64_t H, int64_t KV, int64_t D) {
    return (2 * H + H * D + KV * 2 * 256) * 4 + KV * (D / 2) * 16 * 4 + H * DAMX_KEYS * 2 + (D / 16) * 512 * 2 + 64;
}

static struct damx_state damx_state_in(char *work, int64_t H, int64_t KV, int64_t D) {
    struct damx_state st;
    st.top = (float *)work;
    st.sum = st.top + H;
    st.acc = st.sum + H;
    st.scores = st.acc + H * D;
    st.qt = (uint32_t *)(st.scores + KV * 2 * 256);
    st.p = (uint16_t *)(st.qt + KV * (D / 2) * 16);
    st.vt = st.p + H * DAMX_KEYS;
    return st;
}

/* Column n of output tile t holds this head dimension: the unpack of two keys' rows interleaves
 * them 128 bits at a time, the low halves in even tiles, the high in odd ones. */
static inline int64_t damx_dim(int64_t t, int64_t n) { return (t / 2) * 32 + (n / 4) * 8 + (t % 2) * 4 + n % 4; }

/* The slot of each of the step's keys that lies in [jb, je) (else -1). */
static void damx_step_slots(const int64_t *table, int64_t block_size, int64_t s0, int64_t jb, int64_t je,
                            int64_t *slots) {
    for (int64_t i = 0; i < DAMX_KEYS; i++) {
        const int64_t key = s0 + i;
        slots[i] = key >= jb && key < je ? table[key / block_size] * block_size + key % block_size : -1;
    }
}

/* Scores of every KV head's 16-key groups of the step (a group with no key in range is skipped). */
static void damx_step_scores(const struct damx_state *st, int64_t KV, int64_t D, const uint16_t *cache,
                             const int64_t *slots) {
    const int64_t slot_bytes = 2 * KV * D * 2;
    for (int half = 0; half < 2; half++) {
        int64_t first = -1; /* the group's slots are consecutive: found from any key in range */
        for (int i = 0; i < 16 && first < 0; i++)
            if (slots[half * 16 + i] >= 0) first = slots[half * 16 + i] - i;
        if (first < 0) continue;
        for (int64_t g = 0; g < KV; g++) {
            const char *k = (const char *)(cache + (first * 2 * KV + g) * D);
            _tile_zero(2);
            for (int64_t c = 0; c < D / 32; c++) {
                _tile_loadd(0, k + c * 64, slot_bytes);
                _tile_loadd(1, st->qt + (g * (D / 2) + c * 16) * 16, 64);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, st->scores + (g * 2 + half) * 256, 64);
        }
    }
}

/* Each head's weights for the step into p (row h: 32 bfloat16), its running maximum moved (and
 * its sums rescaled) where a score passes it by more than PF_RESCALE_LOG2. */
static void damx_step_weights(const struct damx_state *st, int64_t H, int64_t KV, int64_t D, const int64_t *slots,
                              float scale) {
    const int64_t G = H / KV;
    const __m512 sc = _mm512_set1_ps(scale * 1.4426950408889634f), none = _mm512_set1_ps(-INFINITY);
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    __mmask16 in[2] = {0, 0};
    for (int i = 0; i < DAMX_KEYS; i++)
        if (slots[i] >= 0) in[i / 16] |= (__mmask16)(1u << (i % 16));
    for (int64_t h = 0; h < H; h++) {
        const float *s = st->scores + (h / G) * 2 * 256 + h % G;
        __m512 x[2];
        for (int half = 0; half < 2; half++)
            x[half] = in[half] ? _mm512_mask_mul_ps(none, in[half], _mm512_i32gather_ps(column, s + half * 256, 4), sc)
                               : none;
        const float most = _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1]));
        if (most > st->top[h] + PF_RESCALE_LOG2) {
            if (st->top[h] > -INFINITY) { /* nothing to rescale before the first weight */
                const float alpha = exp2f(st->top[h] - most);
                st->sum[h] *= alpha;
                for (int64_t d = 0; d < D; d += 16)
                    _mm512_storeu_ps(st->acc + h * D + d, _mm512_mul_ps(_mm512_loadu_ps(st->acc + h * D + d),
                                                                         _mm512_set1_ps(alpha)));
            }
            st->top[h] = most;
        }
        const __m512 top = _mm512_set1_ps(st->top[h]);
        __m512 total = _mm512_setzero_ps();
        for (int half = 0; half < 2; half++) {
            const __m512 w = _mm512_maskz_mov_ps(in[half], pf_exp2(_mm512_sub_ps(x[half], top)));
            const __m512i bits = bf16_bits_avx512(w);
            total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
            _mm256_storeu_si256((__m256i *)(st->p + h * DAMX_KEYS + half * 16), _mm512_cvtepi32_epi16(bits));
        }
        st->sum[h] += _mm512_reduce_add_ps(total);
    }
}

#define DAMX_ACC(tile, t)                                                      \
    do {                                                                     \
        float *a = acc + (t) * 16;                                           \
        _tile_loadd(tile, a, D * 4);                                         \
        _tile_loadd(4, st->vt + (t) * 512, 64);                              \
        _tile_dpbf16ps(tile, 3, 4);                                          \
        _tile_stored(tile, a, D * 4);                                        \
    } while (0)

/* Every KV head's sums += P . V for the step's keys (keys out of range weigh 0 and their values
 * are taken as 0: stale slots may hold anything). */
static void damx_step_values(const struct damx_state *st, int64_t H, int64_t KV, int64_t D, const uint16_t *cache,
                             const int64_t *slots) {
    const int64_t G = H / KV;
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t g = 0; g < KV; g++) {
        for (int64_t pair = 0; pair < 16; pair++) {
            const int64_t a_slot = slots[2 * pair], b_slot = slots[2 * pair + 1];
            const uint16_t *va = a_slot >= 0 ? cache + (a_slot * 2 * KV + KV + g) * D : NULL;
            const uint16_t *vb = b_slot >= 0 ? cache + (b_slot * 2 * KV + KV + g) * D : NULL;
            for (int64_t c = 0; c < D / 32; c++) {
                const __m512i a = va ? _mm512_loadu_si512(va + c * 32) : zero;
                const __m512i b = vb ? _mm512_loadu_si512(vb + c * 32) : zero;
                _mm512_storeu_si512(st->vt + (2 * c) * 512 + pair * 32, _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512(st->vt + (2 * c + 1) * 512 + pair * 32, _mm512_unpackhi_epi16(a, b));
            }
        }
        float *acc = st->acc + g * G * D;
        _tile_loadd(3, st->p + g * G * DAMX_KEYS, DAMX_KEYS * 2);
        for (int64_t t = 0; t < D / 16; t++) {
            if (t % 3 == 0) DAMX_ACC(5, t);
            else if (t % 3 == 1) DAMX_ACC(6, t);
            else DAMX_ACC(7, t);
        }
    }
}

#undef DAMX_ACC

/* One task: the row whose query heads start at q, keys [jb, je) of its context, all KV heads. */
static void damx_attend(const uint16_t *q, int64_t H, int64_t KV, int64_t D, const uint16_t *cache,
                        int64_t block_size, const int64_t *table, int64_t jb, int64_t je, float scale, uint16_t *out,
                        float *parts_base, int64_t part_stride, char *work) {
    const int64_t G = H / KV, slot_bytes = 2 * KV * D * 2;
    const struct damx_state st = damx_state_in(work, H, KV, D);
    for (int64_t h = 0; h < H; h++) st.top[h] = -INFINITY, st.sum[h] = 0.0f;
    memset(st.acc, 0, H * D * sizeof(float));
    for (int64_t g = 0; g < KV; g++) pf_pack_queries(q + g * G * D, D, G, D, st.qt + g * (D / 2) * 16);
    damx_configure(G);
    int64_t slots[DAMX_KEYS];
    for (int64_t s0 = jb / DAMX_KEYS * DAMX_KEYS; s0 < je; s0 += DAMX_KEYS) {
        for (int64_t ahead = s0 + DAMX_AHEAD * DAMX_KEYS; ahead < s0 + (DAMX_AHEAD + 1) * DAMX_KEYS && ahead < je;
             ahead += 16) { /* all heads' keys and values of a later step, into this core's cache */
            const char *group = (const char *)(cache + (table[ahead / block_size] * block_size + ahead % block_size)
                                                           * 2 * KV * D);
            for (int64_t line = 0; line < 16 * slot_bytes; line += 64) _mm_prefetch(group + line, _MM_HINT_T1);
        }
        damx_step_slots(table, block_size, s0, jb, je, slots);
        damx_step_scores(&st, KV, D, cache, slots);
        damx_step_weights(&st, H, KV, D, slots, scale);
        damx_step_values(&st, H, KV, D, cache, slots);
    }
    float o[PF_MAX_HEAD_DIM];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t t = 0; t < D / 16; t++)
            for (int64_t n = 0; n < 16; n++) o[damx_dim(t, n)] = st.acc[h * D + t * 16 + n];
        if (parts_base) { /* the part of KV head h / G, as the merge lays them out */
            float *base = parts_base + (h / G) * part_stride;
            base[h % G] = st.top[h] * 0.6931471805599453f; /* natural-log units */
            base[G + h % G] = st.sum[h];
            memcpy(base + 2 * G + (h % G) * D, o, D * sizeof(float));
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / st.sum[h]);
        for (int64_t d = 0; d < D; d += 16)
            store_row_avx512(out + h * D, d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv), 1);
    }
}

/* Rows of R queries (q: rows of q_stride, heads side by side) over their contexts; out [R, H * D].
 * -2 where memory is short (the caller then uses the vector kernel). */
static int amx_decode_attention(int threads, const uint16_t *q, int64_t q_stride, int64_t R, int64_t H, int64_t KV,
                                int64_t D, const uint16_t *cache, int64_t block_size, const int64_t *tables,
                                int64_t max_blocks, const int64_t *lens, int64_t window, float scale, uint16_t *out) {
    const int64_t G = H / KV, parts = attention_parts(R, 1, lens, window, threads), part_floats = G * (D + 2);
    float *scratch = parts > 1 ? malloc(R * KV * parts * part_floats * sizeof(float)) : NULL;
    if (parts > 1 && !scratch) return -2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        char *work = aligned_alloc(64, (damx_state_bytes(H, KV, D) + 63) / 64 * 64);
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < R * parts; task++) {
            const int64_t r = task / parts, c = task % parts, first = window_start(lens[r], window);
            const int64_t jb = first + (lens[r] - first) * c / parts, je = first + (lens[r] - first) * (c + 1) / parts;
            float *parts_base = scratch ? scratch + (r * KV * parts + c) * part_floats : NULL;
            if (!work) continue;
            if (je > jb) {
                damx_attend(q + r * q_stride, H, KV, D, cache, block_size, tables + r * max_blocks, jb, je, scale,
                            out + r * H * D, parts_base, parts * part_floats, work);
                continue;
            }
            for (int64_t g = 0; g < KV; g++) { /* an empty part */
                float *base = parts_base + g * parts * part_floats;
                for (int64_t h = 0; h < G; h++) base[h] = -INFINITY, base[G + h] = 0.0f;
                memset(base + 2 * G, 0, G * D * sizeof(float));
            }
        }
        _tile_release();
        free(work);
    }
    if (!failed && scratch) merge_parts_avx512(scratch, R, H, KV, D, parts, out, 1);
    free(scratch);
    return failed ? -2 : 0;
}

#pragma GCC pop_options
