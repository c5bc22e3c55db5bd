/* Matmul on GGUF blocks as llama.cpp's CPU backend computes it: y[M,N] = x[M,K] . W[N,K]^T with
 * W in its GGUF bytes and x quantized per row to the weight type's "vec_dot type" first:
 *   Q4_K, Q5_K, Q6_K  ->  q8_K (int8 per 256, float scale, sums of 16 for the min terms)
 *   Q8_0, Q4_0        ->  q8_0 (int8 per 32, float16 scale)
 * and every block dot product done in integers, scaled once per block in float32. The integer
 * parts are exact, so results differ from llama.cpp's only in float32 summation order; and they
 * differ from a float32 dequantize-and-multiply by the activation rounding llama.cpp also has.
 *
 * Entry points (called through ctypes by kernels/native/__init__.py):
 *   qgemm(type, x, M, K, w, N, y)        one weight matrix; rows of W split across OpenMP threads
 *   moe_ffn(...)                          a layer's routed experts (SwiGLU) in one parallel region
 *   quantize_acts(type, x, K, q, d, bs)   the activation quantizer alone (tests)
 *
 * Bit layouts follow ggml's dequantize_row_* (docs/quant-layouts.md). AVX2 paths use
 * maddubs/madd; other CPUs run the same integer arithmetic in scalar C.
 *
 * Legend: M rows of x (tokens), K row length, N rows of W, nb blocks a row, E experts, F expert width.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

static int g_team = 0;     /* 0: the OpenMP default */
/* *buf holding at least n bytes, 64-byte aligned: a buffer that only grows (*have its size; 0 and
   NULL when an allocation failed) */
static uint8_t *grow_only(uint8_t **buf, size_t *have, size_t n) {
    if (n > *have) {
        free(*buf);
        *buf = (uint8_t *)aligned_alloc(64, (n + 63) & ~(size_t)63);
        *have = *buf ? n : 0;
    }
    return *buf;
}
static inline int team_size(void) { return g_team > 0 ? g_team : omp_get_max_threads(); }
enum { PAR_ELEMS = 1 << 16 };      /* elementwise kernels split over the team from this many floats */

enum { T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
enum { QK = 256, Q80 = 32 };

#ifdef __F16C__
#include <immintrin.h>
static inline float f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
static inline float f16_soft(const uint8_t *p) {
#else
static inline float f16(const uint8_t *p) {
#endif
    uint16_t h; memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            man &= 0x3ff;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000u | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
}

/* float32 -> float16 -> float32, round to nearest even (the scale of a q8_0 block is stored f16) */
static inline float round_f16(float f) {
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = x & 0x80000000u; x ^= sign;
    uint16_t h;
    if (x >= 0x7f800000u) h = (uint16_t)(x > 0x7f800000u ? 0x7e00 : 0x7c00);
    else if (x >= 0x477ff000u) h = 0x7c00;                              /* overflow to inf */
    else if (x < 0x38800000u) {                                           /* subnormal or zero */
        float a; memcpy(&a, &x, 4);
        a += 0.5f;                                                        /* 2^-1 aligns 2^-24 ulps */
        uint32_t b; memcpy(&b, &a, 4); h = (uint16_t)(b - 0x3f000000u);
    } else {
        uint32_t odd = (x >> 13) & 1;
        x += 0xc8000fffu + odd;                                           /* rebias and round */
        h = (uint16_t)(x >> 13);
    }
    h |= (uint16_t)(sign >> 16);
    uint8_t p[2]; memcpy(p, &h, 2); return f16(p);
}

static inline int nearest_int(float v) {  /* round half to even, |v| < 2^22 */
    float s = v + 12582912.f; int32_t i; memcpy(&i, &s, 4); return (i & 0x007fffff) - 0x00400000;
}

/* ---- activation quantizers ---------------------------------------------------------------- */
/* A quantized row of K values: q int8 [K], d float [K/256 or K/32], bs int16 [K/16] (q8_K only). */
typedef struct { int8_t *q; float *d; int16_t *bs; } qrow;

enum { T_F16 = 1, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q2_K = 10, T_Q3_K = 11, T_IQ2_XXS = 16, T_IQ2_XS = 17,
       T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22, T_IQ4_XS = 23, T_IQ1_M = 29,
       T_BF16 = 30, T_MXFP4 = 39 };
/* activation kinds: 0 q8_0, 1 q8_K, 2 q8_1, 3 f16, 4 bf16 */
enum { A_Q80 = 0, A_Q8K = 1, A_Q81 = 2, A_F16 = 3, A_BF16 = 4 };

static int act_kind(int type) {
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q5_0: case T_IQ4_NL: case T_MXFP4: return A_Q80;
    case T_Q4_1: case T_Q5_1: return A_Q81;
    case T_F16: return A_F16;
    case T_BF16: return A_BF16;
    default: return A_Q8K;
    }
}
/* elements of x one activation scale covers (the row length must be a multiple) */
static int act_block(int type) {
    const int a = act_kind(type);
    return a == A_Q8K ? QK : a == A_F16 || a == A_BF16 ? 32 : Q80;
}
static int act_float(int type) { const int a = act_kind(type); return a == A_F16 || a == A_BF16; }

static int is_supported(int type);

/* q8_K as llama.cpp's quantize_row_q8_K / quantize_mat_q8_K: the scale maps the element of largest
   magnitude to -127 (iscale = -127 / max, max signed), d = 1 / iscale. */
static void quant_q8k_c(const float *x, int K, qrow r) {
    for (int b = 0; b < K / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.f, max = 0.f;
        for (int i = 0; i < QK; i++) { float a = fabsf(v[i]); if (a > amax) { amax = a; max = v[i]; } }
        int8_t *q = r.q + b * QK;
        if (amax == 0.f) {
            memset(q, 0, QK); r.d[b] = 0.f;
            for (int j = 0; j < 16; j++) r.bs[b * 16 + j] = 0;
            continue;
        }
        const float iscale = -127.f / max;
        for (int i = 0; i < QK; i++) { int t = nearest_int(iscale * v[i]); q[i] = (int8_t)(t > 127 ? 127 : t); }
        for (int j = 0; j < 16; j++) {
            int s = 0; for (int i = 0; i < 16; i++) s += q[16 * j + i];
            r.bs[b * 16 + j] = (int16_t)s;
        }
        r.d[b] = 1.f / iscale;
    }
}

/* q8_0 as llama.cpp's AVX2 quantize_row_q8_0: d = max|x| / 127 stored as f16, q = round(x * 127 / max|x|) */
static void quant_q80_c(const float *x, int K, qrow r) {
    for (int b = 0; b < K / Q80; b++) {
        const float *v = x + b * Q80;
        float amax = 0.f;
        for (int i = 0; i < Q80; i++) { float a = fabsf(v[i]); amax = a > amax ? a : amax; }
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < Q80; i++) r.q[b * Q80 + i] = (int8_t)nearest_int(v[i] * id);
        r.d[b] = round_f16(amax / 127.f);
    }
}

#ifdef __AVX2__
#include <immintrin.h>
static inline float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* 32 floats times s, rounded half to even, saturated to int8, in order */
static inline __m256i round_pack32(const float *v, __m256 s) {
    __m256i i[4];
    for (int k = 0; k < 4; k++)
        i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), s),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline int sum16_i8(const int8_t *q) {   /* via unsigned sums of |q + 128| */
    const __m128i u = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), _mm_set1_epi8((char)0x80));
    const __m128i s = _mm_sad_epu8(u, _mm_setzero_si128());
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

/* the same values as the scalar quantizers (ties between +max and -max resolve to +, as
   llama.cpp's AVX2 activation packer does) */
static void quant_q8k(const float *x, int K, qrow r) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / QK; b++) {
        const float *v = x + b * QK;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < QK; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
        const float amax = hmax_ps(m);
        int8_t *q = r.q + b * QK;
        if (amax == 0.f) {
            memset(q, 0, QK); r.d[b] = 0.f;
            for (int j = 0; j < 16; j++) r.bs[b * 16 + j] = 0;
            continue;
        }
        const __m256 av = _mm256_set1_ps(amax);
        int pos = 0;
        for (int i = 0; i < QK; i += 8) pos |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), av, _CMP_EQ_OQ));
        const float iscale = pos ? -127.f / amax : 127.f / amax;
        const __m256 s = _mm256_set1_ps(iscale);
        for (int i = 0; i < QK; i += 32) _mm256_storeu_si256((__m256i *)(q + i), round_pack32(v + i, s));
        for (int j = 0; j < 16; j++) r.bs[b * 16 + j] = (int16_t)sum16_i8(q + 16 * j);
        r.d[b] = 1.f / iscale;
    }
}

static void quant_q80(const float *x, int K, qrow r) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < K / Q80; b++) {
        const float *v = x + b * Q80;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < Q80; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
        const float amax = hmax_ps(m);
        const float id = amax != 0.f ? 127.f / amax : 0.f;
        _mm256_storeu_si256((__m256i *)(r.q + b * Q80), round_pack32(v, _mm256_set1_ps(id)));
        r.d[b] = round_f16(amax / 127.f);
    }
}
#else
#define quant_q8k quant_q8k_c
#define quant_q80 quant_q80_c
#endif


/* bytes of scratch one quantized row of K needs, and a qrow laid out in it */
/* q8 rows: K int8, the scales, the sums of 16 (q8_1 keeps its s there); float rows (F16 / BF16
   weights) keep x as float32 in the q bytes: 4 K */
