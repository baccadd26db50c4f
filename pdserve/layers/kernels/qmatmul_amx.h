/* Products of a few rows with 4- and 8-bit weights (qmatmul.c's formats) on AMX tiles, included
 * by ops.c after prefill_amx.h, whose tile set-up it shares.
 *
 * A decode batch of 4-64 rows is too many for byte dot products (their cost grows with the rows)
 * and too few for a dense GEMM to pay for reading the weight expanded to bfloat16 (4x the bytes of
 * 4 bits). Here each group of 32 weights of 16 outputs is expanded to bfloat16 in a tile-sized
 * buffer (the same values as dequant.c's expansion: d * q + m in float32, rounded to nearest
 * even), and multiplied on AMX by the rows' activations at once: the weight is read in its own
 * bytes, once, whatever the number of rows. The product is taken transposed, y^T = W . x^T, so
 * the expanded rows are a tile's rows as they come; x^T is packed once per call in pairs of
 * elements along K (the layout of a tile's right operand). 64 rows (four result tiles) share each
 * expanded group; more rows expand the weight again for each 64. */

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

/* x^T of rows [16 * mb, 16 * mb + 16) for group g: row p holds elements (2p, 2p + 1) of the group
 * for each of the 16 rows (zero past M), gathered a row of the tile at a time. */
static inline void qamx_pack_rows(const uint16_t *x, int64_t M, int64_t K, int64_t mb, int64_t g, uint32_t *xt) {
    const int64_t groups = K / 32, rows = M - 16 * mb < 16 ? M - 16 * mb : 16;
    const __mmask16 present = rows == 16 ? 0xffff : (__mmask16)((1u << rows) - 1);
    const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)(K / 2)));
    const int *pairs = (const int *)(x + 16 * mb * K) + g * 16;
    uint32_t *to = xt + (mb * groups + g) * 256;
    for (int64_t p = 0; p < 16; p++)
        _mm512_storeu_si512(to + p * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, stride,
                                                                     pairs + p, 4));
}

/* The scales (and minimums) of weight rows n0 .. n0 + rows - 1 in float32, group-major within each
 * row (ds[r * groups + g]), converted once per task: a group's expansion then broadcasts them from
 * memory instead of converting a half-precision value per row and group. */
static inline void qamx_row_scales(const uint16_t *w, int64_t groups, int64_t n0, int64_t rows, float *ds) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *from = w + (n0 + r) * groups;
        float *to = ds + r * groups;
        int64_t g = 0;
        for (; g + 16 <= groups; g += 16)
            _mm512_storeu_ps(to + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(from + g))));
        for (; g < groups; g++) to[g] = _cvtsh_ss(from[g]);
    }
}

/* Group g of weight rows n0 .. n0 + rows - 1 in bfloat16, one row of 32 a tile row (zero past the
 * weight's last row); ds and ms are the rows' scales and minimums from qamx_row_scales. */
