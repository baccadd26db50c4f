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
 * for each of the 16 rows (zero past M). */
static void qamx_pack_rows(const uint16_t *x, int64_t M, int64_t K, uint32_t *xt, int64_t mblocks) {
    const int64_t groups = K / 32;
    memset(xt, 0, mblocks * groups * 256 * sizeof(uint32_t));
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *pairs = (const uint32_t *)(x + m * K);
        uint32_t *to = xt + (m / 16) * groups * 256 + m % 16;
        for (int64_t i = 0; i < K / 2; i++) to[(i / 16) * 256 + (i % 16) * 16] = pairs[i];
    }
}

/* Group g of weight rows n0 .. n0 + rows - 1 in bfloat16, one row of 32 a tile row (zero past the
 * weight's last row). */
static inline void qamx_expand(int bits, const uint8_t *qs, const uint16_t *wd, const uint16_t *wm, int64_t K,
                               int64_t n0, int64_t rows, int64_t g, uint16_t *tile) {
    const int64_t groups = K / 32;
    for (int64_t r = 0; r < 16; r++) {
        __m512 lo, hi;
        if (r >= rows) {
            lo = hi = _mm512_setzero_ps();
        } else {
            const int64_t n = n0 + r;
            const __m512 d = _mm512_set1_ps(_cvtsh_ss(wd[n * groups + g]));
            if (bits == 4) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + n * K / 2 + g * 16)));
                const __m512 m = _mm512_set1_ps(_cvtsh_ss(wm[n * groups + g]));
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

/* The 16 x 16 results of tile `c` (outputs n0.., rows 16 * mb..) into y [M, N] bfloat16. */
static inline void qamx_store(const float *c, uint16_t *y, int64_t M, int64_t N, int64_t n0, int64_t rows,
                              int64_t mb) {
    for (int64_t m = mb * 16; m < M && m < mb * 16 + 16; m++)
        for (int64_t r = 0; r < rows; r++) y[m * N + n0 + r] = f32_to_bf16(c[r * 16 + m % 16]);
}

static int qamx_matmul(int threads, int bits, const uint16_t *x, int64_t M, int64_t K, const uint8_t *qs,
                       const uint16_t *wd, const uint16_t *wm, int64_t N, uint16_t *y) {
    const int64_t mblocks = (M + 15) / 16, groups = K / 32, tasks = (N + 15) / 16;
    uint32_t *xt = malloc(mblocks * groups * 256 * sizeof(uint32_t));
    if (!xt) return -2;
    qamx_pack_rows(x, M, K, xt, mblocks);
#pragma omp parallel num_threads(threads)
    {
        amx_configure(); /* tiles: 0 weights, 1 rows, 4-7 results */
        uint16_t tile[16 * 32] __attribute__((aligned(64)));
        float c[256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t n0 = task * 16, rows = N - n0 < 16 ? N - n0 : 16;
            for (int64_t mb = 0; mb < mblocks; mb += 4) { /* 64 rows at a time, each expanding the weight */
                const int64_t blocks = mblocks - mb < 4 ? mblocks - mb : 4;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                for (int64_t g = 0; g < groups; g++) {
                    qamx_expand(bits, qs, wd, wm, K, n0, rows, g, tile);
                    _tile_loadd(0, tile, 64);
                    const uint32_t *at = xt + (mb * groups + g) * 256;
                    _tile_loadd(1, at, 64);
                    _tile_dpbf16ps(4, 0, 1);
                    if (blocks > 1) {
                        _tile_loadd(1, at + groups * 256, 64);
                        _tile_dpbf16ps(5, 0, 1);
                    }
                    if (blocks > 2) {
                        _tile_loadd(1, at + 2 * groups * 256, 64);
                        _tile_dpbf16ps(6, 0, 1);
                    }
                    if (blocks > 3) {
                        _tile_loadd(1, at + 3 * groups * 256, 64);
                        _tile_dpbf16ps(7, 0, 1);
                    }
                }
                _tile_stored(4, c, 64);
                qamx_store(c, y, M, N, n0, rows, mb);
                if (blocks > 1) {
                    _tile_stored(5, c, 64);
                    qamx_store(c, y, M, N, n0, rows, mb + 1);
                }
                if (blocks > 2) {
                    _tile_stored(6, c, 64);
                    qamx_store(c, y, M, N, n0, rows, mb + 2);
                }
                if (blocks > 3) {
                    _tile_stored(7, c, 64);
                    qamx_store(c, y, M, N, n0, rows, mb + 3);
                }
            }
        }
        _tile_release();
    }
    free(xt);
    return 0;
}

#pragma GCC pop_options
