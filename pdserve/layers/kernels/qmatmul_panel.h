/* 4-bit products with output columns in the lanes, for batches of rows on AVX-512 VNNI: included
 * by qmatmul.c in its AVX-512 VNNI section.
 *
 * qmatmul_simd.h puts a row's K values in the lanes: each group of 32 ends in a sum across lanes,
 * scaled by its own pair of scales, and each pass over the weights unpacks them for two rows. Here
 * a vector holds 16 output columns (a panel of 16 weight rows), so one group's scaling serves 16
 * outputs, and a group's unpacked weights serve a block of up to PANEL_ROWS activation rows held in
 * registers. The weights are repacked once, at load (`pd_q4_panel_pack`):
 *   panel p, group g: 4 vectors of 16 lanes x 4 bytes; vector i, lane l, byte b holds weight row
 *   16 p + l's element g * 32 + 8 i + b in its low nibble and g * 32 + 8 i + 4 + b in its high one;
 *   scales and minimums widened to float32, [panel, group, 16].
 * A dpbusd of the low (or high) nibbles with 4 activation bytes broadcast adds 16 columns' sums of
 * 4 byte products. Activations are quantized as for qmatmul_simd.h (groups of 32, natural order),
 * so the result is the same sum in another order. */

#define PANEL 16     /* output columns a vector holds */
#define PANEL_ROWS 8 /* activation rows a group's unpacked weights serve */

/* The 16 lanes of v as bfloat16 (round to nearest even, NaN kept a NaN) or float32, into y. */
static inline void panel_store(void *y, int64_t offset, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)y + offset, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v), high = _mm512_srli_epi32(u, 16);
    __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                      _mm512_and_si512(high, _mm512_set1_epi32(1))), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + offset), _mm512_cvtepi32_epi16(bits));
}

/* y[m0 .. m0 + rows, 16 p .. 16 p + 16) for rows <= PANEL_ROWS. */
static inline __attribute__((always_inline)) void panel_block(const struct qmm *a, const uint8_t *packed,
                                                              const float *pd, const float *pm, int64_t p,
                                                              int64_t m0, int rows) {
    const int64_t G = a->K / GROUP;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[PANEL_ROWS];
    for (int r = 0; r < PANEL_ROWS; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *w = packed + p * G * 256;
    const float *wd = pd + p * G * PANEL, *wm = pm + p * G * PANEL;
    for (int64_t g = 0; g < G; g++, w += 256) {
        __m512i q[8];
        for (int i = 0; i < 4; i++) {
            const __m512i v = _mm512_loadu_si512(w + i * 64);
            q[2 * i] = _mm512_and_si512(v, low4);
            q[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        const __m512 d = _mm512_loadu_ps(wd + g * PANEL), mn = _mm512_loadu_ps(wm + g * PANEL);
        for (int r = 0; r < PANEL_ROWS; r++) {
            if (r >= rows) break;
            const int64_t m = m0 + r;
            const int32_t *x = (const int32_t *)(a->xq + m * a->K + g * GROUP);
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_set1_epi32(x[0]));
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], _mm512_set1_epi32(x[1]));
            s0 = _mm512_dpbusd_epi32(s0, q[2], _mm512_set1_epi32(x[2]));
            s1 = _mm512_dpbusd_epi32(s1, q[3], _mm512_set1_epi32(x[3]));
            s0 = _mm512_dpbusd_epi32(s0, q[4], _mm512_set1_epi32(x[4]));
            s1 = _mm512_dpbusd_epi32(s1, q[5], _mm512_set1_epi32(x[5]));
            s0 = _mm512_dpbusd_epi32(s0, q[6], _mm512_set1_epi32(x[6]));
            s1 = _mm512_dpbusd_epi32(s1, q[7], _mm512_set1_epi32(x[7]));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
            acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->xd[m * G + g])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->xs[m * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) panel_store(a->y, (m0 + r) * a->N + p * PANEL, acc[r], a->x_bf16);
}

/* Each thread takes a range of panels and runs every block of rows over them: its panels' weights
 * stay in its own cache while the activations stream. */
static void panel_gemm(const struct qmm *a, const uint8_t *packed, const float *pd, const float *pm) {
    const int64_t panels = a->N / PANEL;
#pragma omp parallel num_threads(a->threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t p0 = panels * t / T, p1 = panels * (t + 1) / T;
        for (int64_t m0 = 0; m0 < a->M; m0 += PANEL_ROWS) {
            const int rows = a->M - m0 < PANEL_ROWS ? (int)(a->M - m0) : PANEL_ROWS;
            for (int64_t p = p0; p < p1; p++) {
                if (rows == PANEL_ROWS) panel_block(a, packed, pd, pm, p, m0, PANEL_ROWS);
                else panel_block(a, packed, pd, pm, p, m0, rows);
            }
        }
    }
}
