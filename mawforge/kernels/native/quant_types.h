/* The GGUF types beyond kquant_gemm.c's five, on the same integer-dot scheme (included by it, after
 * its q8 quantizers and AVX2 helpers). Each weight type meets x quantized to llama.cpp's vec_dot
 * type for it:
 *   Q2_K, Q3_K, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M  ->  q8_K
 *   Q5_0, IQ4_NL, MXFP4                                                      ->  q8_0
 *   Q4_1, Q5_1                                                               ->  q8_1 (q8_0 plus s = d * sum q, f16)
 *   F16, BF16                                                                ->  x rounded to f16 / bf16
 * and every block product in integers (exact), scaled once per block in float32, as ggml's
 * vec_dot functions do; results differ from ggml's only in float32 summation order.
 *
 * The 256-element types decode a weight block once into a `dblk`: 256 signed int8 values and an
 * integer scale per 16 (per-32 scales written twice), with the block's float scale (and Q2_K's
 * mins). One shared product (dblk_dot: maddubs on |v| and x signed by v, madd by the scales)
 * then serves one token, or four tokens a decode (dot4: a prefill decodes each block once per
 * four tokens). IQ1_S / IQ1_M fold their +-1/8 delta into the values: v = 8 * grid +- 1 with
 * the block scale divided by 8, which is d * (sumi + delta * sumi1) in integers.
 * The 32-element types (Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4) decode into one register a block.
 * Bit layouts: ggml's block_* structs (docs/quant-layouts.md); the codebooks and sign tables
 * in iq_tables.h come from the gguf package's reference dequantizers. */
#include "iq_tables.h"

#ifndef FORCE_INLINE
#define FORCE_INLINE static inline __attribute__((always_inline))
#endif

/* q8_1 as llama.cpp's x86 quantize_row_q8_1: q8_0's values, d as f16, and s = f16(d * sum q) with
   d the unrounded max / 127. The s of each block goes where q8_K keeps its sums (the same bytes). */
static void quant_q81(const float *x, int K, qrow r) {
    quant_q80(x, K, r);
    float *s = (float *)r.bs;
    for (int b = 0; b < K / Q80; b++) {
        const float *v = x + b * Q80;
        float amax = 0.f;
        for (int i = 0; i < Q80; i++) { float a = fabsf(v[i]); amax = a > amax ? a : amax; }
        int sum = 0;
        for (int i = 0; i < Q80; i++) sum += r.q[b * Q80 + i];
        s[b] = round_f16(amax / 127.f * (float)sum);
    }
}

static inline float round_bf16(float f) {   /* ggml's GGML_FP32_TO_BF16 (nearest even; NaN kept quiet) */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) u = (u >> 16 | 64) << 16;
    else u = ((u + (0x7fffu + ((u >> 16) & 1))) >> 16) << 16;
    float o; memcpy(&o, &u, 4); return o;
}

/* F16 / BF16 weights: x rounded to the weight's type (its vec_dot type) and kept as float32 in the
   row's q bytes (qrow_bytes gives float rows 4 K bytes) */
static void quant_float(const float *x, int K, qrow r, int bf) {
    float *o = (float *)r.q;
    int i = 0;
#ifdef __F16C__
    if (!bf)
        for (; i + 8 <= K; i += 8)
            _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; i < K; i++) o[i] = bf ? round_bf16(x[i]) : round_f16(x[i]);
}

/* ---- 256-element types: decode to a dblk --------------------------------------------------- */
typedef struct {
    int8_t v[QK];           /* the block's values, signed */
    int16_t sc[16];         /* integer scale of each 16 values */
    int16_t mn[16];         /* Q2_K: the mins of each 16 */
    float d, dmin;          /* value = d * sc * v (- dmin * mn) */
} __attribute__((aligned(32))) dblk;

static inline void signed8(int8_t *dst, uint64_t grid, uint64_t signs) {   /* 8 values times 8 signs */
    int8_t g[8], s[8];
    memcpy(g, &grid, 8); memcpy(s, &signs, 8);
    for (int j = 0; j < 8; j++) dst[j] = (int8_t)(g[j] * s[j]);
}
static inline void signed4x2(int8_t *dst, uint32_t g1, uint32_t g2, uint64_t signs) {
    signed8(dst, (uint64_t)g1 | (uint64_t)g2 << 32, signs);
}
static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static void dec_q2k_c(const uint8_t *w, dblk *o) {
    for (int i = 0; i < 16; i++) { o->sc[i] = w[i] & 0xF; o->mn[i] = w[i] >> 4; }
    const uint8_t *qs = w + 16;
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) o->v[128 * k + 32 * j + l] = (int8_t)((qs[32 * k + l] >> (2 * j)) & 3);
    o->d = f16(w + 80); o->dmin = f16(w + 82);
}

