/* The per-token operations of ops.c, included once per instruction set (KSUF names the variant,
 * `#pragma GCC target` around the include selects it; `omp simd` loops vectorize to its width).
 * Rows are converted to float32 on entry and rounded back on exit; bfloat16 results round where
 * the reference implementation (transformers, in that dtype) rounds. */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, KSUF)

static inline void FN(to_float)(const void *x, int bf16, int64_t n, float *out) {
    if (bf16) {
        const uint16_t *h = (const uint16_t *)x;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)h[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            out[i] = f;
        }
    } else {
        memcpy(out, x, n * sizeof(float));
    }
}

static inline void FN(from_float)(const float *x, int64_t n, void *out, int bf16) {
    if (bf16) {
        uint16_t *h = (uint16_t *)out;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(x[i]);
    } else {
        memcpy(out, x, n * sizeof(float));
    }
}

static inline void FN(round_bf16)(float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

#if VEC_LANES
/* Hand-vectorized loops, VEC_LANES float32 values a vector: the compiler does not turn a division
 * into a reciprocal, nor keep the attention's running sums in registers, by itself. */
#if VEC_LANES == 16
#define VEC __m512
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
#define VMIN _mm512_min_ps
#define VMAX _mm512_max_ps
#define VFMA _mm512_fmadd_ps
#define VFNMA _mm512_fnmadd_ps
#define VRCP _mm512_rcp14_ps
#define VTOINT _mm512_cvtps_epi32
#define VFLOATS _mm512_castsi512_ps
#define VI_SET1 _mm512_set1_epi32
#define VI_ADD _mm512_add_epi32
#define VI_SLL _mm512_slli_epi32
static inline __m256 FN(fold8)(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* VEC_LANES values from element i of a float32 or bfloat16 row. */
static inline __attribute__((always_inline)) __m512 FN(load_row)(const void *row, int64_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + i);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
/* f32_to_bf16 of each lane, in the low 16 bits of its 32. */
static inline __m512i FN(bf16_bits)(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}
static inline __attribute__((always_inline)) void FN(store_row)(void *row, int64_t i, __m512 v, const int bf16) {
    if (!bf16) _mm512_storeu_ps((float *)row + i, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)row + i), _mm512_cvtepi32_epi16(FN(bf16_bits)(v)));
}
#else
#define VEC __m256
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMUL _mm256_mul_ps
#define VMIN _mm256_min_ps
#define VMAX _mm256_max_ps
#define VFMA _mm256_fmadd_ps
#define VFNMA _mm256_fnmadd_ps
#define VRCP _mm256_rcp_ps
#define VTOINT _mm256_cvtps_epi32
#define VFLOATS _mm256_castsi256_ps
#define VI_SET1 _mm256_set1_epi32
#define VI_ADD _mm256_add_epi32
#define VI_SLL _mm256_slli_epi32
static inline __m256 FN(fold8)(__m256 v) { return v; }
static inline __attribute__((always_inline)) __m256 FN(load_row)(const void *row, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + i);
    const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
static inline __m256i FN(bf16_bits)(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
}
static inline __attribute__((always_inline)) void FN(store_row)(void *row, int64_t i, __m256 v, const int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)row + i, v);
    } else {
        const __m256i bits = FN(bf16_bits)(v);
        _mm_storeu_si128((__m128i *)((uint16_t *)row + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
    }
}
#endif

/* Each lane rounded to bfloat16 and back, as round_bf16. */
static inline VEC FN(round_vec)(VEC v) { return VFLOATS(VI_SLL(FN(bf16_bits)(v), 16)); }

/* pd_expf, a vector at a time. */
static inline VEC FN(vexp)(VEC x) {
    x = VMIN(VMAX(x, VSET1(-87.0f)), VSET1(88.0f));
    const VEC t = VMUL(x, VSET1(1.4426950408889634f));
    const VEC n = VSUB(VADD(t, VSET1(12582912.0f)), VSET1(12582912.0f));
    const VEC f = VMUL(VSUB(t, n), VSET1(0.6931471805599453f));
    VEC p = VSET1(1.0f / 720.0f);
    p = VFMA(p, f, VSET1(1.0f / 120.0f));
    p = VFMA(p, f, VSET1(1.0f / 24.0f));
    p = VFMA(p, f, VSET1(1.0f / 6.0f));
    p = VFMA(p, f, VSET1(0.5f));
    p = VFMA(p, f, VSET1(1.0f));
    p = VFMA(p, f, VSET1(1.0f));
    return VMUL(p, VFLOATS(VI_SLL(VI_ADD(VTOINT(n), VI_SET1(127)), 23)));
}

/* 1 / d: the CPU's estimate (12 or 14 bits) and one Newton step, about 4x cheaper than dividing. */
static inline VEC FN(vrecip)(VEC d) {
    const VEC r = VRCP(d);
    return VMUL(r, VFNMA(d, r, VSET1(2.0f)));
}
#endif

/* One row of rms_norm: row (float32, H values; overwritten) normalized, scaled by weight and written
 * to y. */
static inline void FN(norm_row)(float *row, const float *weight, float eps, int64_t H, void *y, int bf16) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; i++) ss += row[i] * row[i];
    const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) row[i] *= inv;
    if (bf16) FN(round_bf16)(row, H);