static inline void qamx_expand(int bits, const uint8_t *qs, const float *ds, const float *ms, int64_t K,
                               int64_t n0, int64_t rows, int64_t g, uint16_t *tile) {
    const int64_t groups = K / 32;
    for (int64_t r = 0; r < 16; r++) {
        __m512 lo, hi;
        if (r >= rows) {
            lo = hi = _mm512_setzero_ps();
        } else {
            const int64_t n = n0 + r;
            const __m512 d = _mm512_set1_ps(ds[r * groups + g]);
            if (bits == 4) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + n * K / 2 + g * 16)));
                const __m512 m = _mm512_set1_ps(ms[r * groups + g]);
                lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), d, m);
                hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
            } else {
                const int8_t *p = (const int8_t *)qs + n * K + g * 32;
                lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))), d);
                hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))),
                                   d);
            }
        }
        _mm512_storeu_si512(tile + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* The 16 x 16 results of tile `c` (outputs n0.., rows 16 * mb..) into y [M, N] bfloat16: each row's
 * outputs gathered from the tile's column and stored side by side. */
static inline void qamx_store(const float *c, uint16_t *y, int64_t M, int64_t N, int64_t n0, int64_t rows,
                              int64_t mb) {
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    const __mmask16 outputs = rows == 16 ? 0xffff : (__mmask16)((1u << rows) - 1);
    for (int64_t m = mb * 16; m < M && m < mb * 16 + 16; m++) {
        const __m512 v = _mm512_i32gather_ps(column, c + m % 16, 4);
        _mm256_mask_storeu_epi16(y + m * N + n0, outputs, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Weight tile W (0 or 2: consecutive groups alternate, so a group's expansion need not wait for
 * the previous group's products to have read its buffer) times the row tiles of group g. With one
 * or two row tiles (a decode batch of up to 32 rows), the groups of each parity also accumulate
 * apart (results 4 and 5 for even groups, 6 and 7 for odd ones, summed at the end), so that a
 * product need not wait for the one before it on the same result; with more, results 4-7 hold
 * row tiles 0-3. */
#define QAMX_PRODUCTS(W, R0, R1)                                          \
    do {                                                                  \
        _tile_loadd(W, tile[g & 1], 64);                                  \
        const uint32_t *at = xt + (mb * groups + g) * 256;                \
        _tile_loadd(1, at, 64);                                           \
        _tile_dpbf16ps(R0, W, 1);                                         \
        if (blocks > 1) {                                                 \
            _tile_loadd(3, at + groups * 256, 64);                        \
            _tile_dpbf16ps(R1, W, 3);                                     \
        }                                                                 \
        if (blocks > 2) {                                                 \
            _tile_loadd(1, at + 2 * groups * 256, 64);                    \
            _tile_dpbf16ps(6, W, 1);                                      \
        }                                                                 \
        if (blocks > 3) {                                                 \
            _tile_loadd(3, at + 3 * groups * 256, 64);                    \
            _tile_dpbf16ps(7, W, 3);                                      \
        }                                                                 \
    } while (0)

/* Result tile T of row tile mb + b, stored (added to `c` where `add`) into y once complete. */
#define QAMX_RESULT(T, b, add)                                                                  \
    do {                                                                                        \
        _tile_stored(T, add ? part : c, 64);                                                    \
        if (add)                                                                                \
            for (int i = 0; i < 256; i += 16)                                                   \
                _mm512_store_ps(c + i, _mm512_add_ps(_mm512_load_ps(c + i), _mm512_load_ps(part + i))); \
    } while (0)

static int qamx_matmul(int threads, int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *qs,
                       const uint16_t *wd, const uint16_t *wm, int64_t N, uint16_t *y) {
    const int64_t mblocks = (M + 15) / 16, groups = K / 32, tasks = (N + 15) / 16;
    uint32_t *xt = malloc(mblocks * groups * 256 * sizeof(uint32_t));
    /* each thread's scales and minimums of its task's 16 rows */
    float *scales = malloc((size_t)threads * 2 * 16 * groups * sizeof(float));
    if (!xt || !scales) {
        free(xt);
        free(scales);
        return -2;
    }
#pragma omp parallel num_threads(threads)
    {
        amx_configure(); /* tiles: 0 and 2 weights, 1 and 3 rows, 4-7 results */
        uint16_t tile[2][16 * 32] __attribute__((aligned(64)));
        float c[256] __attribute__((aligned(64))), part[256] __attribute__((aligned(64)));
        float *ds = scales + (size_t)omp_get_thread_num() * 2 * 16 * groups, *ms = ds + 16 * groups;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mblocks * groups; i++) qamx_pack_rows(x, M, K, i / groups, i % groups, xt);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t n0 = task * 16, rows = N - n0 < 16 ? N - n0 : 16;
            qamx_row_scales(wd, groups, n0, rows, ds);
            if (bits == 4) qamx_row_scales(wm, groups, n0, rows, ms);
            for (int64_t mb = 0; mb < mblocks; mb += 4) { /* 64 rows at a time, each expanding the weight */
                const int64_t blocks = mblocks - mb < 4 ? mblocks - mb : 4;
                const int split = blocks <= 2; /* even and odd groups accumulate apart */
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                for (int64_t g = 0; g < groups; g++) {
                    qamx_expand(bits, qs, ds, ms, K, n0, rows, g, tile[g & 1]);
                    if (!(g & 1))
                        QAMX_PRODUCTS(0, 4, 5);
                    else if (split)
                        QAMX_PRODUCTS(2, 6, 7);
                    else
                        QAMX_PRODUCTS(2, 4, 5);
                }
                QAMX_RESULT(4, 0, 0);
                if (split) QAMX_RESULT(6, 0, 1);
                qamx_store(c, y, M, N, n0, rows, mb);
                if (blocks > 1) {
                    QAMX_RESULT(5, 1, 0);
                    if (split) QAMX_RESULT(7, 1, 1);
                    qamx_store(c, y, M, N, n0, rows, mb + 1);
                }
                if (blocks > 2) {
                    QAMX_RESULT(6, 2, 0);
                    qamx_store(c, y, M, N, n0, rows, mb + 2);
                }
                if (blocks > 3) {
                    QAMX_RESULT(7, 3, 0);
                    qamx_store(c, y, M, N, n0, rows, mb + 3);
                }
            }
        }
        _tile_release();
    }
    free(scales);
    free(xt);
    return 0;
}

#undef QAMX_RESULT
#undef QAMX_PRODUCTS

#pragma GCC pop_options