/* Q3_K's sixteen 6-bit scales (12 bytes at 96), less 32 */
static inline void s_q3k(const uint8_t *w, int8_t *ls) {
    uint32_t a[4];
    memcpy(a, w + 96, 12);
    const uint32_t tmp = a[2], m2 = 0x0f0f0f0f, m1 = 0x03030303;
    a[2] = ((a[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
    a[3] = ((a[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
    a[0] = (a[0] & m2) | (((tmp >> 0) & m1) << 4);
    a[1] = (a[1] & m2) | (((tmp >> 2) & m1) << 4);
    const int8_t *s = (const int8_t *)a;
    for (int i = 0; i < 16; i++) ls[i] = (int8_t)(s[i] - 32);
}

static void dec_q3k_c(const uint8_t *w, dblk *o) {
    const uint8_t *hm = w, *qs = w + 32;
    int8_t ls[16];
    s_q3k(w, ls);
    for (int i = 0; i < 16; i++) o->sc[i] = ls[i];
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 4; j++) {
            const uint8_t m = (uint8_t)(1u << (4 * k + j));
            for (int l = 0; l < 32; l++)
                o->v[128 * k + 32 * j + l] = (int8_t)(((qs[32 * k + l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4));
        }
    o->d = f16(w + 108);
}

static void dec_iq4xs_c(const uint8_t *w, dblk *o) {
    const uint16_t sh = rd16(w + 2);
    const uint8_t *qs = w + 8;
    for (int ib = 0; ib < 8; ib++) {
        const int ls = ((w[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(ls - 32);
        for (int j = 0; j < 16; j++) {
            o->v[32 * ib + j] = KVALUES_IQ4NL[qs[16 * ib + j] & 0xF];
            o->v[32 * ib + 16 + j] = KVALUES_IQ4NL[qs[16 * ib + j] >> 4];
        }
    }
    o->d = f16(w);
}

static void dec_iq2xxs_c(const uint8_t *w, dblk *o) {
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = w + 2 + 8 * ib;
        const uint32_t a1 = rd32(q + 4);
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(2 * (a1 >> 28) + 1);
        for (int l = 0; l < 4; l++) signed8(o->v + 32 * ib + 8 * l, IQ2XXS_GRID[q[l]], KSIGNS8[(a1 >> (7 * l)) & 127]);
    }
    o->d = 0.125f * f16(w);
}

static void dec_iq2xs_c(const uint8_t *w, dblk *o) {
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t s = w[66 + ib];
        o->sc[2 * ib] = (int16_t)(2 * (s & 0xF) + 1);
        o->sc[2 * ib + 1] = (int16_t)(2 * (s >> 4) + 1);
        for (int l = 0; l < 4; l++) {
            const uint16_t q = rd16(w + 2 + 2 * (4 * ib + l));
            signed8(o->v + 32 * ib + 8 * l, IQ2XS_GRID[q & 511], KSIGNS8[q >> 9]);
        }
    }
    o->d = 0.125f * f16(w);
}

static void dec_iq2s_c(const uint8_t *w, dblk *o) {
    const uint8_t *qs = w + 2, *signs = w + 34, *qh = w + 66, *sc = w + 74;
    for (int ib = 0; ib < 8; ib++) {
        o->sc[2 * ib] = (int16_t)(2 * (sc[ib] & 0xF) + 1);
        o->sc[2 * ib + 1] = (int16_t)(2 * (sc[ib] >> 4) + 1);
        for (int l = 0; l < 4; l++)
            signed8(o->v + 32 * ib + 8 * l, IQ2S_GRID[qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300)],
                    SIGN8[signs[4 * ib + l]]);
    }
    o->d = 0.125f * f16(w);
}

static void dec_iq3xxs_c(const uint8_t *w, dblk *o) {
    const uint8_t *q3 = w + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t a = rd32(w + 2 + 64 + 4 * ib);
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(2 * (a >> 28) + 1);
        for (int l = 0; l < 4; l++)
            signed4x2(o->v + 32 * ib + 8 * l, IQ3XXS_GRID[q3[8 * ib + 2 * l]], IQ3XXS_GRID[q3[8 * ib + 2 * l + 1]],
                      KSIGNS8[(a >> (7 * l)) & 127]);
    }
    o->d = 0.25f * f16(w);
}

static void dec_iq3s_c(const uint8_t *w, dblk *o) {
    const uint8_t *qs = w + 2, *qh = w + 66, *signs = w + 74, *sc = w + 106;
    for (int ib = 0; ib < 8; ib++) {
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(2 * ((sc[ib / 2] >> (4 * (ib % 2))) & 0xF) + 1);
        for (int l = 0; l < 4; l++)
            signed4x2(o->v + 32 * ib + 8 * l, IQ3S_GRID[qs[8 * ib + 2 * l] | ((qh[ib] << (8 - 2 * l)) & 256)],
                      IQ3S_GRID[qs[8 * ib + 2 * l + 1] | ((qh[ib] << (7 - 2 * l)) & 256)], SIGN8[signs[4 * ib + l]]);
    }
    o->d = f16(w);
}

/* IQ1: 8 * grid (-8, 0, 8) + delta (+-1), so the block scale is d / 8 */
static inline void iq1_vals(int8_t *dst, uint64_t grid, int delta) {
    int8_t g[8];
    memcpy(g, &grid, 8);
    for (int j = 0; j < 8; j++) dst[j] = (int8_t)(8 * g[j] + delta);
}

static void dec_iq1s_c(const uint8_t *w, dblk *o) {
    const uint8_t *qs = w + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = rd16(w + 34 + 2 * ib);
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
        const int delta = qh & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; l++) iq1_vals(o->v + 32 * ib + 8 * l, IQ1S_GRID[qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], delta);
    }
    o->d = f16(w) * 0.125f;
}

static void dec_iq1m_c(const uint8_t *w, dblk *o) {
    const uint8_t *qs = w, *qh = w + 32;
    uint16_t sc[4];
    memcpy(sc, w + 48, 8);
    const uint16_t d16 = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    uint8_t db[2]; memcpy(db, &d16, 2);
    for (int ib = 0; ib < 8; ib++) {
        o->sc[2 * ib] = (int16_t)(2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 7) + 1);
        o->sc[2 * ib + 1] = (int16_t)(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 7) + 1);
        for (int l = 0; l < 4; l++) {
            const uint8_t h = qh[2 * ib + l / 2];
            const int idx = qs[4 * ib + l] | ((h << (8 - 4 * (l % 2))) & 0x700);
            iq1_vals(o->v + 32 * ib + 8 * l, IQ1S_GRID[idx], (h & (l % 2 ? 0x80 : 0x08)) ? -1 : 1);
        }
    }
    o->d = f16(db) * 0.125f;
}


#ifdef __AVX2__
/* The AVX2 decoders, per group of 32 values: g_T(w, ib) gives group ib's values in one register,
   s_T(w, ls) the block's 16 scales as int8, d_T(w) its float scale. A dblk decode stores them all;
   the one-token product (fused_dot below) takes each group straight into the integer sum, with
   the very int32 lanes dblk_dot gives, so the two paths agree to the bit. */
static inline __m256i nibbles32(const uint8_t *qs) {   /* bytes 0-15 the low nibbles, 16-31 the high */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
}
#ifndef GRID_GATHER
#define GRID_GATHER 1     /* codebook entries fetched by vpgatherdd / vpgatherdq (0: scalar loads and inserts) */
#endif
#define G4(t, a, b, c, d) _mm256_set_epi64x((long long)(t)[d], (long long)(t)[c], (long long)(t)[b], (long long)(t)[a])
static inline void ls_pairs(int8_t *ls, int ib, int v) { ls[2 * ib] = ls[2 * ib + 1] = (int8_t)v; }
static inline void ls_nibbles(const uint8_t *sc8, int8_t *ls) {   /* 2 * nibble + 1, low nibble first */
    for (int ib = 0; ib < 8; ib++) { ls[2 * ib] = (int8_t)(2 * (sc8[ib] & 0xF) + 1); ls[2 * ib + 1] = (int8_t)(2 * (sc8[ib] >> 4) + 1); }
}

FORCE_INLINE __m256i g_q2k(const uint8_t *w, int ib) {
    return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(w + 16 + 32 * (ib / 4))), 2 * (ib % 4)),
                            _mm256_set1_epi8(3));
}
static inline void s_q2k(const uint8_t *w, int8_t *ls) { for (int i = 0; i < 16; i++) ls[i] = (int8_t)(w[i] & 0xF); }
static inline float d_q2k(const uint8_t *w) { return f16(w + 80); }