static size_t qrow_bytes(int type, int K) {
    return (size_t)K * (act_float(type) ? 4 : 1) + (size_t)(K / Q80) * 4 + (size_t)(K / 16) * 2 + 64;
}
static qrow qrow_at(uint8_t *base, int K) {
    qrow r; r.q = (int8_t *)base;
    r.d = (float *)(base + ((K + 15) & ~15));
    r.bs = (int16_t *)((uint8_t *)r.d + (K / Q80) * 4);
    return r;
}

static inline void k_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* ---- block dot products: one weight row (nb blocks) . one quantized row ------------------- */
#ifdef __AVX2__
#include <immintrin.h>


static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum_ps128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* k_scales in vector registers: the 12 scale bytes at q (16 read; the 4 after are the block's
   own) -> bytes sc0..7, mn0..7, without the round trip through memory that a byte-wise
   broadcast of each scale costs. */
static inline __m128i k_scales_v(const uint8_t *q) {
    const __m128i u = _mm_loadu_si128((const __m128i *)q);                   /* u32 lanes u0 u1 u2 */
    const __m128i lo = _mm_and_si128(u, _mm_set1_epi8(0x3f));                /* sc0-3, mn0-3 */
    const __m128i hi = _mm_or_si128(                                          /* sc4-7, mn4-7 */
        _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(u, 0xaa), _mm_setr_epi32(0, 4, 0, 4)), _mm_set1_epi8(0x0f)),
        _mm_and_si128(_mm_srli_epi32(u, 2), _mm_set1_epi8(0x30)));            /* bits 6-7 of u0 / u1 */
    return _mm_unpacklo_epi32(lo, hi);
}

/* pshufb controls: PICK16[k] broadcasts int16 element k of each 128-bit lane over the lane;
   PICK16[8 + k] element 2k over the low lane and 2k + 1 over the high one (a table in memory,
   so the kernels use them as load operands instead of holding eight registers) */
#define PK(a, b) {(0x0100 + 0x0202 * (a)) * 0x0001000100010001ull, (0x0100 + 0x0202 * (a)) * 0x0001000100010001ull, \
                  (0x0100 + 0x0202 * (b)) * 0x0001000100010001ull, (0x0100 + 0x0202 * (b)) * 0x0001000100010001ull}
static const uint64_t PICK16_TABLE[12][4] __attribute__((aligned(32))) = {
    PK(0, 0), PK(1, 1), PK(2, 2), PK(3, 3), PK(4, 4), PK(5, 5), PK(6, 6), PK(7, 7),
    PK(0, 1), PK(2, 3), PK(4, 5), PK(6, 7)};
#undef PK
static inline __m256i pick16(int k) { return _mm256_load_si256((const __m256i *)PICK16_TABLE[k]); }

/* Block dot products of R weight rows (R = 1 or 2, a constant at every call site) against one
   quantized row of x: the rows share the loads of x and give the core independent chains.
   Each row's float operations are those of a one-row loop, in its order (ggml's order: one
   8-lane fused multiply-add of d * sum per block, mins in a separate 4-lane sum, one horizontal
   sum at the end), so R does not change a bit of any result; the integer sums are exact. */
#define RMAX 2
#define FORCE_INLINE static inline __attribute__((always_inline))
/* Bytes ahead of the current block to prefetch in each row. A page ahead: the hardware
   streamer stops at each 4 KiB page, so a shorter distance starts every page cold. On the
   48-layer file's resident decode (Intel Xeon, in one process, alternating every 4 tokens)
   640 gave 170 ms a token and 4096 139 ms; 2048 was 6% slower than 4096, 6144 and 8192 the same. */
#define PF_AHEAD 4096

/* Q4_K (144 bytes a block) and Q5_K (176: the same layout plus 32 bytes of fifth bits before
   the nibbles). `five` is a constant at the call sites, so each gets its own specialization. */
FORCE_INLINE void dot_k45_rows(const uint8_t *const *wr, const int R, int nb, qrow x, float *out, const int five) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m16 = _mm256_set1_epi8(16);
    const int bytes = five ? 176 : 144;
    __m256 acc[RMAX];
    __m128 accm[RMAX];
    for (int r = 0; r < R; r++) { acc[r] = _mm256_setzero_ps(); accm[r] = _mm_setzero_ps(); }
    for (int b = 0; b < nb; b++) {
        const float xd = x.d[b];
        const int8_t *q8 = x.q + b * QK;
        const __m128i bsum = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(x.bs + b * 16)),
                                            _mm_loadu_si128((const __m128i *)(x.bs + b * 16 + 8)));
        for (int r = 0; r < R; r++) {
            const uint8_t *w = wr[r] + (long)b * bytes, *qs = w + (five ? 48 : 16);
            _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PF_AHEAD + 64), _MM_HINT_T0);
            if (five) _mm_prefetch((const char *)(w + PF_AHEAD + 128), _MM_HINT_T0);
            const __m128i sm = k_scales_v(w + 4);
            const __m128i mins = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm)), bsum);
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(f16(w + 2) * xd), _mm_cvtepi32_ps(mins), accm[r]);
            const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
            const __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                __m256i lo = _mm256_and_si256(q4, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
                if (five) {  /* bit 2j of qh[i] adds 16 to the low nibble, bit 2j+1 to the high one */
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * j), 4), m16));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * j + 1), 4), m16));
                }
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(q8 + 64 * j));
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(q8 + 64 * j + 32));
                const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_shuffle_epi8(sc, pick16(2 * j)));
                const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), _mm256_shuffle_epi8(sc, pick16(2 * j + 1)));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * xd), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]) - hsum_ps128(accm[r]);
}

/* Q6_K (210 bytes a block): 6-bit values (0..63) times int8 with maddubs; the -32 offset comes
   off through the sums of 16 */
FORCE_INLINE void dot_q6k_rows(const uint8_t *const *wr, const int R, int nb, qrow x, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *q8 = x.q + b * QK;
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(x.bs + b * 16));
        for (int r = 0; r < R; r++) {
            const uint8_t *w = wr[r] + (long)b * 210;
            _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PF_AHEAD + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + PF_AHEAD + 128), _MM_HINT_T0);
            /* 32 * sum_j sc[j] * (sum of x in sub-block j), subtracted for the -32 offset of the values */
            __m256i sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
                _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192))), bs), 5));
            for (int j = 0; j < 2; j++) {
                const uint8_t *ql = w + 64 * j, *qh = w + 128 + 32 * j;
                const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * j))));
                const __m256i b1 = _mm256_loadu_si256((const __m256i *)ql), b2 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i bh = _mm256_loadu_si256((const __m256i *)qh);
                __m256i v[4];
                v[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 4), m30));
                v[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 2), m30));
                v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m30));
                v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_and_si256(_mm256_srli_epi16(bh, 2), m30));
                for (int k = 0; k < 4; k++) {   /* x[32k..32k+15] is sub-block 2k of this half, the rest 2k+1 */
                    const __m256i p = _mm256_maddubs_epi16(v[k], _mm256_loadu_si256((const __m256i *)(q8 + 128 * j + 32 * k)));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_shuffle_epi8(s16, pick16(8 + k)), p));
                }
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f16(w + 208) * x.d[b]), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum_ps(acc[r]);
}

static float dot_q4k(const uint8_t *w, int nb, qrow x) { float o; dot_k45_rows(&w, 1, nb, x, &o, 0); return o; }
static float dot_q5k(const uint8_t *w, int nb, qrow x) { float o; dot_k45_rows(&w, 1, nb, x, &o, 1); return o; }
static float dot_q6k(const uint8_t *w, int nb, qrow x) { float o; dot_q6k_rows(&w, 1, nb, x, &o); return o; }
static void dot2_q4k(const uint8_t *w0, const uint8_t *w1, int nb, qrow x, float *o) {
    const uint8_t *w[2] = {w0, w1}; dot_k45_rows(w, 2, nb, x, o, 0);
}
static void dot2_q5k(const uint8_t *w0, const uint8_t *w1, int nb, qrow x, float *o) {
    const uint8_t *w[2] = {w0, w1}; dot_k45_rows(w, 2, nb, x, o, 1);
}
static void dot2_q6k(const uint8_t *w0, const uint8_t *w1, int nb, qrow x, float *o) {
    const uint8_t *w[2] = {w0, w1}; dot_q6k_rows(w, 2, nb, x, o);
}
#define HAVE_DOT2 1

/* AVX-512 BW + VNNI (compiled only where -march=native says the CPU has both; the library is
   built per CPU): the four-token K-quant kernels put two 32-byte sub-blocks in one register and
   fold maddubs' scale multiply and the add into one vpdpwssd. Each int32 lane of the two halves
   holds exactly what the AVX2 code's madd lane holds, and the halves are added into the same
   eight lanes before the float operations, so the results are the same bits. */
#ifdef MAWFORGE_VNNI_EMU          /* tests: this code on AVX2, the 512-bit operations emulated */
#include MAWFORGE_VNNI_EMU
#define VNNI512 1
#elif defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define VNNI512 1
#else
#define VNNI512 0
#endif
int vnni_path(void) { return VNNI512; }

/* Four rows of x against one weight row: each block's scales are unpacked once and its values
   loaded once for all four. Per row, the same float operations in the same order as the one-row
   kernel, so the results are identical to four one-row calls. */
