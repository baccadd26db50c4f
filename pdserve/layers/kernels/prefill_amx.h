/* Causal attention of a prefill chunk over the paged KV cache on AMX tiles (bfloat16 products,
 * float32 sums), in the layouts of attention_bf16.h.
 *
 * torch's CPU flash attention needs the context gathered out of the paged cache, packs K and V
 * for every query block and head, and computes whole key blocks of 512 past the diagonal. This
 * kernel reads K from the cache in place, packs each KV head's V once per call straight from the
 * block table (shared by the query heads of that KV head), and stops each query block at its last
 * visible key (32 keys at a time). A task's scores for 32 keys are two 16 x 16 tiles, its online
 * softmax runs in AVX-512 vectors, and its running output is held in tiles for heads of up to 64. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 16 rows of 64 bytes. Scores: 0 keys, 1 queries, 2 scores. P.V: 4 P, 0 values, and
 * the output in 3, 5, 6, 7 (heads of up to 64; larger ones: 0 and 5 values, 6-7 a product). */
static void amx_configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* The output^T of a task with D <= 64 stays in tiles 3, 5, 6, 7 (16 head dimensions each) across
 * its steps; larger heads go through memory a product at a time. */
#define AMX_OUT_TILES 4

static inline void amx_out_store(float *acc, int64_t tiles) {
    _tile_stored(3, acc, 64);
    if (tiles > 1) _tile_stored(5, acc + 256, 64);
    if (tiles > 2) _tile_stored(6, acc + 512, 64);
    if (tiles > 3) _tile_stored(7, acc + 768, 64);
}

static inline void amx_out_load(const float *acc, int64_t tiles) {
    _tile_loadd(3, acc, 64);
    if (tiles > 1) _tile_loadd(5, acc + 256, 64);
    if (tiles > 2) _tile_loadd(6, acc + 512, 64);
    if (tiles > 3) _tile_loadd(7, acc + 768, 64);
}

/* One task: queries r0 .. r0 + rows - 1 of the chunk for head h. */
static void amx_attend_block(const uint16_t *q, int64_t q_stride, int64_t h, int64_t G, int64_t KV, int64_t D,
                             int64_t r0, int64_t rows, int64_t first_pos, const uint16_t *cache, int64_t block_size,
                             const int64_t *table, const uint16_t *vpack, int64_t steps, float scale, uint16_t *out,
                             int64_t out_stride) {
    const int64_t g = h / G, slot_bytes = 2 * KV * D * 2, dtiles = D / 16;
    const int in_tiles = dtiles <= AMX_OUT_TILES;
    float scores[PF_KEYS * 16], part[2 * 16 * 16], acc[PF_MAX_HEAD_DIM * 16];
    uint32_t qt[PF_MAX_HEAD_DIM / 2 * 16], pt[16 * 16];
    pf_pack_queries(q + r0 * q_stride + h * D, q_stride, rows, D, qt);
    memset(acc, 0, D * 16 * sizeof(float));
    if (in_tiles) amx_out_load(acc, dtiles);
    __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    /* scores in log2 units: the weights are powers of two */
    const __m512 sc = _mm512_set1_ps(scale * 1.4426950408889634f);
    const __mmask16 present = rows == 16 ? 0xffff : (__mmask16)((1u << rows) - 1);
    const int64_t base = first_pos + r0; /* query r's position is base + r */
    const int64_t last_pos = base + rows - 1, last = last_pos / PF_KEYS; /* the last step any query sees */
    for (int64_t b = 0; b <= last; b++) {
        for (int half = 0; half < 2; half++) {
            const int64_t key = b * PF_KEYS + half * 16;
            _tile_zero(2);
            if (key <= last_pos) { /* else past the context (and its block table): masked out below */
                const char *k = (const char *)(cache + ((table[key / block_size] * block_size + key % block_size)
                                                        * 2 * KV + g) * D);
                for (int64_t c = 0; c < D / 32; c++) {
                    _tile_loadd(0, k + c * 64, slot_bytes);
                    _tile_loadd(1, qt + c * 256, 64);
                    _tile_dpbf16ps(2, 0, 1);
                }
            }
            _tile_stored(2, scores + half * 256, 64);
        }
        __m512 s[PF_KEYS];
        for (int j = 0; j < PF_KEYS; j++) s[j] = _mm512_loadu_ps(scores + j * 16);
        __mmask16 seen[PF_KEYS];
        const __m512 step_top = pf_mask_scores(s, seen, b, base, present, sc);
        if (_mm512_cmp_ps_mask(step_top, _mm512_add_ps(top, _mm512_set1_ps(PF_RESCALE_LOG2)), _CMP_GT_OQ)) {
            const __m512 new_top = _mm512_max_ps(top, step_top), alpha = pf_rescale(top, new_top);
            sum = _mm512_mul_ps(sum, alpha);
            if (in_tiles) amx_out_store(acc, dtiles);
            for (int64_t d = 0; d < D; d++) _mm512_storeu_ps(acc + d * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + d * 16), alpha));
            if (in_tiles) amx_out_load(acc, dtiles);
            top = new_top;
        }
        pf_step_weights(s, seen, top, &sum, pt);
        _tile_loadd(4, pt, 64);
        if (in_tiles) {
            _tile_loadd(0, pf_v_tile((uint16_t *)vpack, g, b, 0, steps, D), 64);
            _tile_dpbf16ps(3, 0, 4);
            if (dtiles > 1) {
                _tile_loadd(0, pf_v_tile((uint16_t *)vpack, g, b, 1, steps, D), 64);
                _tile_dpbf16ps(5, 0, 4);
            }
            if (dtiles > 2) {
                _tile_loadd(0, pf_v_tile((uint16_t *)vpack, g, b, 2, steps, D), 64);
                _tile_dpbf16ps(6, 0, 4);
            }
            if (dtiles > 3) {
                _tile_loadd(0, pf_v_tile((uint16_t *)vpack, g, b, 3, steps, D), 64);
                _tile_dpbf16ps(7, 0, 4);
            }
            continue;
        }
        for (int64_t dc = 0; dc < dtiles; dc += 2) {
            _tile_zero(6);
            _tile_zero(7);
            _tile_loadd(5, pf_v_tile((uint16_t *)vpack, g, b, dc, steps, D), 64);
            _tile_loadd(0, pf_v_tile((uint16_t *)vpack, g, b, dc + 1, steps, D), 64);
            _tile_dpbf16ps(6, 5, 4);
            _tile_dpbf16ps(7, 0, 4);
            _tile_stored(6, part, 64);
            _tile_stored(7, part + 256, 64);
            for (int64_t d = 0; d < 32; d++) {
                float *a = acc + (dc * 16 + d) * 16;
                _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(part + d * 16)));
            }
        }
    }
    if (in_tiles) amx_out_store(acc, dtiles);
    pf_store_rows(acc, sum, rows, D, out + r0 * out_stride + h * D, out_stride);
}