FORCE_INLINE __m256i g_q3k(const uint8_t *w, int ib) {
    const int k = ib / 4, j = ib % 4;
    const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * k));
    const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)w),
                                                             _mm256_set1_epi8((char)(1 << ib))), _mm256_setzero_si256());
    return _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)),
                           _mm256_and_si256(clear, _mm256_set1_epi8(4)));
}
static inline float d_q3k(const uint8_t *w) { return f16(w + 108); }

FORCE_INLINE __m256i g_iq4xs(const uint8_t *w, int ib) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)KVALUES_IQ4NL)),
                               nibbles32(w + 8 + 16 * ib));
}
static inline void s_iq4xs(const uint8_t *w, int8_t *ls) {
    const uint16_t sh = rd16(w + 2);
    for (int ib = 0; ib < 8; ib++)
        ls_pairs(ls, ib, (((w[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4)) - 32);
}
static inline float d_iq4xs(const uint8_t *w) { return f16(w); }

FORCE_INLINE __m256i g_iq2xxs(const uint8_t *w, int ib) {
    const uint8_t *q = w + 2 + 8 * ib;
    const uint32_t a1 = rd32(q + 4);
    return _mm256_sign_epi8(G4(IQ2XXS_GRID, q[0], q[1], q[2], q[3]),
                            G4(KSIGNS8, a1 & 127, (a1 >> 7) & 127, (a1 >> 14) & 127, (a1 >> 21) & 127));
}
static inline void s_iq2xxs(const uint8_t *w, int8_t *ls) { for (int ib = 0; ib < 8; ib++) ls_pairs(ls, ib, 2 * (rd32(w + 6 + 8 * ib) >> 28) + 1); }
static inline float d_iq2xxs(const uint8_t *w) { return 0.125f * f16(w); }

FORCE_INLINE __m256i g_iq2xs(const uint8_t *w, int ib) {
    uint16_t q[4];
    memcpy(q, w + 2 + 8 * ib, 8);
    return _mm256_sign_epi8(G4(IQ2XS_GRID, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511),
                            G4(KSIGNS8, q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9));
}
static inline void s_iq2xs(const uint8_t *w, int8_t *ls) { ls_nibbles(w + 66, ls); }
static inline float d_iq2xs(const uint8_t *w) { return 0.125f * f16(w); }

/* +1 / -1 in byte j by bit j of the 32 bits at p (IQ2_S and IQ3_S keep their signs as plain bits) */
static inline __m256i signs32(const uint8_t *p) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(p)), shuf), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(1));
}
FORCE_INLINE __m256i g_iq2s(const uint8_t *w, int ib) {
    const uint8_t *q = w + 2 + 4 * ib, h = w[66 + ib];
    return _mm256_sign_epi8(G4(IQ2S_GRID, q[0] | ((h << 8) & 0x300), q[1] | ((h << 6) & 0x300), q[2] | ((h << 4) & 0x300),
                               q[3] | ((h << 2) & 0x300)), signs32(w + 34 + 4 * ib));
}
static inline void s_iq2s(const uint8_t *w, int8_t *ls) { ls_nibbles(w + 74, ls); }
static inline float d_iq2s(const uint8_t *w) { return 0.125f * f16(w); }

FORCE_INLINE __m256i g_iq3xxs(const uint8_t *w, int ib) {
    const uint8_t *q = w + 2 + 8 * ib;
    const uint32_t a = rd32(w + 66 + 4 * ib);
#if GRID_GATHER
    const __m256i g = _mm256_i32gather_epi32((const int *)IQ3XXS_GRID, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)), 4);
#else
    const __m256i g = _mm256_set_epi32((int)IQ3XXS_GRID[q[7]], (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[5]],
                                       (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[2]],
                                       (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[0]]);
#endif
    return _mm256_sign_epi8(g, G4(KSIGNS8, a & 127, (a >> 7) & 127, (a >> 14) & 127, (a >> 21) & 127));
}
static inline void s_iq3xxs(const uint8_t *w, int8_t *ls) { for (int ib = 0; ib < 8; ib++) ls_pairs(ls, ib, 2 * (rd32(w + 66 + 4 * ib) >> 28) + 1); }
static inline float d_iq3xxs(const uint8_t *w) { return 0.25f * f16(w); }