FORCE_INLINE void dot4_k45(const uint8_t *w, int nb, const qrow *x, float *out, const int five) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m16 = _mm256_set1_epi8(16);
    const int bytes = five ? 176 : 144;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m128 accm[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (int b = 0; b < nb; b++, w += bytes) {
        const uint8_t *qs = w + (five ? 48 : 16);
        const __m128i sm = k_scales_v(w + 4);
        const __m128i mn = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));
        const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        const __m256i hbits = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        const float d = f16(w), dmin = f16(w + 2);
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int r = 0; r < 4; r++) {
            const int16_t *bs = x[r].bs + b * 16;
            const __m128i s = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8)));
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * x[r].d[b]), _mm_cvtepi32_ps(_mm_madd_epi16(mn, s)), accm[r]);
        }
#if VNNI512
        __m512i sz[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
#endif
        for (int j = 0; j < 4; j++) {
            const __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q4, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * j), 4), m16));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hbits, 2 * j + 1), 4), m16));
            }
            const __m256i sl = _mm256_shuffle_epi8(sc, pick16(2 * j)), sh = _mm256_shuffle_epi8(sc, pick16(2 * j + 1));
#if VNNI512
            /* sub-blocks 2j (low half) and 2j + 1 (high half) in one register: the 64 bytes of x
               they meet are contiguous */
            const __m512i wz = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            const __m512i scz = _mm512_inserti64x4(_mm512_castsi256_si512(sl), sh, 1);
            for (int r = 0; r < 4; r++)
                sz[r] = _mm512_dpwssd_epi32(sz[r], _mm512_maddubs_epi16(wz, _mm512_loadu_si512(x[r].q + b * QK + 64 * j)), scz);
            continue;
#endif
            for (int r = 0; r < 4; r++) {
                const int8_t *q8 = x[r].q + b * QK + 64 * j;
                const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)q8));
                const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(q8 + 32)));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm256_madd_epi16(pl, sl), _mm256_madd_epi16(ph, sh)));
            }
        }
#if VNNI512
        for (int r = 0; r < 4; r++) sumi[r] = _mm256_add_epi32(_mm512_castsi512_si256(sz[r]), _mm512_extracti64x4_epi64(sz[r], 1));
#endif
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = hsum_ps(acc[r]) - hsum_ps128(accm[r]);
}
static void dot4_q4k(const uint8_t *w, int nb, const qrow *x, float *out) { dot4_k45(w, nb, x, out, 0); }
static void dot4_q5k(const uint8_t *w, int nb, const qrow *x, float *out) { dot4_k45(w, nb, x, out, 1); }

static void dot4_q6k(const uint8_t *w, int nb, const qrow *x, float *out) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128; const int8_t *sc = (const int8_t *)(w + 192);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i sumi[4];
        for (int r = 0; r < 4; r++)
            sumi[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
                _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(x[r].bs + b * 16))), 5));
#if VNNI512
        __m512i sz[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
#endif
        for (int j = 0; j < 2; j++, ql += 64, qh += 32) {
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)ql), b2 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i bh = _mm256_loadu_si256((const __m256i *)qh);
            const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * j))));
            __m256i v[4];
            v[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 4), m30));
            v[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 2), m30));
            v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m30));
            v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_and_si256(_mm256_srli_epi16(bh, 2), m30));
#if VNNI512
            /* values k = 0, 1 (and 2, 3) in one register: the 64 bytes of x they meet are contiguous */
            for (int k = 0; k < 4; k += 2) {
                const __m512i vz = _mm512_inserti64x4(_mm512_castsi256_si512(v[k]), v[k + 1], 1);
                const __m512i scz = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_shuffle_epi8(s16, pick16(8 + k))),
                                                       _mm256_shuffle_epi8(s16, pick16(9 + k)), 1);
                for (int r = 0; r < 4; r++)
                    sz[r] = _mm512_dpwssd_epi32(sz[r], _mm512_maddubs_epi16(vz, _mm512_loadu_si512(x[r].q + b * QK + 128 * j + 32 * k)), scz);
            }
            continue;
#endif
            for (int k = 0; k < 4; k++) {
                const __m256i scl = _mm256_shuffle_epi8(s16, pick16(8 + k));
                for (int r = 0; r < 4; r++) {
                    const int8_t *xq = x[r].q + b * QK + 128 * j + 32 * k;
                    const __m256i p = _mm256_maddubs_epi16(v[k], _mm256_loadu_si256((const __m256i *)xq));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(scl, p));
                }
            }
        }
#if VNNI512
        for (int r = 0; r < 4; r++)
            sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(_mm512_castsi512_si256(sz[r]), _mm512_extracti64x4_epi64(sz[r], 1)));
#endif
        const float d = f16(w + 208);
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = hsum_ps(acc[r]);
}
#define HAVE_DOT4 1

static inline __m256 dot32_i8(__m256i a, __m256i b) {   /* signed int8 . int8 over 32 lanes -> 8 float partials */
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

static float dot_q80(const uint8_t *w, int nb, qrow x) {   /* nb blocks of 32 */
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 34) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(x.q + b * Q80));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x.d[b]), dot32_i8(q, xq), acc);
    }
    return hsum_ps(acc);
}

static float dot_q40(const uint8_t *w, int nb, qrow x) {   /* nb blocks of 32: d f16, 16 bytes of nibbles */
    const __m256i m4 = _mm256_set1_epi8(0xF), m8 = _mm256_set1_epi8(8);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, w += 18) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + 2));
        __m256i q = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
        q = _mm256_sub_epi8(_mm256_and_si256(q, m4), m8);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(x.q + b * Q80));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(f16(w) * x.d[b]), dot32_i8(q, xq), acc);
    }
    return hsum_ps(acc);
}
/* Four rows of x against one Q8_0 / Q4_0 row: the weight block (its |q| for the sign trick)
   loaded once for the four; per row the one-row kernel's float operations in its order. */
FORCE_INLINE void dot4_q0(const uint8_t *w, int nb, const qrow *x, float *out, const int four) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m8 = _mm256_set1_epi8(8), one = _mm256_set1_epi16(1);
    const int bytes = four ? 18 : 34;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; b++, w += bytes) {
        __m256i q;
        if (four) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + 2));
            q = _mm256_sub_epi8(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), m4), m8);
        } else q = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i aq = _mm256_sign_epi8(q, q);
        const float d = f16(w);
        for (int r = 0; r < 4; r++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(x[r].q + b * Q80));
            const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(xq, q)), one));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), p, acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum_ps(acc[r]);
}
static void dot4_q80(const uint8_t *w, int nb, const qrow *x, float *out) { dot4_q0(w, nb, x, out, 0); }
static void dot4_q40(const uint8_t *w, int nb, const qrow *x, float *out) { dot4_q0(w, nb, x, out, 1); }
/* ---- prefill: a panel of weight rows unpacked once, tiles of two rows by four tokens ----------
   The four-token kernels unpack each weight block (nibbles, scale shuffles) once per four tokens
   and spend as many instructions on each block's float tail as on its products: at M = 512 they
   ran at half the speed of ggml's tiled mul_mat on AMD Zen 4 (benchmarks/kernels.py). Here a
   panel of Q4_K or Q6_K rows is unpacked once for every token of the call: each block as eight
   runs of 32 codes (bytes; Q6_K's six bits put together) and each run's scales as int16. Then
   every group of four tokens meets the panel two rows at a time.
   AVX-512 VNNI: each group of four tokens is laid out as two pairs, a run of both tokens of a pair
   in one 512-bit register (token 2p low, 2p + 1 high), so one vpmaddubsw + vpdpwssd against a run
   of codes broadcast to both halves adds that run into both tokens' eight int32 lanes at once.
   AVX2: each run of codes is loaded once for four tokens and each token's run of x once for two
   rows; maddubs + madd against the run's scale as the four-token kernel's, and the per-block float
   terms (token scales broadcast, Q4_K's mins two tokens a register) prepared once per group.
   In both the int32 lanes hold exactly what the AVX2 kernel's madd lanes add up to (integers are
   exact), and the float tail takes the same operations in the same order per lane, so every
   result is the same bits (tests/test_native_prefill.py). Not built under the VNNI emulation,
   which defines only the four-token kernels' operations. */
#if !defined(MAWFORGE_VNNI_EMU)
#define PANEL 1
typedef struct {            /* one Q4_K block of one weight row, unpacked (320 bytes) */
    uint8_t q[8][32];       /* sub-block s's 32 codes */
    int32_t sc[8];          /* its scale as int16, twice (a 32-bit broadcast fills 32 lanes) */
    __m128i mn;             /* the eight mins as int16 */
    float d, dmin;
} __attribute__((aligned(64))) k4blk;
typedef struct {            /* one Q6_K block of one weight row, unpacked (576 bytes) */
    uint8_t q[8][32];       /* values 32s .. 32s + 31, 0..63 (the -32 comes off through the sums of 16) */
    int16_t sc[8][16];      /* their two scales of 16, eight lanes each */
    int16_t sc16[16];       /* the sixteen scales in order (for the offset term) */
    float d;
} __attribute__((aligned(64))) k6blk;
static void k4_unpack(const uint8_t *w, long rb, int nb, int rows, void *panel) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    k4blk *out = (k4blk *)panel;
    for (int n = 0; n < rows; n++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + rb * n + 144 * b, *qs = blk + 16;
            k4blk *o = out + (long)n * nb + b;
            const __m128i sm = k_scales_v(blk + 4);
            uint8_t s8[16];
            _mm_storeu_si128((__m128i *)s8, sm);
            for (int s = 0; s < 8; s++) o->sc[s] = (int32_t)((uint32_t)s8[s] * 0x10001u);
            o->mn = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));
            o->d = f16(blk);
            o->dmin = f16(blk + 2);
            for (int j = 0; j < 4; j++) {
                const __m256i q4 = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                _mm256_store_si256((__m256i *)o->q[2 * j], _mm256_and_si256(q4, m4));
                _mm256_store_si256((__m256i *)o->q[2 * j + 1], _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4));
            }
        }
}