static int amx_prefill_attention(int threads, const uint16_t *q, int64_t q_stride, int64_t query_len, int64_t H,
                                 int64_t KV, int64_t D, const uint16_t *cache, int64_t block_size,
                                 const int64_t *table, int64_t ctx, float scale, uint16_t *out, int64_t out_stride) {
    const int64_t steps = (ctx + PF_KEYS - 1) / PF_KEYS, G = H / KV;
    uint16_t *vpack = malloc(KV * steps * PF_KEYS * D * 2);
    if (!vpack) return -2;
    pf_pack_values(cache, KV, D, block_size, table, ctx, steps, vpack, threads);
    const int64_t qblocks = (query_len + PF_QROWS - 1) / PF_QROWS, first_pos = ctx - query_len;
#pragma omp parallel num_threads(threads)
    {
        amx_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < H * qblocks; task++) { /* the longest (last) query blocks first */
            const int64_t h = task % H, qb = qblocks - 1 - task / H, r0 = qb * PF_QROWS;
            const int64_t rows = query_len - r0 < PF_QROWS ? query_len - r0 : PF_QROWS;
            amx_attend_block(q, q_stride, h, G, KV, D, r0, rows, first_pos, cache, block_size, table, vpack, steps,
                             scale, out, out_stride);
        }
        _tile_release();
    }
    free(vpack);
    return 0;
}

#pragma GCC pop_options

/* Whether this CPU has AMX for bfloat16 (with AVX512-BF16 for its conversions) and the kernel lets
 * this process use it. */
static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned eax, ebx, ecx, edx;
        __cpuid_count(7, 0, eax, ebx, ecx, edx);
        const int cpu = (edx >> 22 & 1) && (edx >> 24 & 1); /* AMX-BF16, AMX-TILE */
        /* Linux hands out the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
        usable = cpu && syscall(SYS_arch_prctl, 0x1023, 18) == 0 && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512bf16");
    }
    return usable;
}