FORCE_INLINE __m256i g_iq3s(const uint8_t *w, int ib) {
    const uint8_t *q = w + 2 + 8 * ib;
    const int h = w[66 + ib];
#if GRID_GATHER   /* lane i: q[i] | bit i of h at bit 8 */
    const __m256i idx = _mm256_or_si256(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)),
                                        _mm256_and_si256(_mm256_sllv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(8, 7, 6, 5, 4, 3, 2, 1)),
                                                         _mm256_set1_epi32(256)));
    const __m256i g = _mm256_i32gather_epi32((const int *)IQ3S_GRID, idx, 4);
#else
    #define I3(l) (int)IQ3S_GRID[q[2 * (l)] | ((h << (8 - 2 * (l))) & 256)], \
                  (int)IQ3S_GRID[q[2 * (l) + 1] | ((h << (7 - 2 * (l))) & 256)]
    const __m256i g = _mm256_setr_epi32(I3(0), I3(1), I3(2), I3(3));
    #undef I3
#endif

    return _mm256_sign_epi8(g, signs32(w + 74 + 4 * ib));
}
static inline void s_iq3s(const uint8_t *w, int8_t *ls) {
    for (int ib = 0; ib < 8; ib++) ls_pairs(ls, ib, 2 * ((w[106 + ib / 2] >> (4 * (ib % 2))) & 0xF) + 1);
}
static inline float d_iq3s(const uint8_t *w) { return f16(w); }

/* IQ1 values 8 * g + delta, g in {-1, 0, 1}: sign(8, g) + delta */
static inline __m256i iq1_v(__m256i g, __m256i delta) { return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), delta); }
FORCE_INLINE __m256i g_iq1s(const uint8_t *w, int ib) {
    const uint16_t qh = rd16(w + 34 + 2 * ib);
    const uint8_t *q = w + 2 + 4 * ib;
#if GRID_GATHER   /* lane l: q[l] | ((qh >> 3 l) & 7) << 8 */
    const __m128i idx = _mm_or_si128(_mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)rd32(q))),
                                     _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(qh), _mm_setr_epi32(0, 3, 6, 9)),
                                                                  _mm_set1_epi32(7)), 8));
    return iq1_v(_mm256_i32gather_epi64((const long long *)IQ1S_GRID, idx, 8), _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
#else
    return iq1_v(G4(IQ1S_GRID, q[0] | ((qh << 8) & 0x700), q[1] | ((qh << 5) & 0x700), q[2] | ((qh << 2) & 0x700),
                    q[3] | ((qh >> 1) & 0x700)), _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
#endif
}
static inline void s_iq1s(const uint8_t *w, int8_t *ls) { for (int ib = 0; ib < 8; ib++) ls_pairs(ls, ib, 2 * ((rd16(w + 34 + 2 * ib) >> 12) & 7) + 1); }
static inline float d_iq1s(const uint8_t *w) { return f16(w) * 0.125f; }

FORCE_INLINE __m256i g_iq1m(const uint8_t *w, int ib) {
    const uint8_t *q = w + 4 * ib, h0 = w[32 + 2 * ib], h1 = w[33 + 2 * ib];
    const __m256i delta = _mm256_set_epi64x(h1 & 0x80 ? -1LL : 0x0101010101010101LL, h1 & 0x08 ? -1LL : 0x0101010101010101LL,
                                            h0 & 0x80 ? -1LL : 0x0101010101010101LL, h0 & 0x08 ? -1LL : 0x0101010101010101LL);
    return iq1_v(G4(IQ1S_GRID, q[0] | ((h0 << 8) & 0x700), q[1] | ((h0 << 4) & 0x700), q[2] | ((h1 << 8) & 0x700),
                    q[3] | ((h1 << 4) & 0x700)), delta);
}
static inline void s_iq1m(const uint8_t *w, int8_t *ls) {
    uint16_t sc[4];
    memcpy(sc, w + 48, 8);
    for (int ib = 0; ib < 8; ib++) {
        ls[2 * ib] = (int8_t)(2 * ((sc[ib / 2] >> (6 * (ib % 2))) & 7) + 1);
        ls[2 * ib + 1] = (int8_t)(2 * ((sc[ib / 2] >> (6 * (ib % 2) + 3)) & 7) + 1);
    }
}
static inline float d_iq1m(const uint8_t *w) {
    uint16_t sc[4];
    memcpy(sc, w + 48, 8);
    const uint16_t d16 = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    uint8_t db[2]; memcpy(db, &d16, 2);
    return f16(db) * 0.125f;
}

static inline void put16(int16_t *dst, const int8_t *ls) {
    _mm256_store_si256((__m256i *)dst, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)ls)));
}
#define DEC_AVX2(T)                                                                                    \
static void dec_##T(const uint8_t *w, dblk *o) {                                                      \
    int8_t ls[16];                                                                                     \
    s_##T(w, ls);                                                                                      \
    put16(o->sc, ls);                                                                                  \
    _Pragma("GCC unroll 8")                                                                           \
    for (int ib = 0; ib < 8; ib++) _mm256_store_si256((__m256i *)(o->v + 32 * ib), g_##T(w, ib));    \
    o->d = d_##T(w);                                                                                   \
}
DEC_AVX2(q3k) DEC_AVX2(iq4xs) DEC_AVX2(iq2xxs) DEC_AVX2(iq2xs) DEC_AVX2(iq2s) DEC_AVX2(iq3xxs) DEC_AVX2(iq3s)
DEC_AVX2(iq1s) DEC_AVX2(iq1m)
static void dec_q2k(const uint8_t *w, dblk *o) {
    int8_t ls[16], mn[16];
    s_q2k(w, ls);
    for (int i = 0; i < 16; i++) mn[i] = (int8_t)(w[i] >> 4);
    put16(o->sc, ls);
    put16(o->mn, mn);
    for (int ib = 0; ib < 8; ib++) _mm256_store_si256((__m256i *)(o->v + 32 * ib), g_q2k(w, ib));
    o->d = d_q2k(w); o->dmin = f16(w + 82);
}
#define HAVE_FUSED 1
#undef G4
#else
#define dec_q2k dec_q2k_c
#define dec_q3k dec_q3k_c
#define dec_iq4xs dec_iq4xs_c
#define dec_iq2xxs dec_iq2xxs_c
#define dec_iq2xs dec_iq2xs_c
#define dec_iq2s dec_iq2s_c
#define dec_iq3xxs dec_iq3xxs_c
#define dec_iq3s dec_iq3s_c
#define dec_iq1s dec_iq1s_c
#define dec_iq1m dec_iq1m_c
#endif