static void k6_unpack(const uint8_t *w, long rb, int nb, int rows, void *panel) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    k6blk *out = (k6blk *)panel;
    for (int n = 0; n < rows; n++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = w + rb * n + 210 * b;
            k6blk *o = out + (long)n * nb + b;
            const int8_t *sc = (const int8_t *)(blk + 192);
            _mm256_store_si256((__m256i *)o->sc16, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)));
            o->d = f16(blk + 208);
            for (int j = 0; j < 2; j++) {
                const uint8_t *ql = blk + 64 * j, *qh = blk + 128 + 32 * j;
                const __m256i b1 = _mm256_loadu_si256((const __m256i *)ql), b2 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                const __m256i bh = _mm256_loadu_si256((const __m256i *)qh);
                const __m256i s16 = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(sc + 8 * j))));
                const __m256i v[4] = {
                    _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 4), m30)),
                    _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 2), m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_and_si256(_mm256_srli_epi16(bh, 2), m30))};
                for (int k = 0; k < 4; k++) {
                    _mm256_store_si256((__m256i *)o->q[4 * j + k], v[k]);
                    _mm256_store_si256((__m256i *)o->sc[4 * j + k], _mm256_shuffle_epi8(s16, pick16(8 + k)));
                }
            }
        }
}

#if VNNI512
typedef struct {            /* one block of four tokens (1408 bytes) */
    __m512i x[2][8];        /* pair p, run s: token 2p's 32 bytes of x, then 2p + 1's */
    __m512 dx01, dx23;      /* token scales: tokens 0 | 1, 2 | 3, eight lanes each */
    __m512 dx4;             /* token t's scale in lanes 4t .. 4t + 3 (Q4_K's mins) */
    __m512i bs;             /* Q4_K: token t's eight sub-block sums (int16) in 128-bit lane t */
    __m512i bs6[2];         /* Q6_K: the sixteen sums of pair p's tokens, one per 256-bit half */
} kgrp;

static inline __m512 two8(float a, float b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)),
                                               _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}
static inline __m512i two256(const void *a, const void *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

static void k_group(const qrow *x, int nb, kgrp *g) {
    for (int b = 0; b < nb; b++) {
        const float d0 = x[0].d[b], d1 = x[1].d[b], d2 = x[2].d[b], d3 = x[3].d[b];
        for (int p = 0; p < 2; p++) {
            for (int s = 0; s < 8; s++)
                g[b].x[p][s] = two256(x[2 * p].q + b * QK + 32 * s, x[2 * p + 1].q + b * QK + 32 * s);
            g[b].bs6[p] = two256(x[2 * p].bs + b * 16, x[2 * p + 1].bs + b * 16);
        }
        g[b].dx01 = two8(d0, d1);
        g[b].dx23 = two8(d2, d3);
        g[b].dx4 = _mm512_setr_ps(d0, d0, d0, d0, d1, d1, d1, d1, d2, d2, d2, d2, d3, d3, d3, d3);
        __m128i s[4];
        for (int t = 0; t < 4; t++) {
            const int16_t *bs = x[t].bs + b * 16;
            s[t] = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8)));
        }
        g[b].bs = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(s[0]), s[1], 1),
                                                        s[2], 2), s[3], 3);
    }
}

/* o[4 r + t] from the float accumulators: token pair p of row r in acc[r][p] (eight lanes a token),
   Q4_K's mins (four lanes a token) in accm[r] */
static inline void k_out(__m512 acc[2][2], const __m512 *accm, float *o) {
    for (int r = 0; r < 2; r++) {
        float f[2][16] __attribute__((aligned(64))), fm[16] __attribute__((aligned(64)));
        _mm512_store_ps(f[0], acc[r][0]);
        _mm512_store_ps(f[1], acc[r][1]);
        if (accm) _mm512_store_ps(fm, accm[r]);
        for (int t = 0; t < 4; t++)
            o[4 * r + t] = hsum_ps(_mm256_load_ps(f[t / 2] + 8 * (t % 2))) - (accm ? hsum_ps128(_mm_load_ps(fm + 4 * t)) : 0.f);
    }
}

/* run s of one weight row (32 codes, w) with its scales sc against both token pairs of G: each
   pair's int32 lanes sz[p] += the run's madd lanes for each of its two tokens */
FORCE_INLINE void pair_run(__m512i *sz, __m256i w, __m512i sc, const kgrp *G, int s) {
    const __m512i wz = _mm512_broadcast_i64x4(w);
    sz[0] = _mm512_dpwssd_epi32(sz[0], _mm512_maddubs_epi16(wz, G->x[0][s]), sc);
    sz[1] = _mm512_dpwssd_epi32(sz[1], _mm512_maddubs_epi16(wz, G->x[1][s]), sc);
}
/* a block's float tail for one row: acc[p] += (d * token scale) * float(sz[p]), lane by lane as
   the AVX2 kernel's fmadd */
FORCE_INLINE void pair_tail(__m512 *acc, float d, const __m512i *sz, const kgrp *G) {
    const __m512 dv = _mm512_set1_ps(d);
    acc[0] = _mm512_fmadd_ps(_mm512_mul_ps(dv, G->dx01), _mm512_cvtepi32_ps(sz[0]), acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_mul_ps(dv, G->dx23), _mm512_cvtepi32_ps(sz[1]), acc[1]);
}

/* Q4_K rows a and b (unpacked, nb blocks each) against the four tokens of g: o[4 r + t] */
static void k4_tile(const void *pa, const void *pb, int nb, const kgrp *g, float *o) {
    const k4blk *a = (const k4blk *)pa, *b = (const k4blk *)pb;
    __m512 acc[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    __m512 accm[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int k = 0; k < nb; k++) {
        const k4blk *R[2] = {a + k, b + k};
        const kgrp *G = g + k;
        __m512i sz[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()}, {_mm512_setzero_si512(), _mm512_setzero_si512()}};
        for (int s = 0; s < 8; s++)
            for (int r = 0; r < 2; r++)
                pair_run(sz[r], _mm256_load_si256((const __m256i *)R[r]->q[s]), _mm512_set1_epi32(R[r]->sc[s]), G, s);
        for (int r = 0; r < 2; r++) {
            pair_tail(acc[r], R[r]->d, sz[r], G);
            const __m512i m = _mm512_madd_epi16(_mm512_broadcast_i32x4(R[r]->mn), G->bs);
            accm[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(R[r]->dmin), G->dx4), _mm512_cvtepi32_ps(m), accm[r]);
        }
    }
    k_out(acc, accm, o);
}

/* Q6_K rows a and b against the four tokens of g, as k4_tile (the offset term: 32 x scale x sum
   of 16, subtracted in integers, as the AVX2 kernel starts its sums) */
static void k6_tile(const void *pa, const void *pb, int nb, const kgrp *g, float *o) {
    const k6blk *a = (const k6blk *)pa, *b = (const k6blk *)pb;
    __m512 acc[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    for (int k = 0; k < nb; k++) {
        const k6blk *R[2] = {a + k, b + k};
        const kgrp *G = g + k;
        __m512i sz[2][2];
        for (int r = 0; r < 2; r++) {
            const __m512i s16 = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)R[r]->sc16));
            for (int p = 0; p < 2; p++)
                sz[r][p] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_madd_epi16(s16, G->bs6[p]), 5));
        }
        for (int s = 0; s < 8; s++)
            for (int r = 0; r < 2; r++)
                pair_run(sz[r], _mm256_load_si256((const __m256i *)R[r]->q[s]),
                         _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)R[r]->sc[s])), G, s);
        for (int r = 0; r < 2; r++) pair_tail(acc[r], R[r]->d, sz[r], G);
    }
    k_out(acc, 0, o);
}

#else
typedef struct {            /* one block of four tokens, AVX2 (288 bytes) */
    __m256 xd[4];           /* token t's scale in every lane */
    __m256 dx01, dx23;      /* Q4_K's mins: tokens 0 | 1 (2 | 3) scales, four lanes each */
    __m256i bs01, bs23;     /* Q4_K: tokens 0 | 1 (2 | 3) eight sums of 32 (int16), a 128-bit lane each */
    const int8_t *q[4];     /* token t's 256 values of x in this block */
    const int16_t *bs[4];   /* token t's sixteen sums of 16 (Q6_K's offset term) */
} __attribute__((aligned(32))) kgrp;

static void k_group(const qrow *x, int nb, kgrp *g) {
    for (int b = 0; b < nb; b++) {
        __m128i s[4];
        for (int t = 0; t < 4; t++) {
            const int16_t *bs = x[t].bs + b * 16;
            g[b].xd[t] = _mm256_set1_ps(x[t].d[b]);
            g[b].q[t] = x[t].q + b * QK;
            g[b].bs[t] = bs;
            s[t] = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs), _mm_loadu_si128((const __m128i *)(bs + 8)));
        }
        g[b].dx01 = _mm256_setr_ps(x[0].d[b], x[0].d[b], x[0].d[b], x[0].d[b], x[1].d[b], x[1].d[b], x[1].d[b], x[1].d[b]);
        g[b].dx23 = _mm256_setr_ps(x[2].d[b], x[2].d[b], x[2].d[b], x[2].d[b], x[3].d[b], x[3].d[b], x[3].d[b], x[3].d[b]);
        g[b].bs01 = _mm256_inserti128_si256(_mm256_castsi128_si256(s[0]), s[1], 1);
        g[b].bs23 = _mm256_inserti128_si256(_mm256_castsi128_si256(s[2]), s[3], 1);
    }
}

