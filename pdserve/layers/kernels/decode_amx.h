/* Decode attention (one new query a row) over the paged KV cache on AMX tiles, bfloat16; included
 * by ops.c after prefill_amx.h, whose tile configuration, query packing and 2^x it uses.
 *
 * In vectors a decode step's attention is arithmetic-bound: each cached key and value is widened
 * to float32 and multiplied once per query head of its group, about 11 GB/s on two cores where
 * the memory gives twice that. On tiles a task is one row's KV head (its G query heads) over a
 * range of its context, in two passes:
 * - scores^T = K . Q^T, 16 keys a product, K read from the cache in place (the 16 slots of an
 *   aligned group of keys lie at one stride in one block); each head's scores gathered into a row;
 * - a softmax along each head's row, its weights rounded to bfloat16 (the sum is taken of the
 *   rounded weights, so that a weight alone keeps its value's exactly);
 * - out = P . V, 32 keys a product: V's rows interleaved by key pairs as the right operand needs
 *   them (an unpack, which permutes the head dimensions within each 32: undone at the end).
 * A task leaves its heads' outputs, or for the merge of a context split among threads its part
 * (attn_part, in natural-log units as the vector kernels' parts). */

#define DAMX_DIMS 64 /* head dimensions a pass over V sums in tiles: four 16-wide outputs */
#define DAMX_PAD 16  /* floats before each score row: a group of 16 keys may start before a task's range */
#define DAMX_AHEAD 2 /* groups of 16 keys a task's first head fetches ahead of its scores */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,amx-tile,amx-bf16")

/* P.V: tile 0 P [G heads, 32 keys], 1 V [16 key pairs, 16 dims, 2], 2-5 the output [G, 16 dims]. */
static void damx_configure_values(int64_t G) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = t == 1 ? 16 : (uint8_t)G, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Scores of the task's keys [jb, je) into p (row h at h * stride, key jb + i at DAMX_PAD + i), in
 * log2 units. Tiles as amx_configure sets them: 0 keys, 1 queries, 2 scores. */
static void damx_scores(const uint32_t *qt, int64_t G, int64_t KV, int64_t D, int64_t g, const uint16_t *cache,
                        int64_t block_size, const int64_t *table, int64_t jb, int64_t je, float scale, float *p,
                        int64_t stride, int fetch) {
    const int64_t slot_bytes = 2 * KV * D * 2;
    const __m512 sc = _mm512_set1_ps(scale * 1.4426950408889634f);
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    float s[256];
    for (int64_t k0 = jb / 16 * 16; k0 < je; k0 += 16) {
        const int64_t ahead = k0 + DAMX_AHEAD * 16;
        if (fetch && ahead < je) { /* all heads' keys and values of a later group, into this core's cache */
            const char *slots = (const char *)(cache + (table[ahead / block_size] * block_size + ahead % block_size) * 2 * KV * D);
            for (int64_t line = 0; line < 16 * slot_bytes; line += 64) _mm_prefetch(slots + line, _MM_HINT_T1);
        }
        const char *k = (const char *)(cache + ((table[k0 / block_size] * block_size + k0 % block_size) * 2 * KV + g) * D);
        _tile_zero(2);
        for (int64_t c = 0; c < D / 32; c++) {
            _tile_loadd(0, k + c * 64, slot_bytes);
            _tile_loadd(1, qt + c * 256, 64);
            _tile_dpbf16ps(2, 0, 1);
        }
        _tile_stored(2, s, 64);
        /* keys of the group outside the range (stale slots past the context too) are never stored */
        const int64_t lo = k0 < jb ? jb - k0 : 0, hi = je - k0 < 16 ? je - k0 : 16;
        const __mmask16 keep = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
        for (int64_t h = 0; h < G; h++)
            _mm512_mask_storeu_ps(p + h * stride + DAMX_PAD + (k0 - jb), keep,
                                  _mm512_mul_ps(_mm512_i32gather_ps(column, s + h, 4), sc));
    }
}

/* Each head's weights 2^(score - its largest) as bfloat16 into w (row h at h * wstride, zero past
 * len to a whole number of 32); top[h] its largest score, sum[h] the sum of its rounded weights. */