#pragma omp simd
    for (int64_t i = 0; i < H; i++) row[i] *= weight[i];
    FN(from_float)(row, H, y, bf16);
}

#if VEC_LANES
/* norm_row (after the residual add, when delta is given) in vectors, straight from the row's dtype;
 * row: H floats of scratch. */
static inline void FN(norm_row_vec)(char *x, const char *delta, const float *weight, float eps, int64_t H, void *y,
                                    int bf16, float *row) {
    VEC ss = VZERO();
    for (int64_t i = 0; i < H; i += VEC_LANES) {
        VEC v = FN(load_row)(x, i, bf16);
        if (delta) {
            v = VADD(v, FN(load_row)(delta, i, bf16));
            FN(store_row)(x, i, v, bf16);
            if (bf16) v = FN(round_vec)(v);
        }
        VSTORE(row + i, v);
        ss = VFMA(v, v, ss);
    }
    float lanes[VEC_LANES], total = 0.0f;
    VSTORE(lanes, ss);
    for (int i = 0; i < VEC_LANES; i++) total += lanes[i];
    const VEC inv = VSET1(1.0f / sqrtf(total / (float)H + eps));
    for (int64_t i = 0; i < H; i += VEC_LANES) {
        VEC v = VMUL(VLOAD(row + i), inv);
        if (bf16) v = FN(round_vec)(v);
        FN(store_row)(y, i, VMUL(v, VLOAD(weight + i)), bf16);
    }
}
#endif

/* y = x / sqrt(mean(x^2) + eps) * w, row by row (bfloat16: normalized in float32, rounded, then
 * scaled and rounded again, as transformers computes it). With `delta`, x += delta first, in place
 * and rounded to x's dtype as torch adds: the residual add that precedes each norm of a decoder,
 * without a pass of its own over the rows. */
static void FN(rms_norm)(int threads, void *x, const void *delta, const void *w, float eps, int64_t T, int64_t H,
                         void *y, int bf16) {
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel num_threads(T > 1 ? threads : 1)
    {
        float *row = malloc(3 * H * sizeof(float)), *weight = row + H, *d = weight + H; /* a thread's own */
        FN(to_float)(w, bf16, H, weight);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            char *xt = (char *)x + t * H * es;
#if VEC_LANES
            if (H % VEC_LANES == 0) {
                FN(norm_row_vec)(xt, delta ? (const char *)delta + t * H * es : NULL, weight, eps, H,
                                 (char *)y + t * H * es, bf16, row);
                continue;
            }
#endif
            FN(to_float)(xt, bf16, H, row);
            if (delta) {
                FN(to_float)((const char *)delta + t * H * es, bf16, H, d);
#pragma omp simd
                for (int64_t i = 0; i < H; i++) row[i] += d[i];
                FN(from_float)(row, H, xt, bf16);
                if (bf16) FN(round_bf16)(row, H);
            }
            FN(norm_row)(row, weight, eps, H, (char *)y + t * H * es, bf16);
        }
        free(row);
    }
}

/* out = act(gate) * up for gate_up = [gate | up] rows of 2I, act SiLU (gelu 0) or GELU's tanh
 * form (gelu 1: 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 +
 * e^-2y), the same value without 1 + tanh's cancellation in the negative tail); bfloat16: act
 * rounded before the product, as transformers computes it. */