/* o[4 r + t] from the float accumulators acc[r][t], Q4_K's mins (tokens 2p, 2p + 1 in the halves of
   accm[r][p]) subtracted where there are any */
static inline void k_out2(const __m256 acc[2][4], const __m256 accm[2][2], int mins, float *o) {
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < 4; t++) {
            const __m256 m = accm[r][t / 2];
            o[4 * r + t] = hsum_ps(acc[r][t]) - (mins ? hsum_ps128(t % 2 ? _mm256_extractf128_ps(m, 1) : _mm256_castps256_ps128(m)) : 0.f);
        }
}

/* the runs of rows a and b against the four tokens of G: sumi[r][t] += each run's madd lanes. The
   run's scales: Q4_K one int16 broadcast (sc4: the int32 pair), Q6_K sixteen lanes (sc6) */
FORCE_INLINE void k_runs(__m256i sumi[2][4], const uint8_t *qa, const uint8_t *qb, const int32_t *sca, const int32_t *scb,
                         const int16_t *s6a, const int16_t *s6b, const kgrp *G) {
    for (int s = 0; s < 8; s++) {
        const __m256i w[2] = {_mm256_load_si256((const __m256i *)(qa + 32 * s)), _mm256_load_si256((const __m256i *)(qb + 32 * s))};
        const __m256i sc[2] = {sca ? _mm256_set1_epi32(sca[s]) : _mm256_load_si256((const __m256i *)(s6a + 16 * s)),
                               scb ? _mm256_set1_epi32(scb[s]) : _mm256_load_si256((const __m256i *)(s6b + 16 * s))};
        for (int t = 0; t < 4; t++) {
            const __m256i xs = _mm256_loadu_si256((const __m256i *)(G->q[t] + 32 * s));
            for (int r = 0; r < 2; r++)
                sumi[r][t] = _mm256_add_epi32(sumi[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xs), sc[r]));
        }
    }
}

/* Q4_K rows a and b (unpacked, nb blocks each) against the four tokens of g: o[4 r + t] */
static void k4_tile(const void *pa, const void *pb, int nb, const kgrp *g, float *o) {
    const k4blk *a = (const k4blk *)pa, *b = (const k4blk *)pb;
    __m256 acc[2][4], accm[2][2];
    for (int r = 0; r < 2; r++) {
        for (int t = 0; t < 4; t++) acc[r][t] = _mm256_setzero_ps();
        accm[r][0] = accm[r][1] = _mm256_setzero_ps();
    }
    for (int k = 0; k < nb; k++) {
        const k4blk *R[2] = {a + k, b + k};
        const kgrp *G = g + k;
        __m256i sumi[2][4];
        for (int r = 0; r < 2; r++) for (int t = 0; t < 4; t++) sumi[r][t] = _mm256_setzero_si256();
        k_runs(sumi, R[0]->q[0], R[1]->q[0], R[0]->sc, R[1]->sc, 0, 0, G);
        for (int r = 0; r < 2; r++) {
            const __m256 dv = _mm256_set1_ps(R[r]->d), mv = _mm256_set1_ps(R[r]->dmin);
            for (int t = 0; t < 4; t++)
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, G->xd[t]), _mm256_cvtepi32_ps(sumi[r][t]), acc[r][t]);
            const __m256i mn = _mm256_broadcastsi128_si256(R[r]->mn);
            accm[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(mv, G->dx01), _mm256_cvtepi32_ps(_mm256_madd_epi16(mn, G->bs01)), accm[r][0]);
            accm[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(mv, G->dx23), _mm256_cvtepi32_ps(_mm256_madd_epi16(mn, G->bs23)), accm[r][1]);
        }
    }
    k_out2(acc, accm, 1, o);
}

/* Q6_K rows a and b against the four tokens of g, as k4_tile (the offset term: 32 x scale x sum
   of 16, subtracted in integers, as the four-token kernel starts its sums) */
static void k6_tile(const void *pa, const void *pb, int nb, const kgrp *g, float *o) {
    const k6blk *a = (const k6blk *)pa, *b = (const k6blk *)pb;
    __m256 acc[2][4], accm[2][2];
    for (int r = 0; r < 2; r++) {
        for (int t = 0; t < 4; t++) acc[r][t] = _mm256_setzero_ps();
        accm[r][0] = accm[r][1] = _mm256_setzero_ps();
    }
    for (int k = 0; k < nb; k++) {
        const k6blk *R[2] = {a + k, b + k};
        const kgrp *G = g + k;
        __m256i sumi[2][4];
        for (int r = 0; r < 2; r++) {
            const __m256i s16 = _mm256_load_si256((const __m256i *)R[r]->sc16);
            for (int t = 0; t < 4; t++)
                sumi[r][t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(
                    _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)G->bs[t])), 5));
        }
        k_runs(sumi, R[0]->q[0], R[1]->q[0], 0, 0, R[0]->sc[0], R[1]->sc[0], G);
        for (int r = 0; r < 2; r++) {
            const __m256 dv = _mm256_set1_ps(R[r]->d);
            for (int t = 0; t < 4; t++)
                acc[r][t] = _mm256_fmadd_ps(_mm256_mul_ps(dv, G->xd[t]), _mm256_cvtepi32_ps(sumi[r][t]), acc[r][t]);
        }
    }
    k_out2(acc, accm, 0, o);
}
#endif

typedef void (*unpack_fn)(const uint8_t *, long, int, int, void *);
typedef void (*tile_fn)(const void *, const void *, int, const kgrp *, float *);
/* The panel kernels of a type for M tokens: block bytes unpacked, unpack, tile (0: none, or too few
   tokens to pay for the unpacking). Where the tiles first beat the four-token kernels, in
   same-process alternating runs (benchmarks/kernels.py shapes): AVX-512 VNNI from M = 6 for both
   types (AMD Zen 5); AVX2 from M = 8 for Q4_K and 24 for Q6_K (AMD Zen 3: at M = 16 Q6_K's tile was
   still 4% slower, at 24-48 10% faster, Q4_K's 6-15% faster from 8). */
#if VNNI512
enum { K4_MIN_TOKENS = 6, K6_MIN_TOKENS = 6 };
#else
enum { K4_MIN_TOKENS = 8, K6_MIN_TOKENS = 24 };
#endif
static size_t panel_kernels(int type, int M, unpack_fn *unpack, tile_fn *tile) {
    if (type == T_Q4_K && M >= K4_MIN_TOKENS) { *unpack = k4_unpack; *tile = k4_tile; return sizeof(k4blk); }
    if (type == T_Q6_K && M >= K6_MIN_TOKENS) { *unpack = k6_unpack; *tile = k6_tile; return sizeof(k6blk); }
    return 0;
}

/* the unpacked panel: per thread, grown once (OpenMP's threads persist between calls) */
static _Thread_local uint8_t *k_panel = 0;
static _Thread_local size_t k_panel_n = 0;
static uint8_t *k_panel_for(size_t n) { return grow_only(&k_panel, &k_panel_n, n); }
#define K_PANEL_BYTES (160 * 1024)
#endif

int simd_path(void) { return 1; }

#else   /* the same integer arithmetic in plain C */

static float dot_q4k(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += 144) {
        const uint8_t *qs = w + 16; const int8_t *q8 = x.q + b * QK; const int16_t *bs = x.bs + b * 16;
        int sumi = 0, mins = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m; k_scale_min(j, w + 4, &sc, &m);
            mins += m * (bs[2 * j] + bs[2 * j + 1]);
            const uint8_t *q = qs + 32 * (j / 2); const int8_t *xv = q8 + 32 * j; int s = 0;
            for (int i = 0; i < 32; i++) s += ((j & 1) ? (q[i] >> 4) : (q[i] & 0xF)) * xv[i];
            sumi += sc * s;
        }
        sum += f16(w) * x.d[b] * (float)sumi - f16(w + 2) * x.d[b] * (float)mins;
    }
    return sum;
}

static float dot_q5k(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += 176) {
        const uint8_t *qh = w + 16, *qs = w + 48; const int8_t *q8 = x.q + b * QK; const int16_t *bs = x.bs + b * 16;
        int sumi = 0, mins = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m; k_scale_min(j, w + 4, &sc, &m);
            mins += m * (bs[2 * j] + bs[2 * j + 1]);
            const uint8_t *q = qs + 32 * (j / 2); const int8_t *xv = q8 + 32 * j; int s = 0;
            for (int i = 0; i < 32; i++) {
                int v = ((j & 1) ? (q[i] >> 4) : (q[i] & 0xF)) + (((qh[i] >> j) & 1) << 4);
                s += v * xv[i];
            }
            sumi += sc * s;
        }
        sum += f16(w) * x.d[b] * (float)sumi - f16(w + 2) * x.d[b] * (float)mins;
    }
    return sum;
}