static void damx_weights(const float *p, int64_t stride, int64_t G, int64_t len, uint16_t *w, int64_t wstride,
                         float *top, float *sum) {
    const int64_t padded = (len + 31) / 32 * 32;
    for (int64_t h = 0; h < G; h++) {
        const float *row = p + h * stride + DAMX_PAD;
        __m512 t = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < len; i += 16) {
            const __mmask16 m = len - i >= 16 ? 0xffff : (__mmask16)((1u << (len - i)) - 1);
            t = _mm512_max_ps(t, _mm512_mask_loadu_ps(t, m, row + i));
        }
        top[h] = _mm512_reduce_max_ps(t);
        const __m512 most = _mm512_set1_ps(top[h]);
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < padded; i += 16) {
            const __mmask16 m = len - i >= 16 ? 0xffff : len > i ? (__mmask16)((1u << (len - i)) - 1) : 0;
            const __m512 x = _mm512_maskz_mov_ps(m, amx_exp2(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), most)));
            const __m512i bits = bf16_bits_avx512(x);
            total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
            _mm256_storeu_si256((__m256i *)(w + h * wstride + i), _mm512_cvtepi32_epi16(bits));
        }
        sum[h] = _mm512_reduce_add_ps(total);
    }
}

/* Column n of output tile t (of a 64-dimension pass) holds this head dimension: the unpack of two
 * keys' rows interleaves them 128 bits at a time, low halves in even tiles, high in odd. */
static inline int64_t damx_dim(int64_t t, int64_t n) { return (t / 2) * 32 + (n / 4) * 8 + (t % 2) * 4 + n % 4; }

/* acc[h, d] (G x D, float32) = sum over keys [jb, jb + len) of w[h, key] V[key, d]. Tiles as
 * damx_configure_values sets them. */
static void damx_values(const uint16_t *w, int64_t wstride, int64_t G, int64_t KV, int64_t D, int64_t g,
                        const uint16_t *cache, int64_t block_size, const int64_t *table, int64_t jb, int64_t len,
                        float *acc) {
    uint16_t vt[4 * 512]; /* V of 32 keys as the right operand: per 16 dims, 16 key pairs of 16 dims x 2 */
    float o[4 * 16 * 16];
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t d0 = 0; d0 < D; d0 += DAMX_DIMS) {
        const int64_t tiles = (D - d0 < DAMX_DIMS ? D - d0 : DAMX_DIMS) / 16; /* 2 or 4: D is a multiple of 32 */
        _tile_zero(2);
        _tile_zero(3);
        if (tiles > 2) {
            _tile_zero(4);
            _tile_zero(5);
        }
        struct slot_cursor at = {table, block_size, jb / block_size, jb % block_size};
        for (int64_t i0 = 0; i0 < len; i0 += 32) {
            for (int64_t pair = 0; pair < 16; pair++) {
                const uint16_t *v[2];
                for (int b = 0; b < 2; b++) /* keys past the range weigh 0: their values are 0, not stale */
                    v[b] = i0 + 2 * pair + b < len ? cache + (next_slot(&at) * 2 * KV + KV + g) * D + d0 : NULL;
                for (int64_t c = 0; c < tiles / 2; c++) {
                    const __m512i a = v[0] ? _mm512_loadu_si512(v[0] + c * 32) : zero;
                    const __m512i b = v[1] ? _mm512_loadu_si512(v[1] + c * 32) : zero;
                    _mm512_storeu_si512(vt + (2 * c) * 512 + pair * 32, _mm512_unpacklo_epi16(a, b));
                    _mm512_storeu_si512(vt + (2 * c + 1) * 512 + pair * 32, _mm512_unpackhi_epi16(a, b));
                }
            }
            _tile_loadd(0, w + i0, wstride * 2);
            _tile_loadd(1, vt, 64);
            _tile_dpbf16ps(2, 0, 1);
            _tile_loadd(1, vt + 512, 64);
            _tile_dpbf16ps(3, 0, 1);
            if (tiles > 2) {
                _tile_loadd(1, vt + 1024, 64);
                _tile_dpbf16ps(4, 0, 1);
                _tile_loadd(1, vt + 1536, 64);
                _tile_dpbf16ps(5, 0, 1);
            }
        }
        _tile_stored(2, o, 64);
        _tile_stored(3, o + 256, 64);
        if (tiles > 2) {
            _tile_stored(4, o + 512, 64);
            _tile_stored(5, o + 768, 64);
        }
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t h = 0; h < G; h++)
                for (int64_t n = 0; n < 16; n++) acc[h * D + d0 + damx_dim(t, n)] = o[t * 256 + h * 16 + n];
    }
}