static void FN(gated_mul)(int threads, const void *gu, int64_t T, int64_t I, void *out, int bf16, int gelu) {
    const int64_t es = bf16 ? 2 : 4;
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
#pragma omp parallel for num_threads(T > 1 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *gate = (const char *)gu + t * 2 * I * es, *up = gate + I * es;
        char *o = (char *)out + t * I * es;
        int64_t i = 0;
#if VEC_LANES
        for (; i + VEC_LANES <= I; i += VEC_LANES) {
            const VEC g = FN(load_row)(gate, i, bf16);
            const VEC e = gelu ? VMUL(VSET1(-2.0f * c), VFMA(VMUL(VSET1(0.044715f), VMUL(g, g)), g, g))
                               : VSUB(VZERO(), g); /* silu: -g; gelu: -2y */
            VEC s = VMUL(g, FN(vrecip)(VADD(VSET1(1.0f), FN(vexp)(e))));
            if (bf16) s = FN(round_vec)(s);
            FN(store_row)(o, i, VMUL(s, FN(load_row)(up, i, bf16)), bf16);
        }
#endif
        for (; i < I; i++) {
            const float g = bf16 ? bf16_to_f32(((const uint16_t *)gate)[i]) : ((const float *)gate)[i];
            const float u = bf16 ? bf16_to_f32(((const uint16_t *)up)[i]) : ((const float *)up)[i];
            const float e = gelu ? -2.0f * c * (g + 0.044715f * g * g * g) : -g;
            float s = g / (1.0f + pd_expf(e));
            if (bf16) s = bf16_to_f32(f32_to_bf16(s));
            if (bf16) ((uint16_t *)o)[i] = f32_to_bf16(s * u);
            else ((float *)o)[i] = s * u;
        }
    }
}

/* Rotary embedding (rotate-half) on the q and k heads of each token's qkv row, in place, then the
 * token's k and v into its slot of the KV cache ([slots, 2, kv_heads, head_dim]). bfloat16: x * cos
 * + rotate_half(x) * sin with each product and the sum rounded, as transformers computes it. */
static void FN(rotary_store)(int threads, void *qkv, int64_t T, int64_t H, int64_t KV, int64_t D,
                             const void *cos, const void *sin, void *cache, const int64_t *slots, int bf16) {
    const int64_t width = (H + 2 * KV) * D, half = D / 2, es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(T > 1 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *cos_t = (const char *)cos + t * D * es, *sin_t = (const char *)sin + t * D * es;
        char *row = (char *)qkv + t * width * es;
#if VEC_LANES
        if (half % VEC_LANES == 0) { /* cos and sin read from the row each time: they stay in L1 */
            for (int64_t h = 0; h < H + KV; h++) {
                char *head = row + h * D * es;
                for (int64_t i = 0; i < half; i += VEC_LANES) {
                    const VEC x0 = FN(load_row)(head, i, bf16), x1 = FN(load_row)(head, i + half, bf16);
                    VEC a = VMUL(x0, FN(load_row)(cos_t, i, bf16)), b = VMUL(VSUB(VZERO(), x1), FN(load_row)(sin_t, i, bf16));
                    VEC a2 = VMUL(x1, FN(load_row)(cos_t, i + half, bf16)), b2 = VMUL(x0, FN(load_row)(sin_t, i + half, bf16));
                    if (bf16) {
                        a = FN(round_vec)(a), b = FN(round_vec)(b);
                        a2 = FN(round_vec)(a2), b2 = FN(round_vec)(b2);
                    }
                    FN(store_row)(head, i, VADD(a, b), bf16);
                    FN(store_row)(head, i + half, VADD(a2, b2), bf16);
                }
            }
            char *slot = (char *)cache + slots[t] * 2 * KV * D * es;
            memcpy(slot, row + H * D * es, 2 * KV * D * es); /* k then v, side by side in both */
            continue;
        }
#endif
        float c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], x[MAX_HEAD_DIM], r[MAX_HEAD_DIM];
        FN(to_float)(cos_t, bf16, D, c);
        FN(to_float)(sin_t, bf16, D, s);
        for (int64_t h = 0; h < H + KV; h++) {
            char *head = row + h * D * es;
            FN(to_float)(head, bf16, D, x);
            if (bf16) {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    float a = bf16_to_f32(f32_to_bf16(x[i] * c[i])), b = bf16_to_f32(f32_to_bf16(-x[i + half] * s[i]));
                    float a2 = bf16_to_f32(f32_to_bf16(x[i + half] * c[i + half]));
                    float b2 = bf16_to_f32(f32_to_bf16(x[i] * s[i + half]));
                    r[i] = a + b;
                    r[i + half] = a2 + b2;
                }
            } else {
#pragma omp simd
                for (int64_t i = 0; i < half; i++) {
                    r[i] = x[i] * c[i] - x[i + half] * s[i];
                    r[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
                }
            }
            FN(from_float)(r, D, head, bf16);
        }
        char *slot = (char *)cache + slots[t] * 2 * KV * D * es;
        memcpy(slot, row + H * D * es, KV * D * es);                       /* k */
        memcpy(slot + KV * D * es, row + (H + KV) * D * es, KV * D * es);  /* v */
    }
}