static float dot_q6k(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += 210) {
        const int8_t *sc = (const int8_t *)(w + 192); const int8_t *q8 = x.q + b * QK;
        int sumi = 0;
        for (int n = 0; n < 2; n++) {
            const uint8_t *l = w + 64 * n, *h = w + 128 + 32 * n;
            for (int i = 0; i < 32; i++) {
                const int is = 8 * n + i / 16;
                const int v0 = ((l[i] & 0xF) | (((h[i] >> 0) & 3) << 4)) - 32;
                const int v1 = ((l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4)) - 32;
                const int v2 = ((l[i] >> 4) | (((h[i] >> 4) & 3) << 4)) - 32;
                const int v3 = ((l[i + 32] >> 4) | (((h[i] >> 6) & 3) << 4)) - 32;
                const int8_t *xv = q8 + 128 * n;
                sumi += sc[is] * v0 * xv[i] + sc[is + 2] * v1 * xv[i + 32] + sc[is + 4] * v2 * xv[i + 64] + sc[is + 6] * v3 * xv[i + 96];
            }
        }
        sum += f16(w + 208) * x.d[b] * (float)sumi;
    }
    return sum;
}

static float dot_q80(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2); int s = 0;
        for (int i = 0; i < Q80; i++) s += q[i] * x.q[b * Q80 + i];
        sum += f16(w) * x.d[b] * (float)s;
    }
    return sum;
}

static float dot_q40(const uint8_t *w, int nb, qrow x) {
    float sum = 0.f;
    for (int b = 0; b < nb; b++, w += 18) {
        const uint8_t *q = w + 2; int s = 0;
        for (int i = 0; i < 16; i++)
            s += ((q[i] & 0xF) - 8) * x.q[b * Q80 + i] + ((q[i] >> 4) - 8) * x.q[b * Q80 + i + 16];
        sum += f16(w) * x.d[b] * (float)s;
    }
    return sum;
}
int simd_path(void) { return 0; }
int vnni_path(void) { return 0; }
#endif

#include "quant_types.h"

static void quant_row(int type, const float *x, int K, qrow r) {
    switch (act_kind(type)) {
    case A_Q8K: quant_q8k(x, K, r); break;
    case A_Q81: quant_q81(x, K, r); break;
    case A_F16: quant_float(x, K, r, 0); break;
    case A_BF16: quant_float(x, K, r, 1); break;
    default: quant_q80(x, K, r);
    }
}

typedef float (*dot_fn)(const uint8_t *, int, qrow);
typedef void (*dot4_fn)(const uint8_t *, int, const qrow *, float *);
typedef void (*dot2_fn)(const uint8_t *, const uint8_t *, int, qrow, float *);

/* the two-weight-row kernel of a type, where there is one (else callers run the one-row kernel
   twice, which gives the same bits) */
static dot2_fn dot2_for(int type) {
#ifdef HAVE_DOT2
    if (type == T_Q4_K) return dot2_q4k;
    if (type == T_Q5_K) return dot2_q5k;
    if (type == T_Q6_K) return dot2_q6k;
#endif
    (void)type;
    return 0;
}

/* the four-row kernel of a type, where there is one (else callers run the one-row kernel) */
static dot4_fn dot4_for(int type) {
#ifdef HAVE_DOT4
    if (type == T_Q4_K) return dot4_q4k;
    if (type == T_Q5_K) return dot4_q5k;
    if (type == T_Q6_K) return dot4_q6k;
    if (type == T_Q8_0) return dot4_q80;
    if (type == T_Q4_0) return dot4_q40;
#endif
    return more_dot4_for(type);
}
static dot_fn dot_for(int type, int K, int *nb, long *row_bytes) {
    switch (type) {
    case T_Q4_K: *nb = K / QK; *row_bytes = (long)*nb * 144; return dot_q4k;
    case T_Q5_K: *nb = K / QK; *row_bytes = (long)*nb * 176; return dot_q5k;
    case T_Q6_K: *nb = K / QK; *row_bytes = (long)*nb * 210; return dot_q6k;
    case T_Q8_0: *nb = K / Q80; *row_bytes = (long)*nb * 34; return dot_q80;
    case T_Q4_0: *nb = K / Q80; *row_bytes = (long)*nb * 18; return dot_q40;
    }
    return more_dot_for(type, K, nb, row_bytes);
}
static int is_supported(int type) { int nb; long rb; return dot_for(type, QK, &nb, &rb) != 0; }

/* per-thread scratch that only grows (the caller's Python thread; OpenMP workers never allocate) */
static _Thread_local uint8_t *scratch = 0;
static _Thread_local size_t scratch_size = 0;
static uint8_t *scratch_for(size_t n) { return grow_only(&scratch, &scratch_size, n); }

/* ---- prefill: many rows of x against one matrix, cache-blocked --------------------------- */
#define PANEL_BYTES (64 * 1024)
/* rows [p0, p1) against the one token xr: y as gemm_rows says, two rows at a time where the type
   has a two-row kernel */
static void rows_one_token(dot_fn dot, dot2_fn dot2, const uint8_t *w, long rb, int nb, int p0, int p1, qrow xr,
                           float *y, int y0, const float *scale) {
    int n = p0;
    if (dot2)
        for (; n + 2 <= p1; n += 2) {
            float o[2];
            dot2(w + rb * n, w + rb * (n + 1), nb, xr, o);
            if (scale) { y[n - y0] += *scale * o[0]; y[n + 1 - y0] += *scale * o[1]; }
            else { y[n - y0] = o[0]; y[n + 1 - y0] = o[1]; }
        }
    for (; n < p1; n++) {
        const float v = dot(w + rb * n, nb, xr);
        if (scale) y[n - y0] += *scale * v; else y[n - y0] = v;
    }
}

/* the first `cnt` of four tokens' results o[] for weight row n (a padded group keeps fewer) */
static inline void putn(float *const *yr, int m, int n, int y0, const float *scale, const float *o, int cnt) {
    if (scale) for (int r = 0; r < cnt; r++) yr[m + r][n - y0] += scale[m + r] * o[r];
    else for (int r = 0; r < cnt; r++) yr[m + r][n - y0] = o[r];
}
static inline void put4(float *const *yr, int m, int n, int y0, const float *scale, const float *o) {
    putn(yr, m, n, y0, scale, o, 4);
}

#if PANEL
/* gemm_rows for Q4_K and Q6_K: each panel of rows unpacked once, then every group
   of four tokens meets it two rows at a time (k4_tile / k6_tile); an odd last row takes dot4, two
   or three tokens beyond a multiple of four a padded group, one token the one-token kernels, so
   every element keeps its bits. */
static void gemm_rows_panel(size_t blk, unpack_fn unpack, tile_fn tile, dot_fn dot, dot4_fn dot4, dot2_fn dot2,
                            const uint8_t *w, long rb, int nb, int n0, int n1, const qrow *xr, int M,
                            float *const *yr, int y0, const float *scale) {
    int pr = (int)(K_PANEL_BYTES / ((long)nb * (long)blk));
    pr = pr < 2 ? 2 : pr & ~1;
    uint8_t *panel = k_panel_for((size_t)pr * nb * blk);
    kgrp *g = (kgrp *)aligned_alloc(64, sizeof(kgrp) * (size_t)nb);
    if (!panel || !g) {                       /* no memory for the panel: the four-token path */
        free(g);
        for (int m = 0; m + 4 <= M; m += 4)
            for (int n = n0; n < n1; n++) { float o[4]; dot4(w + rb * n, nb, xr + m, o); put4(yr, m, n, y0, scale, o); }
        for (int m = M - M % 4; m < M; m++) rows_one_token(dot, dot2, w, rb, nb, n0, n1, xr[m], yr[m], y0, scale ? scale + m : 0);
        return;
    }
    /* two or three tokens past a multiple of four go through the tile as a group of four padded
       with copies of the last one (each token's lanes are computed alone; the copies' results are
       not stored): cheaper than the one-token kernels. One token left takes those. */
    const int m4 = M - M % 4, groups = M % 4 >= 2 ? M + 4 - M % 4 : m4;
    const long row = (long)nb * (long)blk;
    qrow xpad[4];
    for (int t = 0; t < 4; t++) xpad[t] = xr[m4 + t < M ? m4 + t : M - 1];
    for (int p0 = n0; p0 < n1; p0 += pr) {
        const int p1 = p0 + pr < n1 ? p0 + pr : n1, rows = p1 - p0, pairs = rows & ~1;
        unpack(w + rb * p0, rb, nb, rows, panel);
        for (int m = 0; m < groups; m += 4) {
            const qrow *xg = m == m4 ? xpad : xr + m;      /* m == m4: the padded group */
            const int cnt = M - m < 4 ? M - m : 4;
            k_group(xg, nb, g);
            for (int i = 0; i < pairs; i += 2) {
                float o[8];
                tile(panel + i * row, panel + (i + 1) * row, nb, g, o);
                putn(yr, m, p0 + i, y0, scale, o, cnt);
                putn(yr, m, p0 + i + 1, y0, scale, o + 4, cnt);
            }
            if (pairs < rows) { float o[4]; dot4(w + rb * (p1 - 1), nb, xg, o); putn(yr, m, p1 - 1, y0, scale, o, cnt); }
        }
        for (int m = groups; m < M; m++)
            rows_one_token(dot, dot2, w, rb, nb, p0, p1, xr[m], yr[m], y0, scale ? scale + m : 0);
    }
    free(g);
}
#endif