/* One task: KV head g of the row whose query heads start at q, over keys [jb, je) of its context.
 * work: room for damx_work_floats(G, D, je - jb). */
static int64_t damx_work_floats(int64_t G, int64_t D, int64_t len) {
    const int64_t stride = DAMX_PAD + (len + 31) / 32 * 32 + 16;
    return G * stride + G * ((len + 31) / 32 * 32) / 2 + G * D;
}

static void damx_attend(const uint16_t *q, int64_t G, int64_t KV, int64_t D, int64_t g, const uint16_t *cache,
                        int64_t block_size, const int64_t *table, int64_t jb, int64_t je, float scale,
                        uint16_t *out, const struct attn_part *part, float *work) {
    const int64_t len = je - jb, wstride = (len + 31) / 32 * 32, stride = DAMX_PAD + wstride + 16;
    float *p = work, *acc = p + G * stride, top[16], sum[16];
    uint16_t *w = (uint16_t *)(acc + G * D);
    uint32_t qt[AMX_MAX_HEAD_DIM / 2 * 16];
    amx_configure();
    amx_pack_queries(q, D, G, D, qt);
    damx_scores(qt, G, KV, D, g, cache, block_size, table, jb, je, scale, p, stride, g == 0);
    damx_weights(p, stride, G, len, w, wstride, top, sum);
    damx_configure_values(G);
    damx_values(w, wstride, G, KV, D, g, cache, block_size, table, jb, len, acc);
    for (int64_t h = 0; h < G; h++) {
        if (part) {
            part->top[h] = top[h] * 0.6931471805599453f; /* natural-log units, as the merge takes them */
            part->sum[h] = sum[h];
            memcpy(part->acc + h * D, acc + h * D, D * sizeof(float));
            continue;
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sum[h]);
        for (int64_t d = 0; d < D; d += 16)
            store_row_avx512(out + h * D, d, _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d), inv), 1);
    }
}

/* Rows of R queries (q: rows of q_stride, heads side by side) over their contexts; out [R, H * D].
 * A task is a row (or a part of its context) with all its KV heads, one after the other: a head's
 * keys and values share cache lines with the other heads', which the task then finds in its core's
 * cache. -2 where memory for the scores is short (the caller then uses the vector kernel). */
static int amx_decode_attention(int threads, const uint16_t *q, int64_t q_stride, int64_t R, int64_t H, int64_t KV,
                                int64_t D, const uint16_t *cache, int64_t block_size, const int64_t *tables,
                                int64_t max_blocks, const int64_t *lens, float scale, uint16_t *out) {
    const int64_t G = H / KV, parts = attention_parts(R, 1, lens, threads), part_floats = G * (D + 2);
    float *scratch = parts > 1 ? malloc(R * KV * parts * part_floats * sizeof(float)) : NULL;
    if (parts > 1 && !scratch) return -2;
    int64_t longest = 0;
    for (int64_t r = 0; r < R; r++) longest = lens[r] > longest ? lens[r] : longest;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *work = malloc(damx_work_floats(G, D, (longest + parts - 1) / parts + 1) * sizeof(float));
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < R * parts; task++) {
            const int64_t r = task / parts, c = task % parts, jb = lens[r] * c / parts, je = lens[r] * (c + 1) / parts;
            for (int64_t g = 0; work && g < KV; g++) {
                float *base = scratch ? scratch + ((r * KV + g) * parts + c) * part_floats : NULL;
                const struct attn_part part = {base, base ? base + G : NULL, base ? base + 2 * G : NULL};
                if (je > jb) {
                    damx_attend(q + r * q_stride + g * G * D, G, KV, D, g, cache, block_size, tables + r * max_blocks,
                                jb, je, scale, out + (r * H + g * G) * D, scratch ? &part : NULL, work);
                } else { /* an empty part */
                    for (int64_t h = 0; h < G; h++) part.top[h] = -INFINITY, part.sum[h] = 0.0f;
                    memset(part.acc, 0, G * D * sizeof(float));
                }
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