/* Where a slot's K (half 0) or V (half 1) for KV heads kv0.. starts in the cache. */
static inline const char *FN(slot_row)(const void *cache, int64_t slot, int64_t half, int64_t KV, int64_t kv0,
                                       const int64_t D, int bf16) {
    return (const char *)cache + ((slot * 2 + half) * KV + kv0) * D * (bf16 ? 2 : 4);
}

/* The float32 values of K (half 0) or V (half 1) in a slot for KV heads kv0..kv0+nkv: read in place
 * from a float32 cache, converted into `row` from a bfloat16 one. */
static inline const float *FN(token_values)(const void *cache, int64_t slot, int64_t half, int64_t KV, int64_t kv0,
                                            int64_t nkv, const int64_t D, int bf16, float *row) {
    const char *src = FN(slot_row)(cache, slot, half, KV, kv0, D, bf16);
    if (!bf16) return (const float *)src;
    const uint16_t *bits = (const uint16_t *)src;
#pragma omp simd
    for (int64_t i = 0; i < nkv * D; i++) row[i] = bf16_to_f32(bits[i]);
    return row;
}


#if VEC_LANES
/* Tokens are taken 8 at a time where the head size is a whole number of vectors: a score is then
 * a vector of partial products per token, and the 8 tokens' vectors are summed across lanes
 * together (one shuffle tree instead of 8 horizontal sums), and a head's weighted sum of V stays
 * in registers over the 8 tokens. */