/* Weight rows [n0, n1) against the M quantized rows xr[]: y = yr[m][n - y0] (scale NULL) or
   yr[m][n - y0] += scale[m] * y. The rows go in panels of about PANEL_BYTES, which stay in L2 while
   each group of four rows of x (a few KiB, in L1) meets every row of the panel through the
   four-row kernel: each weight block is unpacked once for four tokens, and each x block is
   read from L1 for every row of the panel instead of from L2 or beyond (the x rows of a 512-token
   prompt are ~1.1 MiB). The rows of x left over (M % 4) run the one-token kernels, two weight
   rows at a time where the type has a two-row kernel. Every element is the same float
   computation as the one-token, one-row kernel's (ggml's order), so blocking changes no bit.
   Q4_K and Q6_K rows against enough tokens go through gemm_rows_panel (panel_kernels says how many). */
static void gemm_rows(int type, dot_fn dot, dot4_fn dot4, dot2_fn dot2, const uint8_t *w, long rb, int nb, int n0,
                      int n1, const qrow *xr, int M, float *const *yr, int y0, const float *scale) {
#if PANEL
    unpack_fn unpack; tile_fn tile;
    const size_t blk = dot4 ? panel_kernels(type, M, &unpack, &tile) : 0;
    if (blk) {
        gemm_rows_panel(blk, unpack, tile, dot, dot4, dot2, w, rb, nb, n0, n1, xr, M, yr, y0, scale);
        return;
    }
#endif
    const dec_fn dec = M >= DBLK_MIN_TOKENS ? dec_for(type) : 0;
    if (dec && gemm_rows_dblk(dec, type == T_Q2_K, w, rb, nb, n0, n1, xr, M, yr, y0, scale) == 0) return;
    int pr = (int)(PANEL_BYTES / rb);
    pr = pr < 4 ? 4 : pr & ~1;
    const int m4 = dot4 ? M - M % 4 : 0;
    for (int p0 = n0; p0 < n1; p0 += pr) {
        const int p1 = p0 + pr < n1 ? p0 + pr : n1;
        for (int m = 0; m < m4; m += 4)
            for (int n = p0; n < p1; n++) {
                float o[4];
                dot4(w + rb * n, nb, xr + m, o);
                put4(yr, m, n, y0, scale, o);
            }
        for (int m = m4; m < M; m++) rows_one_token(dot, dot2, w, rb, nb, p0, p1, xr[m], yr[m], y0, scale ? scale + m : 0);
    }
}

int supported(int type) { return is_supported(type); }

/* One-token products can take weight rows in pairs (dot2: two rows interleaved block by block,
   sharing each load of x; 5-9% faster where the matrix is in cache) in matrices of at most this
   many bytes: qgemm's rows, moe_ffn's gate with up and its down rows two at a time. The default is
   none: in a decode step at full size every weight streams from DRAM (48 layers of a 30B MoE pass
   over a gigabyte a token, nothing stays in cache between tokens), and two interleaved streams
   feed the prefetchers badly. On the AMD EPYC Zen 4 (two threads) the 151,936 x 2,048 Q6_K output
   head took 15.7 ms a token in pairs against 8.4 ms one row at a time, as ggml runs it, and
   resident decode of the 48-layer file went 8.43 -> 11.27 tok/s with no pairs anywhere (the same
   bits). Pairs stay for CPUs where a measurement says otherwise; tests force both paths. */
static long g_pair_max = 0;
/* sets the limit (tests force each path); returns the one it replaces */
long set_pair_max(long nbytes) { const long old = g_pair_max; g_pair_max = nbytes; return old; }

/* x [M, K] float32, w [N, row bytes] -> y [M, N]. Returns 0, or -1 for an unsupported type or K. */
int qgemm(int type, const float *x, int M, int K, const uint8_t *w, int N, float *y) {
    int nb; long rb;
    dot_fn dot = dot_for(type, K, &nb, &rb);
    if (!dot || K % act_block(type)) return -1;
    const size_t qb = qrow_bytes(type, K), rows = M > 1 ? (sizeof(qrow) + sizeof(float *)) * (size_t)M : 0;
    uint8_t *buf = scratch_for(qb * (size_t)M + rows);
    if (!buf) return -2;
    const dot4_fn dot4 = dot4_for(type);
    const dot2_fn dot2 = dot2_for(type);
    qrow *xr = (qrow *)(buf + qb * (size_t)M);
    float **yr = (float **)(xr + M);
    if (M > 1)
        for (int m = 0; m < M; m++) { xr[m] = qrow_at(buf + qb * m, K); yr[m] = y + (long)m * N; }
    #pragma omp parallel num_threads(team_size())
    {
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) quant_row(type, x + (long)m * K, K, qrow_at(buf + qb * m, K));
        if (M > 1) {   /* prefill, verify: each thread a contiguous run of weight rows, blocked */
            const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
            gemm_rows(type, dot, dot4, dot2, w, rb, nb, (int)((long)N * tid / nth), (int)((long)N * (tid + 1) / nth),
                      xr, M, yr, 0, 0);
        } else {       /* decode: each thread a contiguous run of row pairs (dot2 under the pair limit) */
            const qrow x0 = qrow_at(buf, K);
            const int pairs = dot2 && rb * (long)N <= g_pair_max;
            #pragma omp for schedule(static)
            for (int n2 = 0; n2 < (N + 1) / 2; n2++) {
                const int n0 = 2 * n2;
                if (pairs && n0 + 1 < N) dot2(w + rb * n0, w + rb * (n0 + 1), nb, x0, y + n0);
                else for (int n = n0; n < N && n < n0 + 2; n++) y[n] = dot(w + rb * n, nb, x0);
            }
        }
    }
    return 0;
}

/* moe_ffn for more than one token (prefill, verify), through gemm_rows: the gate and up rows of
   an expert in blocks of RB rows (one work item each, taken dynamically: experts differ in token
   count) against the expert's tokens, PC at a time, then h = silu(g) * u; the down rows as in the
   one-token path, each thread its own output features, expert after expert, blocked. Every float
   operation is the one-token path's, so the results are the same bits. Scratch beyond the
   one-token path's: PC * (RB floats + a row's pointers) a thread. */
#define RB 64
#define PC 64
static int moe_ffn_tiled(const float *x, int M, int C, int F, int E,
                         const uint8_t *const *gate, const uint8_t *const *up, const uint8_t *const *down,
                         int tg, int tu, int td, const int *first, const int *tok, const float *wt, float *out) {
    int nbg, nbu, nbd; long rbg, rbu, rbd;
    const dot_fn dg = dot_for(tg, C, &nbg, &rbg), du = dot_for(tu, C, &nbu, &rbu), dd = dot_for(td, F, &nbd, &rbd);
    const dot4_fn d4g = dot4_for(tg), d4u = dot4_for(tu), d4d = dot4_for(td);
    const dot2_fn d2g = dot2_for(tg), d2u = dot2_for(tu), d2d = dot2_for(td);
    const int P = first[E], nth0 = team_size();
    const size_t qc = qrow_bytes(act_float(tg) ? tg : tu, C), qf = qrow_bytes(td, F);
    const int two = act_kind(tg) != act_kind(tu);
    const size_t per_thread = (sizeof(qrow) + sizeof(float *)) * PC + sizeof(float) * PC * RB;
    const size_t need = qc * M * (1 + two) + sizeof(float) * (size_t)P * F + qf * (size_t)P + per_thread * nth0;
    uint8_t *buf = scratch_for(need);
    if (!buf) return -2;
    uint8_t *xg = buf, *xu = two ? buf + qc * M : buf;
    float *h = (float *)(buf + qc * M * (1 + two));
    uint8_t *hq = (uint8_t *)(h + (size_t)P * F), *lists = hq + qf * (size_t)P;
    const int nblk = (F + RB - 1) / RB;
    #pragma omp parallel num_threads(nth0)
    {
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        qrow *xr = (qrow *)(lists + per_thread * tid);
        float **yr = (float **)(xr + PC), *ub = (float *)(yr + PC);
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            quant_row(tg, x + (long)m * C, C, qrow_at(xg + qc * m, C));
            if (two) quant_row(tu, x + (long)m * C, C, qrow_at(xu + qc * m, C));
        }
        #pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < (long)E * nblk; i++) {
            const int e = (int)(i / nblk), n0 = (int)(i % nblk) * RB, n1 = n0 + RB < F ? n0 + RB : F;
            for (int p0 = first[e]; p0 < first[e + 1]; p0 += PC) {
                const int np = first[e + 1] - p0 < PC ? first[e + 1] - p0 : PC;
                for (int k = 0; k < np; k++) { xr[k] = qrow_at(xg + qc * tok[p0 + k], C); yr[k] = h + (long)(p0 + k) * F; }
                gemm_rows(tg, dg, d4g, d2g, gate[e], rbg, nbg, n0, n1, xr, np, yr, 0, 0);
                for (int k = 0; k < np; k++) { xr[k] = qrow_at(xu + qc * tok[p0 + k], C); yr[k] = ub + k * RB; }
                gemm_rows(tu, du, d4u, d2u, up[e], rbu, nbu, n0, n1, xr, np, yr, n0, 0);
                for (int k = 0; k < np; k++) {
                    float *hv = h + (long)(p0 + k) * F; const float *uv = ub + k * RB;
                    for (int n = n0; n < n1; n++) hv[n] = hv[n] / (1.f + expf(-hv[n])) * uv[n - n0];
                }
            }
        }
        #pragma omp for schedule(static)
        for (int p = 0; p < P; p++) quant_row(td, h + (long)p * F, F, qrow_at(hq + qf * p, F));
        /* each thread its own output features; every out element adds the experts in order */
        const int c0 = (int)((long)C * tid / nth), c1 = (int)((long)C * (tid + 1) / nth);
        for (int e = 0; e < E; e++)
            for (int p0 = first[e]; p0 < first[e + 1]; p0 += PC) {
                const int np = first[e + 1] - p0 < PC ? first[e + 1] - p0 : PC;
                for (int k = 0; k < np; k++) { xr[k] = qrow_at(hq + qf * (p0 + k), F); yr[k] = out + (long)tok[p0 + k] * C; }
                gemm_rows(td, dd, d4d, d2d, down[e], rbd, nbd, c0, c1, xr, np, yr, 0, wt + p0);
            }
    }
    return 0;
}