#ifdef __AVX2__
/* sum over the block of sc[i / 16] * v[i] * x[i], as eight int32 lanes (AVX-512 BW + VNNI: two
   groups of 32 a register, the scale multiply and the add in one vpdpwssd, the halves added) */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(MAWFORGE_VNNI_EMU)
static inline __m256i dblk_dot(const dblk *o, const int8_t *q8) {
    /* int16 lanes: 0-7 scale 4g, 8-15 scale 4g+1, 16-23 4g+2, 24-31 4g+3 for the pair of groups g */
    const __m512i idx0 = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                          1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i sc = _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)o->sc));
    __m512i sumi = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512((const void *)(o->v + 64 * g));
        const __m512i x = _mm512_loadu_si512((const void *)(q8 + 64 * g));
        const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(v), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(v),
                                                                                        _mm512_setzero_si512(), x));
        const __m512i s = _mm512_permutexvar_epi16(_mm512_add_epi16(idx0, _mm512_set1_epi16((short)(4 * g))), sc);
        sumi = _mm512_dpwssd_epi32(sumi, p, s);
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
}
#else
static inline __m256i dblk_dot(const dblk *o, const int8_t *q8) {
    const __m256i s0 = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)o->sc));
    const __m256i s1 = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)(o->sc + 8)));
    __m256i sumi = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) {
        const __m256i v = _mm256_load_si256((const __m256i *)(o->v + 32 * g));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(q8 + 32 * g));
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_shuffle_epi8(g < 4 ? s0 : s1, pick16(8 + g % 4))));
    }
    return sumi;
}
#endif
typedef __m256 facc;
#define FACC_ZERO _mm256_setzero_ps()
static inline facc facc_add(facc a, float s, __m256i i) { return _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(i), a); }
static inline float facc_sum(facc a) { return hsum_ps(a); }
#else
static inline int dblk_dot(const dblk *o, const int8_t *q8) {
    int sumi = 0;
    for (int j = 0; j < 16; j++) {
        int s = 0;
        for (int i = 0; i < 16; i++) s += o->v[16 * j + i] * q8[16 * j + i];
        sumi += o->sc[j] * s;
    }
    return sumi;
}
typedef float facc;
#define FACC_ZERO 0.f
static inline facc facc_add(facc a, float s, int i) { return a + s * (float)i; }
static inline float facc_sum(facc a) { return a; }
#endif

static inline int dblk_mins(const dblk *o, const int16_t *bs) {
#ifdef __AVX2__
    const __m256i p = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)o->mn), _mm256_loadu_si256((const __m256i *)bs));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
#else
    int m = 0;
    for (int j = 0; j < 16; j++) m += o->mn[j] * bs[j];
    return m;
#endif
}

/* rows of decoded blocks against tokens: the one-token and four-token kernels' float operations, in
   their order, so a prefill through a decoded panel gives every element the one-token bits */
FORCE_INLINE void dblk_rows(const dblk *o, int nb, const qrow *x, float *out, const int R, const int mins) {
    facc acc[4] = {FACC_ZERO, FACC_ZERO, FACC_ZERO, FACC_ZERO}; float accm[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b = 0; b < nb; b++)
        for (int r = 0; r < R; r++) {
            acc[r] = facc_add(acc[r], o[b].d * x[r].d[b], dblk_dot(o + b, x[r].q + b * QK));
            if (mins) accm[r] += o[b].dmin * x[r].d[b] * (float)dblk_mins(o + b, x[r].bs + b * 16);
        }
    for (int r = 0; r < R; r++) out[r] = facc_sum(acc[r]) - accm[r];
}

typedef void (*dec_fn)(const uint8_t *, dblk *);
static dec_fn dec_for(int type) {
    switch (type) {
    case T_Q2_K: return dec_q2k;
    case T_Q3_K: return dec_q3k;
    case T_IQ4_XS: return dec_iq4xs;
    case T_IQ2_XXS: return dec_iq2xxs;
    case T_IQ2_XS: return dec_iq2xs;
    case T_IQ2_S: return dec_iq2s;
    case T_IQ3_XXS: return dec_iq3xxs;
    case T_IQ3_S: return dec_iq3s;
    case T_IQ1_S: return dec_iq1s;
    case T_IQ1_M: return dec_iq1m;
    }
    return 0;
}

/* From this many tokens a matrix of a decoded type runs through a decoded panel (each block decoded
   once for every token instead of once per four) */
#define DBLK_MIN_TOKENS 8
#define DBLK_PANEL_BYTES (192 * 1024)
static _Thread_local uint8_t *d_panel = 0;
static _Thread_local size_t d_panel_n = 0;

/* weight rows [n0, n1) of a decoded type against the M quantized rows xr (as gemm_rows says): rows in
   panels decoded once, then every group of four tokens, then the tokens left, meet each row */
