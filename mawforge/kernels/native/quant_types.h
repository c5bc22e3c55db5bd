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

static void dec_q2k(const uint8_t *w, dblk *o) {
    for (int i = 0; i < 16; i++) { o->sc[i] = w[i] & 0xF; o->mn[i] = w[i] >> 4; }
    const uint8_t *qs = w + 16;
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) o->v[128 * k + 32 * j + l] = (int8_t)((qs[32 * k + l] >> (2 * j)) & 3);
    o->d = f16(w + 80); o->dmin = f16(w + 82);
}

static void dec_q3k(const uint8_t *w, dblk *o) {
    const uint8_t *hm = w, *qs = w + 32;
    uint32_t a[4];
    memcpy(a, w + 96, 12);
    const uint32_t tmp = a[2], m2 = 0x0f0f0f0f, m1 = 0x03030303;
    a[2] = ((a[0] >> 4) & m2) | (((tmp >> 4) & m1) << 4);
    a[3] = ((a[1] >> 4) & m2) | (((tmp >> 6) & m1) << 4);
    a[0] = (a[0] & m2) | (((tmp >> 0) & m1) << 4);
    a[1] = (a[1] & m2) | (((tmp >> 2) & m1) << 4);
    const int8_t *s = (const int8_t *)a;
    for (int i = 0; i < 16; i++) o->sc[i] = (int16_t)(s[i] - 32);
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < 4; j++) {
            const uint8_t m = (uint8_t)(1u << (4 * k + j));
            for (int l = 0; l < 32; l++)
                o->v[128 * k + 32 * j + l] = (int8_t)(((qs[32 * k + l] >> (2 * j)) & 3) - ((hm[l] & m) ? 0 : 4));
        }
    o->d = f16(w + 108);
}

static void dec_iq4xs(const uint8_t *w, dblk *o) {
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

static void dec_iq2xxs(const uint8_t *w, dblk *o) {
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = w + 2 + 8 * ib;
        const uint32_t a1 = rd32(q + 4);
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(2 * (a1 >> 28) + 1);
        for (int l = 0; l < 4; l++) signed8(o->v + 32 * ib + 8 * l, IQ2XXS_GRID[q[l]], KSIGNS8[(a1 >> (7 * l)) & 127]);
    }
    o->d = 0.125f * f16(w);
}