/* One layer's routed experts, SwiGLU, over P (expert, token) pairs sorted by expert: pairs
   first[e] .. first[e + 1] - 1 are expert e's, pair p is token tok[p] with routing weight wt[p]:
   out[tok[p]] += wt[p] * down_e(silu(gate_e x) * up_e x). gate[e], up[e] are [F, C] GGUF rows of type
   tg / tu, down[e] [C, F] of type td. One parallel region: every token's x quantized once, the gate
   and up rows of all experts, h quantized per pair, then the down rows split by output feature (so
   threads never write the same element). Returns 0, or -1 for unsupported types or shapes. */
int moe_ffn(const float *x, int M, int C, int F, int E,
            const uint8_t *const *gate, const uint8_t *const *up, const uint8_t *const *down,
            int tg, int tu, int td, const int *first, const int *tok, const float *wt, float *out) {
    int nbg, nbu, nbd; long rbg, rbu, rbd;
    dot_fn dg = dot_for(tg, C, &nbg, &rbg), du = dot_for(tu, C, &nbu, &rbu), dd = dot_for(td, F, &nbd, &rbd);
    if (!dg || !du || !dd || C % act_block(tg) || C % act_block(tu) || F % act_block(td)) return -1;
    if (M > 1) return moe_ffn_tiled(x, M, C, F, E, gate, up, down, tg, tu, td, first, tok, wt, out);
    const int P = first[E];
    const dot4_fn d4g = dot4_for(tg), d4u = dot4_for(tu), d4d = dot4_for(td);
    const dot2_fn d2gu = tg == tu && rbg * (long)F <= g_pair_max ? dot2_for(tg) : 0,
                  d2d = rbd * (long)C <= g_pair_max ? dot2_for(td) : 0;
    const size_t qc = qrow_bytes(act_float(tg) ? tg : tu, C), qf = qrow_bytes(td, F);
    const int two = act_kind(tg) != act_kind(tu);           /* gate and up want different activation types */
    const size_t need = qc * M * (1 + two) + sizeof(float) * (size_t)P * F + qf * (size_t)P;
    uint8_t *buf = scratch_for(need);
    if (!buf) return -2;
    uint8_t *xg = buf, *xu = two ? buf + qc * M : buf;
    float *h = (float *)(buf + qc * M * (1 + two));
    uint8_t *hq = (uint8_t *)(h + (size_t)P * F);
    #pragma omp parallel num_threads(team_size())
    {
        #pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            quant_row(tg, x + (long)m * C, C, qrow_at(xg + qc * m, C));
            if (two) quant_row(tu, x + (long)m * C, C, qrow_at(xu + qc * m, C));
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < (long)E * F; i++) {
            const int e = (int)(i / F), n = (int)(i % F);
            int p = first[e];
            if (d4g && d4u)
                for (; p + 4 <= first[e + 1]; p += 4) {
                    const qrow rg[4] = {qrow_at(xg + qc * tok[p], C), qrow_at(xg + qc * tok[p + 1], C),
                                        qrow_at(xg + qc * tok[p + 2], C), qrow_at(xg + qc * tok[p + 3], C)};
                    const qrow ru[4] = {qrow_at(xu + qc * tok[p], C), qrow_at(xu + qc * tok[p + 1], C),
                                        qrow_at(xu + qc * tok[p + 2], C), qrow_at(xu + qc * tok[p + 3], C)};
                    float g[4], u[4];
                    d4g(gate[e] + rbg * n, nbg, rg, g);
                    d4u(up[e] + rbu * n, nbu, ru, u);
                    for (int r = 0; r < 4; r++) h[(long)(p + r) * F + n] = g[r] / (1.f + expf(-g[r])) * u[r];
                }
            for (; p < first[e + 1]; p++) {
                float gu[2];
                if (d2gu)      /* gate and up rows of one type: one pass over both, sharing x */
                    d2gu(gate[e] + rbg * n, up[e] + rbu * n, nbg, qrow_at(xg + qc * tok[p], C), gu);
                else {
                    gu[0] = dg(gate[e] + rbg * n, nbg, qrow_at(xg + qc * tok[p], C));
                    gu[1] = du(up[e] + rbu * n, nbu, qrow_at(xu + qc * tok[p], C));
                }
                h[(long)p * F + n] = gu[0] / (1.f + expf(-gu[0])) * gu[1];
            }
        }
        #pragma omp for schedule(static)
        for (int p = 0; p < P; p++) quant_row(td, h + (long)p * F, F, qrow_at(hq + qf * p, F));
        /* each thread owns a contiguous range of output features and sweeps each expert's down
           rows in that range in order (one memory stream at a time); every out element still
           adds the experts in order e = 0, 1, ... (the loop above ends in a barrier) */
        {
            const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
            const int c0 = (int)((long)C * tid / nth), c1 = (int)((long)C * (tid + 1) / nth);
            for (int e = 0; e < E; e++) {
                int p = first[e];
                if (d4d)
                    for (; p + 4 <= first[e + 1]; p += 4) {
                        const qrow rh[4] = {qrow_at(hq + qf * p, F), qrow_at(hq + qf * (p + 1), F),
                                            qrow_at(hq + qf * (p + 2), F), qrow_at(hq + qf * (p + 3), F)};
                        for (int c = c0; c < c1; c++) {
                            float o[4];
                            d4d(down[e] + rbd * c, nbd, rh, o);
                            for (int r = 0; r < 4; r++) out[(long)tok[p + r] * C + c] += wt[p + r] * o[r];
                        }
                    }
                for (; p < first[e + 1]; p++) {
                    const qrow rh = qrow_at(hq + qf * p, F);
                    float *o = out + (long)tok[p] * C;
                    int c = c0;
                    if (d2d)
                        for (; c + 2 <= c1; c += 2) {
                            float v[2];
                            d2d(down[e] + rbd * c, down[e] + rbd * (c + 1), nbd, rh, v);
                            o[c] += wt[p] * v[0];
                            o[c + 1] += wt[p] * v[1];
                        }
                    for (; c < c1; c++) o[c] += wt[p] * dd(down[e] + rbd * c, nbd, rh);
                }
            }
        }
    }
    return 0;
}

/* the activation quantizer alone: q [K] int8, d [K/256 or K/32], bs [K/16] (q8_K only) */
int quantize_acts(int type, const float *x, int K, int8_t *q, float *d, int16_t *bs) {
    if (!is_supported(type) || K % act_block(type)) return -1;
    qrow r = {q, d, bs};
    quant_row(type, x, K, r);
    return 0;
}

/* The kernels' own team size, apart from torch's: omp_set_num_threads would change the count
   torch's parallel regions use on this thread too, and torch's float GEMMs do not give the same
   bits at every thread count. The kernels here do (each thread owns whole output rows). */
void set_threads(int n) { g_team = n; }
int omp_team(void) { return team_size(); }   /* for decode_step.c's parallel loops */

/* ---- the small per-layer ops of a decode step, as one call each ---------------------------- */

/* RMSNorm of `rows` rows of n, as ggml: squares summed in double, scale = 1 / sqrt(mean + eps) in
   float, then y = (x * scale) * w. */
void rms_norm_rows(const float *x, int rows, int n, const float *w, float eps, float *y) {
    /* rows are independent (each alone, in place too): a prompt's split over the team, a token's not */
    #pragma omp parallel for schedule(static) num_threads(team_size()) if ((long)rows * n >= PAR_ELEMS)
    for (int r = 0; r < rows; r++) {
        const float *v = x + (long)r * n;
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += (double)(v[i] * v[i]);
        const float mean = (float)(sum / n);
        const float scale = 1.0f / sqrtf(mean + eps);
        float *o = y + (long)r * n;
        for (int i = 0; i < n; i++) o[i] = v[i] * scale * w[i];
    }
}

/* Rotary embedding of x [T, H, D] into y, token t rotated by cos[t], sin[t] [D/2]: "neox" rotates
   the halves (i, i + D/2), "norm" the pairs (2i, 2i + 1). Products and sums as separate float
   operations (no FMA contraction under -std=c11), the same roundings as the torch code. */
void rope_rows(const float *x, int T, int H, int D, const float *cs, const float *sn, int neox, float *y) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(team_size()) if ((long)T * H * D >= PAR_ELEMS)
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const float *v = x + ((long)t * H + h) * D, *c = cs + (long)t * half, *s = sn + (long)t * half;
            float *o = y + ((long)t * H + h) * D;
            if (neox)
                for (int i = 0; i < half; i++) {
                    const float a = v[i], b = v[i + half];
                    const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                    o[i] = ac - bs;
                    o[i + half] = bc + as;
                }
            else
                for (int i = 0; i < half; i++) {
                    const float a = v[2 * i], b = v[2 * i + 1];
                    const float ac = a * c[i], bs = b * s[i], as = a * s[i], bc = b * c[i];
                    o[2 * i] = ac - bs;
                    o[2 * i + 1] = as + bc;
                }
        }
}