static int gemm_rows_dblk(dec_fn dec, int mins, const uint8_t *w, long rb, int nb, int n0, int n1,
                          const qrow *xr, int M, float *const *yr, int y0, const float *scale) {
    int pr = (int)(DBLK_PANEL_BYTES / ((long)nb * (long)sizeof(dblk)));
    pr = pr < 1 ? 1 : pr;
    dblk *panel = (dblk *)grow_only(&d_panel, &d_panel_n, (size_t)pr * nb * sizeof(dblk));
    if (!panel) return -1;
    const long bytes = rb / nb;
    for (int p0 = n0; p0 < n1; p0 += pr) {
        const int p1 = p0 + pr < n1 ? p0 + pr : n1;
        for (int n = p0; n < p1; n++)
            for (int b = 0; b < nb; b++) dec(w + rb * n + bytes * b, panel + (long)(n - p0) * nb + b);
        int m = 0;
        for (; m + 4 <= M; m += 4)
            for (int n = p0; n < p1; n++) {
                float o[4];
                dblk_rows(panel + (long)(n - p0) * nb, nb, xr + m, o, 4, mins);
                for (int r = 0; r < 4; r++)
                    if (scale) yr[m + r][n - y0] += scale[m + r] * o[r]; else yr[m + r][n - y0] = o[r];
            }
        for (; m < M; m++)
            for (int n = p0; n < p1; n++) {
                float o;
                dblk_rows(panel + (long)(n - p0) * nb, nb, xr + m, &o, 1, mins);
                if (scale) yr[m][n - y0] += scale[m] * o; else yr[m][n - y0] = o;
            }
    }
    return 0;
}

/* one weight row of nb blocks . one q8_K row, and the same against four rows (each row's float
   operations those of the one-row kernel, in its order, so the same bits) */
#ifdef HAVE_FUSED
/* one token: each group decoded into a register and multiplied at once (no dblk in memory); the
   int32 lanes are dblk_dot's, the float operations the decoded kernels', so the same bits */
static inline int q2k_mins(const uint8_t *w, const int16_t *bs) {
    const __m128i m = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)w), 4), _mm_set1_epi8(0xF));
    const __m256i p = _mm256_madd_epi16(_mm256_cvtepu8_epi16(m), _mm256_loadu_si256((const __m256i *)bs));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}
#define DBLK_DOT1_FUSED(name, bytes, decode, mins)                                                     \
static float dot_##name(const uint8_t *w, int nb, qrow x) {                                           \
    facc acc = FACC_ZERO; float accm = 0.f;                                                            \
    for (int b = 0; b < nb; b++) {                                                                     \
        const uint8_t *blk = w + (long)b * (bytes);                                                   \
        _mm_prefetch((const char *)(blk + PF_AHEAD), _MM_HINT_T0);                                     \
        _mm_prefetch((const char *)(blk + PF_AHEAD + 64), _MM_HINT_T0);                                \
        int8_t ls[16];                                                                                 \
        s_##name(blk, ls);                                                                             \
        const __m256i s0 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)ls)));      \
        const __m256i s1 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(ls + 8)))); \
        const int8_t *q8 = x.q + b * QK;                                                               \
        __m256i sumi = _mm256_setzero_si256();                                                         \
        _Pragma("GCC unroll 8")                                                                        \
        for (int g = 0; g < 8; g++) {                                                                  \
            const __m256i v = g_##name(blk, g), xx = _mm256_loadu_si256((const __m256i *)(q8 + 32 * g)); \
            const __m256i pr = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(xx, v));   \
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(pr, _mm256_shuffle_epi8(g < 4 ? s0 : s1, pick16(8 + g % 4)))); \
        }                                                                                              \
        acc = facc_add(acc, d_##name(blk) * x.d[b], sumi);                                             \
        if (mins) accm += f16(blk + 82) * x.d[b] * (float)q2k_mins(blk, x.bs + b * 16);               \
    }                                                                                                  \
    return facc_sum(acc) - accm;                                                                       \
}
#endif
#define DBLK_DOT1_DECODED(name, bytes, decode, mins)                                                   \
static float dot_##name(const uint8_t *w, int nb, qrow x) {                                           \
    facc acc = FACC_ZERO; float accm = 0.f;                                                            \
    dblk o;                                                                                            \
    for (int b = 0; b < nb; b++) {                                                                     \
        decode(w + (long)b * (bytes), &o);                                                            \
        acc = facc_add(acc, o.d * x.d[b], dblk_dot(&o, x.q + b * QK));                                 \
        if (mins) accm += o.dmin * x.d[b] * (float)dblk_mins(&o, x.bs + b * 16);                      \
    }                                                                                                  \
    return facc_sum(acc) - accm;                                                                       \
}
/* which one-token kernel a type takes: fused where it measured faster (benchmarks/kernels.py, the
   151936 x 2048 head shape, AMD EPYC Zen 4: IQ2_XXS, IQ3_XXS, IQ4_XS, Q2_K 1.0-1.35x ggml's time
   fused against 1.17-1.75x decoded), else decoded (Q3_K, IQ2_XS, IQ2_S, IQ1_S, IQ1_M, IQ3_S:
   1.27-1.94x decoded against 1.6-3.2x fused); the bits are the same either way */