/* Lane i of the result: the sum of a[i]'s lanes. */
static inline __m256 FN(sum8)(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* halves of a[0..3], a[4..7] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Scores (times `scale`) of the nq query heads (qf, G to a KV head) against 8 tokens whose K rows
 * (in the cache, float32 or bfloat16) are k[0..7], into p[h * len + 0..7]. */
static inline __attribute__((always_inline)) void FN(score8)(const float *qf, const char *const *k, int64_t nq,
                                                             int64_t G, const int64_t D, const int bf16, float scale,
                                                             float *p, int64_t len) {
    for (int64_t h = 0; h < nq; h++) {
        const float *qh = qf + h * D;
        const int64_t head = h / G * D;
        __m256 part[8];
        for (int b = 0; b < 8; b++) {
            VEC acc = VZERO();
            for (int64_t i = 0; i < D; i += VEC_LANES)
                acc = VFMA(VLOAD(qh + i), FN(load_row)(k[b], head + i, bf16), acc);
            part[b] = FN(fold8)(acc);
        }
        _mm256_storeu_ps(p + h * len, _mm256_mul_ps(FN(sum8)(part), _mm256_set1_ps(scale)));
    }
}

/* acc[h] += the 8 tokens' V rows (v[0..7], in the cache) weighted by p[h * len + 0..7]. */
static inline __attribute__((always_inline)) void FN(weigh8)(const char *const *v, const float *p, int64_t len,
                                                             int64_t nq, int64_t G, const int64_t D, const int bf16,
                                                             float *acc) {
    const int64_t n = D / VEC_LANES;
    for (int64_t h = 0; h < nq; h++) {
        float *ah = acc + h * D;
        const int64_t head = h / G * D;
        VEC a[MAX_HEAD_DIM / VEC_LANES];
        for (int64_t i = 0; i < n; i++) a[i] = VLOAD(ah + i * VEC_LANES);
        for (int b = 0; b < 8; b++) {
            const VEC w = VSET1(p[h * len + b]);
            for (int64_t i = 0; i < n; i++) a[i] = VFMA(w, FN(load_row)(v[b], head + i * VEC_LANES, bf16), a[i]);
        }
        for (int64_t i = 0; i < n; i++) VSTORE(ah + i * VEC_LANES, a[i]);
    }
}
#endif

/* One new token per row attending to its context in the paged cache. A task is one row's KV heads
 * kv0..kv1 with their query heads over the cached tokens jb..je: each token's K (then V) values of
 * those heads are read once, side by side in its slot, and serve all of them. Scores first, then
 * their exponentials against the largest, then the weighted sum of V; a float32 cache is read in
 * place, a bfloat16 one converted. A task over the whole context normalizes and writes its heads'
 * output; a task over part of it (`part`) leaves each head's largest score, sum of exponentials
 * and unnormalized sum for `merge_parts`. The task is compiled apart for the usual head sizes (64,
 * 128): with D known the compiler unrolls the dot products and keeps a head's row in registers. */
static inline __attribute__((always_inline)) void FN(attend_task)(
        const void *q, int64_t q_stride, int64_t r, int64_t kv0, int64_t kv1, int64_t H, int64_t KV, const int64_t D,
        const void *cache, int64_t block_size, const int64_t *table, int64_t jb, int64_t je, float scale, void *out,
        int bf16, const struct attn_part *part) {
    const int64_t G = H / KV, es = bf16 ? 2 : 4, nkv = kv1 - kv0, nq = nkv * G, h0 = kv0 * G, len = je - jb;
    float *qf = malloc((2 * nq * D + nkv * D + nq * len + nq) * sizeof(float));
    float *acc = part ? part->acc : qf + nq * D, *row = qf + 2 * nq * D, *p = row + nkv * D, *sums = p + nq * len;
    for (int64_t h = 0; h < nq; h++)
        FN(to_float)((const char *)q + (r * q_stride + (h0 + h) * D) * es, bf16, D, qf + h * D);
    for (int64_t half = 0; half < 2; half++) { /* 0: scores against K; 1: the sum of V they weight */
        if (half) {
            for (int64_t h = 0; h < nq; h++) { /* exponentials against the largest score */
                float *ph = p + h * len, top = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : top)
                for (int64_t j = 0; j < len; j++) top = ph[j] > top ? ph[j] : top;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < len; j++) sum += (ph[j] = pd_expf(ph[j] - top));
                sums[h] = sum;
                if (part) part->top[h] = top, part->sum[h] = sum;
            }
            memset(acc, 0, nq * D * sizeof(float));
        }
        int64_t j = jb;
        struct slot_cursor at = {table, block_size, j / block_size, j % block_size};
#if VEC_LANES
        if (D % VEC_LANES == 0) {
            for (; j + 8 <= je; j += 8) {
                const char *kv[8];
                if (!half) /* K and V of the tokens 32 on, into this core's L2 (the V pass rereads them
                            * there): from memory the cores' own fetches came at half the rate of L3's */
                    for (int64_t ahead = j + 32; ahead < j + 40 && ahead < je; ahead++) {
                        const char *slot = FN(slot_row)(cache, table[ahead / block_size] * block_size
                                                               + ahead % block_size, 0, KV, kv0, D, bf16);
                        for (int64_t line = 0; line < (KV + nkv) * D * es; line += 64)
                            _mm_prefetch(slot + line, _MM_HINT_T1);
                    }
                for (int b = 0; b < 8; b++) kv[b] = FN(slot_row)(cache, next_slot(&at), half, KV, kv0, D, bf16);
                if (!half && bf16) FN(score8)(qf, kv, nq, G, D, 1, scale, p + j - jb, len);
                else if (!half) FN(score8)(qf, kv, nq, G, D, 0, scale, p + j - jb, len);
                else if (bf16) FN(weigh8)(kv, p + j - jb, len, nq, G, D, 1, acc);
                else FN(weigh8)(kv, p + j - jb, len, nq, G, D, 0, acc);
            }
        }
#endif
        for (; j < je; j++) {
            const float *kv = FN(token_values)(cache, next_slot(&at), half, KV, kv0, nkv, D, bf16, row);
            for (int64_t h = 0; h < nq; h++) {
                const float *kh = kv + (h / G) * D;
                if (!half) {
                    const float *qh = qf + h * D;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t i = 0; i < D; i++) dot += qh[i] * kh[i];
                    p[h * len + j - jb] = dot * scale;
                } else {
                    const float w = p[h * len + j - jb];
                    float *ah = acc + h * D;
#pragma omp simd
                    for (int64_t i = 0; i < D; i++) ah[i] += w * kh[i];
                }
            }
        }
    }
    if (!part) {
        for (int64_t h = 0; h < nq; h++) {
            const float inv = 1.0f / sums[h];
            float *ah = acc + h * D;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) ah[i] *= inv;
            FN(from_float)(ah, D, (char *)out + (r * H + h0 + h) * D * es, bf16);
        }
    }
    free(qf);
}