static void dec_iq2xs(const uint8_t *w, dblk *o) {
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

static void dec_iq2s(const uint8_t *w, dblk *o) {
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

static void dec_iq3xxs(const uint8_t *w, dblk *o) {
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

static void dec_iq3s(const uint8_t *w, dblk *o) {
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

static void dec_iq1s(const uint8_t *w, dblk *o) {
    const uint8_t *qs = w + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = rd16(w + 34 + 2 * ib);
        o->sc[2 * ib] = o->sc[2 * ib + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
        const int delta = qh & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; l++) iq1_vals(o->v + 32 * ib + 8 * l, IQ1S_GRID[qs[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], delta);
    }
    o->d = f16(w) * 0.125f;
}

static void dec_iq1m(const uint8_t *w, dblk *o) {
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
/* sum over the block of sc[i / 16] * v[i] * x[i], as eight int32 lanes */
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
    int m = 0;
    for (int j = 0; j < 16; j++) m += o->mn[j] * bs[j];
    return m;
}

/* one weight row of nb blocks . one q8_K row, and the same against four rows (each row's float
   operations those of the one-row kernel, in its order, so the same bits) */
#define DBLK_KERNELS(name, bytes, decode, mins)                                                        \
static float dot_##name(const uint8_t *w, int nb, qrow x) {                                           \
    facc acc = FACC_ZERO; float accm = 0.f;                                                            \
    dblk o;                                                                                            \
    for (int b = 0; b < nb; b++) {                                                                     \
        decode(w + (long)b * (bytes), &o);                                                            \
        acc = facc_add(acc, o.d * x.d[b], dblk_dot(&o, x.q + b * QK));                                 \
        if (mins) accm += o.dmin * x.d[b] * (float)dblk_mins(&o, x.bs + b * 16);                      \
    }                                                                                                  \
    return facc_sum(acc) - accm;                                                                       \
}                                                                                                      \
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
DBLK_KERNELS(q2k, 84, dec_q2k, 1)
DBLK_KERNELS(q3k, 110, dec_q3k, 0)
DBLK_KERNELS(iq4xs, 136, dec_iq4xs, 0)
DBLK_KERNELS(iq2xxs, 66, dec_iq2xxs, 0)
DBLK_KERNELS(iq2xs, 74, dec_iq2xs, 0)
DBLK_KERNELS(iq2s, 82, dec_iq2s, 0)
DBLK_KERNELS(iq3xxs, 98, dec_iq3xxs, 0)
DBLK_KERNELS(iq3s, 110, dec_iq3s, 0)
DBLK_KERNELS(iq1s, 50, dec_iq1s, 0)
DBLK_KERNELS(iq1m, 56, dec_iq1m, 0)

/* ---- 32-element types ---------------------------------------------------------------------- */
static inline float e8m0_half(uint8_t e) {   /* 2^(e - 128): ggml's GGML_E8M0_TO_FP32_HALF */
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f; memcpy(&f, &bits, 4); return f;
}

#ifdef __AVX2__
static inline __m256i nibbles32(const uint8_t *qs) {   /* bytes 0-15 the low nibbles, 16-31 the high */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0xF));
}
static inline __m256i bits32(const uint8_t *qh) {       /* byte j: 0x10 where bit j of qh is set */
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(qh)), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
static inline __m256 dotu32(__m256i u, __m256i x) {     /* unsigned 0..31 . int8 over 32 lanes -> 8 float partials */
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
#define XQ(b) _mm256_loadu_si256((const __m256i *)(x.q + (b) * Q80))

static float dot_q41(const uint8_t *w, int nb, qrow x) {
    __m256 acc = _mm256_setzero_ps(); float summs = 0.f;
    const float *s = (const float *)x.bs;
    for (int b = 0; b < nb; b++, w += 20) {
        summs += f16(w + 2) * s[b];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x.d[b]), dotu32(nibbles32(w + 4), XQ(b)), acc);
    }
    return hsum_ps(acc) + summs;
}
static float dot_q51(const uint8_t *w, int nb, qrow x) {
    __m256 acc = _mm256_setzero_ps(); float summs = 0.f;
    const float *s = (const float *)x.bs;
    for (int b = 0; b < nb; b++, w += 24) {
        summs += f16(w + 2) * s[b];
        const __m256i q = _mm256_or_si256(nibbles32(w + 8), bits32(w + 4));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x.d[b]), dotu32(q, XQ(b)), acc);
    }
    return hsum_ps(acc) + summs;
}
static float dot_q50(const uint8_t *w, int nb, qrow x) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 22) {
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibbles32(w + 6), bits32(w + 2)), _mm256_set1_epi8(16));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x.d[b]), dot32_i8(q, XQ(b)), acc);
    }
    return hsum_ps(acc);
}
static float dot_iq4nl(const uint8_t *w, int nb, qrow x) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)KVALUES_IQ4NL));
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 18) {
        const __m256i q = _mm256_shuffle_epi8(tab, nibbles32(w + 2));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x.d[b]), dot32_i8(q, XQ(b)), acc);
    }
    return hsum_ps(acc);
}
static float dot_mxfp4(const uint8_t *w, int nb, qrow x) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)KVALUES_MXFP4));
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 17) {
        const __m256i q = _mm256_shuffle_epi8(tab, nibbles32(w + 1));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(e8m0_half(w[0]) * x.d[b]), dot32_i8(q, XQ(b)), acc);
    }
    return hsum_ps(acc);
}
#undef XQ

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
static float dot_q41(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f; const float *s = (const float *)x.bs; int v[32];
    for (int b = 0; b < nb; b++, w += 20) { nib32(w + 4, v); sum += f16(w) * x.d[b] * (float)idot32(v, x.q + b * Q80) + f16(w + 2) * s[b]; }
    return sum;
}
static float dot_q51(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f; const float *s = (const float *)x.bs; int v[32];
    for (int b = 0; b < nb; b++, w += 24) { nib32(w + 8, v); hi32(w + 4, v); sum += f16(w) * x.d[b] * (float)idot32(v, x.q + b * Q80) + f16(w + 2) * s[b]; }
    return sum;
}
static float dot_q50(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f; int v[32];
    for (int b = 0; b < nb; b++, w += 22) {
        nib32(w + 6, v); hi32(w + 2, v);
        for (int j = 0; j < 32; j++) v[j] -= 16;
        sum += f16(w) * x.d[b] * (float)idot32(v, x.q + b * Q80);
    }
    return sum;
}
static float dot_iq4nl(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f; int v[32];
    for (int b = 0; b < nb; b++, w += 18) {
        nib32(w + 2, v);
        for (int j = 0; j < 32; j++) v[j] = KVALUES_IQ4NL[v[j]];
        sum += f16(w) * x.d[b] * (float)idot32(v, x.q + b * Q80);
    }
    return sum;
}
static float dot_mxfp4(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f; int v[32];
    for (int b = 0; b < nb; b++, w += 17) {
        nib32(w + 1, v);
        for (int j = 0; j < 32; j++) v[j] = KVALUES_MXFP4[v[j]];
        sum += e8m0_half(w[0]) * x.d[b] * (float)idot32(v, x.q + b * Q80);
    }
    return sum;
}
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
