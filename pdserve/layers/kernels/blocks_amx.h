/* Products of a few bfloat16 rows with weights in GGUF's block formats (blocks.c) on AMX tiles,
 * included by ops.c after qmatmul_amx.h, whose packing of the rows and storing of results it shares.
 *
 * A decode batch of 4-64 rows makes the byte dot products compute-bound (their cost grows with
 * the rows), and a dense product would read the weight expanded to 16 bits. Here each 16 weight
 * rows are expanded a block of up to 256 elements at a time (blocks.c's own expansion, gguf's
 * values rounded to bfloat16) into an L1 buffer and multiplied there by every row at once,
 * y^T = W . x^T as in qmatmul_amx.h: the weight is read in the file's bytes, once. A fused weight's
 * parts (different formats) are one list of 16-row tasks. */

#define BAMX_MAX_PARTS 8

void pd_block_expand(int isa, int format, const uint8_t *w, int64_t row_bytes, int64_t rows, int64_t k0, int64_t len,
                     uint16_t *out);
int64_t pd_block_row_bytes(int format, int64_t K);

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")

/* Expanded group gi of buffer `b` (tile W) times group g of row tiles mb.. into results 4-7. */
#define BAMX_PRODUCTS(W)                                              \
    do {                                                              \
        _tile_loadd(W, b + gi * 32, 512);                             \
        const uint32_t *at = xt + (mb * groups + g) * 256;            \
        _tile_loadd(1, at, 64);                                       \
        _tile_dpbf16ps(4, W, 1);                                      \
        if (count > 1) {                                              \
            _tile_loadd(3, at + groups * 256, 64);                    \
            _tile_dpbf16ps(5, W, 3);                                  \
        }                                                             \
        if (count > 2) {                                              \
            _tile_loadd(1, at + 2 * groups * 256, 64);                \
            _tile_dpbf16ps(6, W, 1);                                  \
        }                                                             \
        if (count > 3) {                                              \
            _tile_loadd(3, at + 3 * groups * 256, 64);                \
            _tile_dpbf16ps(7, W, 3);                                  \
        }                                                             \
    } while (0)

/* y [M, ldy] bfloat16 = x [M, K] bfloat16 @ the parts' rows^T; -2 when memory is short. */
static int bamx_matmul(int isa, int threads, int64_t nparts, const int64_t *formats, const int64_t *rows,
                       const void *const *data, const uint16_t *x, int64_t M, int64_t K, uint16_t *y, int64_t ldy) {
    const int64_t mblocks = (M + 15) / 16, groups = K / 32;
    int64_t first[BAMX_MAX_PARTS + 1], column[BAMX_MAX_PARTS], tasks = 0, width = 0;
    for (int64_t p = 0; p < nparts; p++) {
        first[p] = tasks, column[p] = width;
        tasks += (rows[p] + 15) / 16, width += rows[p];
    }
    first[nparts] = tasks;
    uint32_t *xt = malloc(mblocks * groups * 256 * sizeof(uint32_t));
    if (!xt) return -2;
#pragma omp parallel num_threads(threads)
    {
        amx_configure(); /* tiles: 0 and 2 weights, 1 and 3 rows, 4-7 results */
        uint16_t buf[2][16 * 256] __attribute__((aligned(64)));
        float c[256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < mblocks * groups; i++) qamx_pack_rows(x, M, K, i / groups, i % groups, xt);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t p = 0;
            while (task >= first[p + 1]) p++;
            const int format = (int)formats[p];
            const int64_t n0 = (task - first[p]) * 16, n = rows[p] - n0 < 16 ? rows[p] - n0 : 16;
            const int64_t row_bytes = pd_block_row_bytes(format, K);
            const uint8_t *w = (const uint8_t *)data[p] + n0 * row_bytes;
            for (int64_t mb = 0; mb < mblocks; mb += 4) { /* 64 rows at a time, each expanding the weight */
                const int64_t count = mblocks - mb < 4 ? mblocks - mb : 4;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                for (int64_t k0 = 0; k0 < K; k0 += 256) {
                    const int64_t len = K - k0 < 256 ? K - k0 : 256;
                    const uint16_t *b = buf[(k0 / 256) & 1];
                    pd_block_expand(isa, format, w, row_bytes, n, k0, len, buf[(k0 / 256) & 1]);
                    for (int64_t gi = 0; gi < len / 32; gi++) {
                        const int64_t g = k0 / 32 + gi;
                        if (gi & 1) BAMX_PRODUCTS(2);
                        else BAMX_PRODUCTS(0);
                    }
                }
                _tile_stored(4, c, 64);
                qamx_store(c, y + column[p], M, ldy, n0, n, mb);
                if (count > 1) {
                    _tile_stored(5, c, 64);
                    qamx_store(c, y + column[p], M, ldy, n0, n, mb + 1);
                }
                if (count > 2) {
                    _tile_stored(6, c, 64);
                    qamx_store(c, y + column[p], M, ldy, n0, n, mb + 2);
                }
                if (count > 3) {
                    _tile_stored(7, c, 64);
                    qamx_store(c, y + column[p], M, ldy, n0, n, mb + 3);
                }
            }
        }
        _tile_release();
    }
    free(xt);
    return 0;
}

#undef BAMX_PRODUCTS

#pragma GCC pop_options