#define ATTEND(Dk, ...)                                                                                      \
    do {                                                                                                     \
        if ((Dk) == 64) FN(attend_task)(q, q_stride, r, kv0, kv1, H, KV, 64, cache, block_size, __VA_ARGS__);   \
        else if ((Dk) == 128) FN(attend_task)(q, q_stride, r, kv0, kv1, H, KV, 128, cache, block_size, __VA_ARGS__); \
        else FN(attend_task)(q, q_stride, r, kv0, kv1, H, KV, Dk, cache, block_size, __VA_ARGS__);              \
    } while (0)

/* Each query head's output from its parts (`attn_part`s side by side in `scratch`, [R, KV, parts]):
 * the parts' sums of V weighted by e^(their largest score - the largest of all), over the same
 * weighting of their sums of exponentials. */
static void FN(merge_parts)(const float *scratch, int64_t R, int64_t H, int64_t KV, int64_t D, int64_t parts,
                            void *out, int bf16) {
    const int64_t G = H / KV, part_floats = G * (D + 2);
    for (int64_t rk = 0; rk < R * KV; rk++) {
        const int64_t r = rk / KV, kvh = rk % KV;
        const float *first = scratch + rk * parts * part_floats;
        for (int64_t g = 0; g < G; g++) {
            float top = -INFINITY, sum = 0.0f, o[MAX_HEAD_DIM];
            for (int64_t c = 0; c < parts; c++) top = first[c * part_floats + g] > top ? first[c * part_floats + g] : top;
            memset(o, 0, D * sizeof(float));
            for (int64_t c = 0; c < parts; c++) {
                const float *base = first + c * part_floats;
                if (base[G + g] == 0.0f) continue; /* an empty part */
                const float w = pd_expf(base[g] - top), *a = base + 2 * G + g * D;
                sum += w * base[G + g];
#pragma omp simd
                for (int64_t i = 0; i < D; i++) o[i] += w * a[i];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
            FN(from_float)(o, D, (char *)out + (r * H + kvh * G + g) * D * (bf16 ? 2 : 4), bf16);
        }
    }
}

static void FN(decode_attention)(int threads, const void *q, int64_t q_stride, int64_t R, int64_t H, int64_t KV,
                                 int64_t D, const void *cache, int64_t block_size, const int64_t *tables,
                                 int64_t max_blocks, const int64_t *lens, int64_t window, float scale, void *out,
                                 int bf16) {
    if (R >= 2 * threads) { /* rows give every thread a few: a task per row */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (int64_t r = 0; r < R; r++) {
            const int64_t kv0 = 0, kv1 = KV, *table = tables + r * max_blocks;
            ATTEND(D, table, window_start(lens[r], window), lens[r], scale, out, bf16, NULL);
        }
        return;
    }
    /* few rows: a task per row, KV head and part of the context (parts where a context is long
     * enough to share among threads), merged after by the parts' largest scores */
    int64_t parts = attention_parts(R, KV, lens, window, threads);
    const int64_t G = H / KV;
    int64_t tasks = R * KV * parts;
    float *scratch = parts > 1 ? malloc(tasks * G * (D + 2) * sizeof(float)) : NULL;
    if (!scratch) parts = 1, tasks = R * KV; /* no room for parts: whole contexts */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t r = task / (KV * parts), kv0 = task / parts % KV, kv1 = kv0 + 1, c = task % parts;
        const int64_t *table = tables + r * max_blocks, len = lens[r], first = window_start(len, window);
        const int64_t jb = first + (len - first) * c / parts, je = first + (len - first) * (c + 1) / parts;
        if (!scratch) {
            ATTEND(D, table, first, len, scale, out, bf16, NULL);
        } else {
            float *base = scratch + task * G * (D + 2);
            const struct attn_part part = {base, base + G, base + 2 * G};
            if (je > jb) {
                ATTEND(D, table, jb, je, scale, out, bf16, &part);
            } else {
                for (int64_t g = 0; g < G; g++) part.top[g] = -INFINITY, part.sum[g] = 0.0f;
                memset(part.acc, 0, G * D * sizeof(float));
            }
        }
    }
    if (scratch) FN(merge_parts)(scratch, R, H, KV, D, parts, out, bf16);
    free(scratch);
}

#undef ATTEND
#if VEC_LANES
#undef VEC
#undef VLOAD
#undef VSTORE
#undef VSET1
#undef VZERO
#undef VADD
#undef VSUB
#undef VMUL
#undef VMIN
#undef VMAX
#undef VFMA
#undef VFNMA
#undef VRCP
#undef VTOINT
#undef VFLOATS
#undef VI_SET1
#undef VI_ADD
#undef VI_SLL
#endif

#undef FN
#undef CAT
#undef CAT_