#ifdef HAVE_FUSED
#define DBLK_DOT1_F DBLK_DOT1_FUSED
#else
#define DBLK_DOT1_F DBLK_DOT1_DECODED
#endif
#define DBLK_KERNELS(name, bytes, decode, mins, one)                                                   \
one(name, bytes, decode, mins)                                                                         \
static void dot4_##name(const uint8_t *w, int nb, const qrow *x, float *out) {                       \
    facc acc[4] = {FACC_ZERO, FACC_ZERO, FACC_ZERO, FACC_ZERO}; float accm[4] = {0.f, 0.f, 0.f, 0.f};  \
    dblk o;                                                                                            \
    for (int b = 0; b < nb; b++) {                                                                     \
        decode(w + (long)b * (bytes), &o);                                                            \
        for (int r = 0; r < 4; r++) {                                                                  \
            acc[r] = facc_add(acc[r], o.d * x[r].d[b], dblk_dot(&o, x[r].q + b * QK));                \
            if (mins) accm[r] += o.dmin * x[r].d[b] * (float)dblk_mins(&o, x[r].bs + b * 16);         \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < 4; r++) out[r] = facc_sum(acc[r]) - accm[r];                                   \
}
DBLK_KERNELS(q2k, 84, dec_q2k, 1, DBLK_DOT1_F)
DBLK_KERNELS(q3k, 110, dec_q3k, 0, DBLK_DOT1_DECODED)
DBLK_KERNELS(iq4xs, 136, dec_iq4xs, 0, DBLK_DOT1_F)
DBLK_KERNELS(iq2xxs, 66, dec_iq2xxs, 0, DBLK_DOT1_F)
DBLK_KERNELS(iq2xs, 74, dec_iq2xs, 0, DBLK_DOT1_DECODED)
DBLK_KERNELS(iq2s, 82, dec_iq2s, 0, DBLK_DOT1_DECODED)
DBLK_KERNELS(iq3xxs, 98, dec_iq3xxs, 0, DBLK_DOT1_F)
DBLK_KERNELS(iq3s, 110, dec_iq3s, 0, DBLK_DOT1_DECODED)
DBLK_KERNELS(iq1s, 50, dec_iq1s, 0, DBLK_DOT1_DECODED)
DBLK_KERNELS(iq1m, 56, dec_iq1m, 0, DBLK_DOT1_DECODED)

/* ---- 32-element types ---------------------------------------------------------------------- */
static inline float e8m0_half(uint8_t e) {   /* 2^(e - 128): ggml's GGML_E8M0_TO_FP32_HALF */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f; memcpy(&f, &bits, 4); return f;
}
static inline float d_f16at0(const uint8_t *w) { return f16(w); }
static inline float d_e8m0(const uint8_t *w) { return e8m0_half(w[0]); }

#ifdef __AVX2__
static inline __m256i bits32(const uint8_t *qh) {       /* byte j: 0x10 where bit j of qh is set */
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(qh)), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
static inline __m256 dotu32(__m256i u, __m256i x) {     /* unsigned 0..31 . int8 over 32 lanes -> 8 float partials */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
/* one block's 32 values in a register: unsigned (Q4_1, Q5_1: 0..31) or signed */
static inline __m256i v_q41(const uint8_t *w) { return nibbles32(w + 4); }
static inline __m256i v_q51(const uint8_t *w) { return _mm256_or_si256(nibbles32(w + 8), bits32(w + 4)); }
static inline __m256i v_q50(const uint8_t *w) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(w + 6), bits32(w + 2)), _mm256_set1_epi8(16));
}
static inline __m256i v_iq4nl(const uint8_t *w) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)KVALUES_IQ4NL)), nibbles32(w + 2));
}
static inline __m256i v_mxfp4(const uint8_t *w) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)KVALUES_MXFP4)), nibbles32(w + 1));
}

/* R rows of x (1 or 4, a constant at each use) against one weight row of 32-element blocks: each
   block decoded once for the R; per row the one-row kernel's float operations in its order (one
   fmadd of d * dx a block, Q4_1 / Q5_1's min terms m * s summed apart), so R changes no bit */
#define Q32_KERNELS(name, bytes, values, dscale, is_signed, has_min)                                  \
FORCE_INLINE void q32_rows_##name(const uint8_t *w, int nb, const qrow *x, float *out, const int R) { \
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
    float summs[4] = {0.f, 0.f, 0.f, 0.f};                                                             \
    for (int b = 0; b < nb; b++, w += (bytes)) {                                                       \
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);                                       \
        const __m256i v = values(w), av = is_signed ? _mm256_sign_epi8(v, v) : v;                      \
        const float d = dscale(w), m = has_min ? f16(w + 2) : 0.f;                                     \
        for (int r = 0; r < R; r++) {                                                                  \
            const __m256i xx = _mm256_loadu_si256((const __m256i *)(x[r].q + b * Q80));               \
            const __m256 pr = _mm256_cvtepi32_ps(_mm256_madd_epi16(                                   \
                _mm256_maddubs_epi16(av, is_signed ? _mm256_sign_epi8(xx, v) : xx), _mm256_set1_epi16(1))); \
            if (has_min) summs[r] += m * ((const float *)x[r].bs)[b];                                  \
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), pr, acc[r]);                       \
        }                                                                                              \
    }                                                                                                  \
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]) + summs[r];                                   \
}                                                                                                      \
static float dot_##name(const uint8_t *w, int nb, qrow x) { float o; q32_rows_##name(w, nb, &x, &o, 1); return o; } \
static void dot4_##name(const uint8_t *w, int nb, const qrow *x, float *out) { q32_rows_##name(w, nb, x, out, 4); }
Q32_KERNELS(q41, 20, v_q41, d_f16at0, 0, 1)
Q32_KERNELS(q51, 24, v_q51, d_f16at0, 0, 1)
Q32_KERNELS(q50, 22, v_q50, d_f16at0, 1, 0)
Q32_KERNELS(iq4nl, 18, v_iq4nl, d_f16at0, 1, 0)
Q32_KERNELS(mxfp4, 17, v_mxfp4, d_e8m0, 1, 0)
#define HAVE_Q32_DOT4 1

/* F16 / BF16: nb is K / 32; four accumulators of eight lanes, as ggml's GGML_F16_STEP loop */
static float dot_f16(const uint8_t *w, int nb, qrow x) {
    const float *xf = (const float *)x.q;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < 32 * nb; i += 32) {
        _mm_prefetch((const char *)(w + 2 * i + PF_AHEAD), _MM_HINT_T0);
        for (int k = 0; k < 4; k++)
            a[k] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * (i + 8 * k)))),
                                   _mm256_loadu_ps(xf + i + 8 * k), a[k]);
    }
    return hsum_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}
static float dot_bf16(const uint8_t *w, int nb, qrow x) {
    const float *xf = (const float *)x.q;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < 32 * nb; i += 32) {
        _mm_prefetch((const char *)(w + 2 * i + PF_AHEAD), _MM_HINT_T0);
        for (int k = 0; k < 4; k++) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * (i + 8 * k))));
            a[k] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), _mm256_loadu_ps(xf + i + 8 * k), a[k]);
        }
    }
    return hsum_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}
#else
static inline void nib32(const uint8_t *qs, int *v) { for (int j = 0; j < 16; j++) { v[j] = qs[j] & 0xF; v[j + 16] = qs[j] >> 4; } }
static inline void hi32(const uint8_t *qh, int *v) { const uint32_t h = rd32(qh); for (int j = 0; j < 32; j++) v[j] |= ((h >> j) & 1) << 4; }
static inline int idot32(const int *v, const int8_t *x) { int s = 0; for (int j = 0; j < 32; j++) s += v[j] * x[j]; return s; }
static inline void sv_q41(const uint8_t *w, int *v) { nib32(w + 4, v); }
static inline void sv_q51(const uint8_t *w, int *v) { nib32(w + 8, v); hi32(w + 4, v); }
static inline void sv_q50(const uint8_t *w, int *v) { nib32(w + 6, v); hi32(w + 2, v); for (int j = 0; j < 32; j++) v[j] -= 16; }
static inline void sv_iq4nl(const uint8_t *w, int *v) { nib32(w + 2, v); for (int j = 0; j < 32; j++) v[j] = KVALUES_IQ4NL[v[j]]; }
static inline void sv_mxfp4(const uint8_t *w, int *v) { nib32(w + 1, v); for (int j = 0; j < 32; j++) v[j] = KVALUES_MXFP4[v[j]]; }
#define Q32_SCALAR(name, bytes, values, dscale, has_min)                                                \
static float dot_##name(const uint8_t *w, int nb, qrow x) {                                           \
    float sum = 0.f; const float *s = (const float *)x.bs; int v[32];                                  \
    for (int b = 0; b < nb; b++, w += (bytes)) {                                                       \
        values(w, v);                                                                                  \
        sum += dscale(w) * x.d[b] * (float)idot32(v, x.q + b * Q80) + (has_min ? f16(w + 2) * s[b] : 0.f); \
    }                                                                                                  \
    return sum;                                                                                        \
}
Q32_SCALAR(q41, 20, sv_q41, d_f16at0, 1)
Q32_SCALAR(q51, 24, sv_q51, d_f16at0, 1)
Q32_SCALAR(q50, 22, sv_q50, d_f16at0, 0)
Q32_SCALAR(iq4nl, 18, sv_iq4nl, d_f16at0, 0)
Q32_SCALAR(mxfp4, 17, sv_mxfp4, d_e8m0, 0)
static float dot_f16(const uint8_t *w, int nb, qrow x) {
    const float *xf = (const float *)x.q; float sum = 0.f;
    for (int i = 0; i < 32 * nb; i++) sum += f16(w + 2 * i) * xf[i];
    return sum;
}
static float dot_bf16(const uint8_t *w, int nb, qrow x) {
    const float *xf = (const float *)x.q; float sum = 0.f;
    for (int i = 0; i < 32 * nb; i++) { uint32_t u = (uint32_t)rd16(w + 2 * i) << 16; float f; memcpy(&f, &u, 4); sum += f * xf[i]; }
    return sum;
}
#endif

/* the one-row kernel of a type beyond the first five, its blocks per row and row bytes (0: none) */
static float (*more_dot_for(int type, int K, int *nb, long *row_bytes))(const uint8_t *, int, qrow) {
    static const struct { int type, elems, bytes; float (*dot)(const uint8_t *, int, qrow); } T[] = {
        {T_Q2_K, QK, 84, dot_q2k}, {T_Q3_K, QK, 110, dot_q3k}, {T_IQ4_XS, QK, 136, dot_iq4xs},
        {T_IQ2_XXS, QK, 66, dot_iq2xxs}, {T_IQ2_XS, QK, 74, dot_iq2xs}, {T_IQ2_S, QK, 82, dot_iq2s},
        {T_IQ3_XXS, QK, 98, dot_iq3xxs}, {T_IQ3_S, QK, 110, dot_iq3s}, {T_IQ1_S, QK, 50, dot_iq1s},
        {T_IQ1_M, QK, 56, dot_iq1m}, {T_Q4_1, Q80, 20, dot_q41}, {T_Q5_0, Q80, 22, dot_q50},
        {T_Q5_1, Q80, 24, dot_q51}, {T_IQ4_NL, Q80, 18, dot_iq4nl}, {T_MXFP4, Q80, 17, dot_mxfp4},
        {T_F16, 32, 64, dot_f16}, {T_BF16, 32, 64, dot_bf16}};
    for (unsigned i = 0; i < sizeof T / sizeof T[0]; i++)
        if (T[i].type == type) { *nb = K / T[i].elems; *row_bytes = (long)*nb * T[i].bytes; return T[i].dot; }
    return 0;
}

static void (*more_dot4_for(int type))(const uint8_t *, int, const qrow *, float *) {
    switch (type) {
#ifdef HAVE_Q32_DOT4
    case T_Q4_1: return dot4_q41;
    case T_Q5_1: return dot4_q51;
    case T_Q5_0: return dot4_q50;
    case T_IQ4_NL: return dot4_iq4nl;
    case T_MXFP4: return dot4_mxfp4;
#endif
    case T_Q2_K: return dot4_q2k;
    case T_Q3_K: return dot4_q3k;
    case T_IQ4_XS: return dot4_iq4xs;
    case T_IQ2_XXS: return dot4_iq2xxs;
    case T_IQ2_XS: return dot4_iq2xs;
    case T_IQ2_S: return dot4_iq2s;
    case T_IQ3_XXS: return dot4_iq3xxs;
    case T_IQ3_S: return dot4_iq3s;
    case T_IQ1_S: return dot4_iq1s;
    case T_IQ1_M: return dot4_iq1m;
    }
    return 0;
}
