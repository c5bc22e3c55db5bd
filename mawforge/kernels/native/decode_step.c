/* The per-layer pieces of a one-token decode step as single calls, so a layer costs a few
 * Python -> C crossings instead of a dozen (on a 2-core machine the crossings and the torch
 * tensors around them were a quarter of a resident token's time).
 *
 *   attn_qkv(...)   q, k, v projections of one token (+ bias), q/k RMSNorm (per head or over
 *                   the whole projection), RoPE: the steps models/base.MoETransformer.attention
 *                   runs before the KV append, through the same kernels (qgemm, rms_norm_rows,
 *                   rope_rows in kquant_gemm.c) on the same inputs, so the results are the same
 *                   bits as the separate calls'.
 *
 * Compiled into the same library as kquant_gemm.c (kernels/native/__init__.py lists both).
 * Legend: C hidden, H query heads, G kv heads, D head dim.
 */
#include <stdint.h>

int qgemm(int type, const float *x, int M, int K, const uint8_t *w, int N, float *y);
void rms_norm_rows(const float *x, int rows, int n, const float *w, float eps, float *y);
void rope_rows(const float *x, int T, int H, int D, const float *cs, const float *sn, int neox, float *y);

enum { NORM_NONE = 0, NORM_HEAD = 1, NORM_FULL = 2 };

/* y [n] = x . W^T (+ b), then RMSNorm by `kind` over heads of D (or the whole row), then RoPE. */
static int project(const float *x, int C, const uint8_t *w, int type, const float *b, int heads, int D,
                   int kind, const float *nw, float eps, const float *cs, const float *sn, int neox, int rope,
                   float *y) {
    const int n = heads * D;
    if (qgemm(type, x, 1, C, w, n, y) != 0) return -1;
    if (b)
        for (int i = 0; i < n; i++) y[i] = y[i] + b[i];
    if (kind == NORM_HEAD) rms_norm_rows(y, heads, D, nw, eps, y);      /* in place: each row read before written */
    else if (kind == NORM_FULL) rms_norm_rows(y, 1, n, nw, eps, y);
    if (rope) rope_rows(y, 1, heads, D, cs, sn, neox, y);              /* in place: each pair read before written */
    return 0;
}

/* x [C] float32 -> q [H*D] (normed, rotated), k [G*D] (normed, rotated), v [G*D].
   w*: GGUF rows of type t*; b*: float32 biases or NULL; nq/nk: float32 norm weights ([D] for
   kind 1, [H*D] / [G*D] for kind 2, unused for 0); cs/sn: this position's cos/sin [D/2].
   Returns 0, or -1 when a projection's type or shape is unsupported. */
int attn_qkv(const float *x, int C, const uint8_t *wq, int tq, const uint8_t *wk, int tk,
             const uint8_t *wv, int tv, const float *bq, const float *bk, const float *bv,
             int H, int G, int D, int kind, const float *nq, const float *nk, float eps,
             const float *cs, const float *sn, int neox, float *q, float *k, float *v) {
    if (project(x, C, wq, tq, bq, H, D, kind, nq, eps, cs, sn, neox, 1, q)) return -1;
    if (project(x, C, wk, tk, bk, G, D, kind, nk, eps, cs, sn, neox, 1, k)) return -1;
    if (project(x, C, wv, tv, bv, G, D, NORM_NONE, 0, eps, cs, sn, neox, 0, v)) return -1;
    return 0;
}

/* ---- the rest of a one-token layer: KV write, attention over the cache, routing ------------ */

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

int omp_team(void);     /* kquant_gemm.c: the kernels' team size */

/* KV_Q8_0: ggml's block_q8_0 rows (per 32 values a float16 scale d, then 32 int8 q; x = d * q),
   D % 32 == 0, of keys and values rotated as llama.cpp rotates them (rot_k_block below); KV_Q8_0_PLAIN
   the same blocks unrotated (a model whose base head dim is no multiple of 64: llama.cpp rotates none
   of its layers). Offsets into a cache stay in values (at), a row's bytes are D / 32 * 34. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3, KV_Q8_0_PLAIN = 4 };
static inline int is_q8(int dtype) { return dtype == KV_Q8_0 || dtype == KV_Q8_0_PLAIN; }
enum { Q8_BLOCK = 32, Q8_BYTES = 34 };

/* the bytes before value `at` of a cache of `dtype` (at a multiple of 32 for q8_0) */
static inline long kv_bytes_at(int dtype, long at) {
    return is_q8(dtype) ? at / Q8_BLOCK * Q8_BYTES : at * (dtype == KV_F32 ? 4 : 2);
}

/* 32 values -> one q8_0 block as ggml's x86 CPU quantize_row_q8_0 writes it (what llama.cpp's KV
   cache holds on these CPUs): amax = max |x|, d = amax / 127 (stored as float16), q = x * (127 /
   amax) rounded to nearest even (0 where amax is 0). The same bits in every build (rintf under the
   default rounding mode is vroundps or libm's rint). */
static inline void q8_block_put(const float *x, uint8_t *blk) {
    float amax = 0.f;
    for (int j = 0; j < Q8_BLOCK; j++) { const float a = fabsf(x[j]); amax = a > amax ? a : amax; }
    const _Float16 d = (_Float16)(amax / 127.f);
    const float id = amax != 0.f ? 127.f / amax : 0.f;
    memcpy(blk, &d, 2);
    int8_t *q = (int8_t *)(blk + 2);
    for (int j = 0; j < Q8_BLOCK; j++) q[j] = (int8_t)(int)rintf(x[j] * id);
}
/* one q8_0 block -> 32 float32 values d * q (ggml's dequantize_row_q8_0) */
static inline void q8_block_get(const uint8_t *blk, float *dst) {
    _Float16 dh;
    memcpy(&dh, blk, 2);
    const float d = (float)dh;
    const int8_t *q = (const int8_t *)(blk + 2);
#ifdef __AVX512F__
    const __m512 dv = _mm512_set1_ps(d);
    for (int j = 0; j < Q8_BLOCK; j += 16)
        _mm512_storeu_ps(dst + j, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j))))));
#else
    for (int j = 0; j < Q8_BLOCK; j++) dst[j] = d * (float)q[j];
#endif
}

/* float32 -> bfloat16 as torch's c10::BFloat16 rounds (nearest even; NaN -> 0x7FC0) */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_value(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The Walsh-Hadamard rotation llama.cpp applies with a quantized cache (llama-kv-cache.cpp attn_rot_k/v,
   where the head dim is a multiple of 64): keys and queries by H_nk (nk the largest power of two >= 64
   dividing D), values by H_64, and the attention's output by H_64 again (H is symmetric and H H = I), so
   q.k and the output are unchanged while an outlier's weight spreads over its block before 8-bit
   rounding. 0: no rotation. */
static inline int rot_k_block(int D) {
    if (D % 64) return 0;
    int n = 64;
    while (D % (2 * n) == 0) n *= 2;
    return n;
}
static inline int rot_v_block(int D) { return D % 64 ? 0 : 64; }

/* x [n] -> H_n x in place (n a power of two): butterflies (a + b, a - b) at strides 1, 2, 4, ..., then
   times 1/sqrt(n) in float32 (kernels/q8_0.py's hadamard: the same operations, the same bits) */
static void fwht(float *x, int n) {
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float s = (float)(1.0 / sqrt((double)n));
    for (int j = 0; j < n; j++) x[j] = x[j] * s;
}
/* rows of D values, each rotated in blocks of blk (nothing for blk 0) */
static void rotate_rows(float *x, long rows, int D, int blk) {
    if (!blk) return;
    for (long r = 0; r < rows; r++)
        for (int b = 0; b < D; b += blk) fwht(x + r * D + b, blk);
}

/* row of D cache values (f32, f16 or bf16) -> float32. f16 is an IEEE conversion either way:
   AVX-512 16 at a time or F16C 8 at a time where -march has them (GCC 12 does not vectorize
   _Float16 casts), the compiler's _Float16 cast (libgcc) otherwise. */
static inline void row_load(const void *base, int dtype, long at, int D, float *dst) {
    if (dtype == KV_F32) memcpy(dst, (const float *)base + at, sizeof(float) * D);
    else if (dtype == KV_F16) {
        const _Float16 *p = (const _Float16 *)base + at;
        int d = 0;
#ifdef __AVX512F__
        for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + d))));
#endif
#ifdef __F16C__
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + d))));
#endif
        for (; d < D; d++) dst[d] = (float)p[d];
    } else if (is_q8(dtype)) {
        const uint8_t *p = (const uint8_t *)base + kv_bytes_at(dtype, at);
        for (int b = 0; b < D / Q8_BLOCK; b++) q8_block_get(p + b * Q8_BYTES, dst + b * Q8_BLOCK);
    } else { const uint16_t *p = (const uint16_t *)base + at; for (int d = 0; d < D; d++) dst[d] = bf16_value(p[d]); }
}
/* float32 row -> the cache's dtype (round to nearest even, as torch's copy_) */
static inline void row_store(void *base, int dtype, long at, int D, const float *src) {
    if (dtype == KV_F32) memcpy((float *)base + at, src, sizeof(float) * D);
    else if (dtype == KV_F16) {
        _Float16 *p = (_Float16 *)base + at;
        int d = 0;
#ifdef __F16C__
        for (; d + 8 <= D; d += 8)
            _mm_storeu_si128((__m128i *)(p + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; d < D; d++) p[d] = (_Float16)src[d];
    } else if (is_q8(dtype)) {
        uint8_t *p = (uint8_t *)base + kv_bytes_at(dtype, at);
        for (int b = 0; b < D / Q8_BLOCK; b++) q8_block_put(src + b * Q8_BLOCK, p + b * Q8_BYTES);
    } else { uint16_t *p = (uint16_t *)base + at; for (int d = 0; d < D; d++) p[d] = bf16_bits(src[d]); }
}
/* x [n] rounded to the cache dtype and back in place (what torch's .to(dtype).float() gives; for
   q8_0 a query row as ggml's flash attention converts Q to K's q8_0 vec-dot type) */
static inline void round_row(int dtype, float *x, int n) {
    int i = 0;
    if (dtype == KV_F16) {
#ifdef __F16C__
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
        for (; i < n; i++) x[i] = (float)(_Float16)x[i];
    } else if (dtype == KV_BF16)
        for (; i < n; i++) x[i] = bf16_value(bf16_bits(x[i]));
    else if (is_q8(dtype))           /* through q8_0 and back, by blocks of 32 (n a multiple of 32) */
        for (; i + Q8_BLOCK <= n; i += Q8_BLOCK) {
            uint8_t blk[Q8_BYTES];
            q8_block_put(x + i, blk);
            q8_block_get(blk, x + i);
        }
}

/* 16 float lanes as one value: GCC lowers it to one AVX-512 register, two AVX2 or four SSE ones,
   each lane computing the same operations in the same order (the same bits in every build) */
typedef float v16f __attribute__((vector_size(64)));
#define FORCE_INLINE static inline __attribute__((always_inline))
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));   /* unaligned access */
/* (macros, not functions: a 64-byte vector passed by value warns of an ABI change without AVX-512) */
#define ld16(p) (*(const v16u *)(p))

/* acc += a * b in each lane, where fx (a constant of each inlined copy) says both factors are
   float16 values: their product then has at most 22 significant bits and lies between 2^-48 and
   2^32, so it is exact in float32, and one fused multiply-add rounds as a multiply then an add do.
   Where the build has FMA the attention kernels use it there (one instruction instead of two: on
   CPUs whose adds share the multipliers' ports, half the work), keeping every build's bits. A float32
   or q8_0 cache (inexact products) always takes the multiply and the add. */
#if defined(__AVX512F__)
#define MADD16_FUSED(acc, a, b) ((acc) = (v16f)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(acc)))
#elif defined(__FMA__)
#define MADD16_FUSED(acc, a, b) do {                                                           \
        const v16f a_ = (a), b_ = (b);                                                          \
        __m256 c_[2], x_[2], y_[2];                                                             \
        memcpy(c_, &(acc), 64); memcpy(x_, &a_, 64); memcpy(y_, &b_, 64);                      \
        c_[0] = _mm256_fmadd_ps(x_[0], y_[0], c_[0]); c_[1] = _mm256_fmadd_ps(x_[1], y_[1], c_[1]); \
        memcpy(&(acc), c_, 64);                                                                 \
    } while (0)
#else
#define MADD16_FUSED(acc, a, b) ((acc) += (a) * (b))
#endif
#define MADD16(fx, acc, a, b) do { if (fx) MADD16_FUSED(acc, a, b); else (acc) += (a) * (b); } while (0)
#ifdef __FMA__
#define MADD1(fx, acc, a, b) ((acc) = (fx) ? __builtin_fmaf((a), (b), (acc)) : (acc) + (a) * (b))
#else
#define MADD1(fx, acc, a, b) ((acc) += (a) * (b))
#endif
/* AVX2 with FMA and no AVX-512: the attention's kernels written out on 8-lane registers (below) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ATT_AVX2 1
#else
#define ATT_AVX2 0
#endif
/* v held in a register from here on: GCC folded the attention's tile loads into the multiply-adds
   as memory operands, loading each value once per use (a p.v step 20 loads to 16 multiply-adds,
   a score step 18), so the loop was bound by its loads; one load each, then the register (no value
   changes: the same operations on the same values) */
#if defined(__AVX512F__) && defined(__GNUC__)
#define IN_REG(v) __asm__("" : "+v"(v))
#else
#define IN_REG(v) ((void)0)
#endif
/* the lanes summed pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1): one fixed order */
#define hsum16(a) hsum16_of(&(a))
static inline float hsum16_of(const v16f *a) {
    float t[16];
    memcpy(t, a, sizeof t);
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) t[l] += t[l + w];
    return t[0];
}

/* sum a[i] * b[i] in 16 lanes (lane i % 16; a tail shorter than 16 into lanes 0..), then the
   lanes pairwise: one fixed order (no reassociation, no FMA contraction under -std=c11) */
FORCE_INLINE float dot16x(const float *a, const float *b, int n, const int fx) {
    v16f acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) MADD16(fx, acc, ld16(a + i), ld16(b + i));
    float t[16];
    memcpy(t, &acc, sizeof t);
    for (int l = 0; i < n; i++, l++) MADD1(fx, t[l], a[i], b[i]);
    memcpy(&acc, t, sizeof t);
    return hsum16(acc);
}
static inline float dot16(const float *a, const float *b, int n) { return dot16x(a, b, n, 0); }

/* dot16 of four vectors a[j * as] against one b, interleaved (four independent chains instead of
   one chain's latency): each result is the same sum in the same order as dot16's. */
static inline void dot16x4(const float *a, long as, const float *b, int n, float *out) {
    if (n % 16) {
        for (int j = 0; j < 4; j++) out[j] = dot16(a + j * as, b, n);
        return;
    }
    v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int i = 0; i < n; i += 16) {
        const v16f bv = ld16(b + i);
        a0 += ld16(a + i) * bv;
        a1 += ld16(a + as + i) * bv;
        a2 += ld16(a + 2 * as + i) * bv;
        a3 += ld16(a + 3 * as + i) * bv;
    }
    out[0] = hsum16(a0), out[1] = hsum16(a1), out[2] = hsum16(a2), out[3] = hsum16(a3);
}

static float *g_attn;       /* attention scratch, grown on demand (one compute thread calls in) */
static size_t g_attn_n;
/* n floats (n a multiple of 16), 64-byte aligned: a 16-float vector load from an aligned row is one
   cache line, where an unaligned one spans two (the attention kernels ran 30-40% slower so) */
static float *attn_scratch(size_t n) {
    if (n > g_attn_n) {
        free(g_attn);
        g_attn = aligned_alloc(64, sizeof(float) * n);
        g_attn_n = g_attn ? n : 0;
    }
    return g_attn;
}

/* k, v [G*D] float32 -> the cache at position pos; kc/vc [G, ctx, D] of `dtype`, sg = ctx * D values.
   q8_0 rows are of the rotated k and v (rot_k_block, rot_v_block). */
void kv_put(const float *k, const float *v, void *kc, void *vc, int dtype, int G, int D, long sg, int pos) {
    float kr[dtype == KV_Q8_0 ? D : 1], vr[dtype == KV_Q8_0 ? D : 1];
    for (int g = 0; g < G; g++) {
        const float *kg = k + (long)g * D, *vg = v + (long)g * D;
        if (dtype == KV_Q8_0) {
            memcpy(kr, kg, sizeof(float) * D);
            memcpy(vr, vg, sizeof(float) * D);
            rotate_rows(kr, 1, D, rot_k_block(D));
            rotate_rows(vr, 1, D, rot_v_block(D));
            kg = kr, vg = vr;
        }
        row_store(kc, dtype, g * sg + (long)pos * D, D, kg);
        row_store(vc, dtype, g * sg + (long)pos * D, D, vg);
    }
}

/* The pairwise lane sums of sixteen 16-lane vectors at once (a transpose-and-add network): lane i
   of the result is hsum16(a[i]) bit for bit (each level adds lane l and lane l + w of every vector,
   as hsum16's 8 + 8, 4 + 4, 2 + 2, 1 + 1), in 15 vector additions instead of 16 x 15 scalar ones. */
typedef int v16i __attribute__((vector_size(64)));
static inline v16f hsum16x16(const v16f *a) {
    const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)          /* lanes 0-7: a[2i]'s l + (l + 8); 8-15: a[2i + 1]'s */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo8) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)          /* four lanes per vector: l + (l + 4) */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo4) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)          /* two lanes: l + (l + 2) */
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], lo2) + __builtin_shuffle(c[2 * i], c[2 * i + 1], hi2);
    return __builtin_shuffle(d[0], d[1], lo1) + __builtin_shuffle(d[0], d[1], hi1);      /* 1 + 1 */
}

/* e^x for 16 lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times
   2^n), exact to about 1 ulp; x below -87.3 gives 0. Plain multiplies and adds in the vector type
   (no FMA contraction under -std=c11), so every build and thread count gives the same bits. */
static inline v16f exp16(v16f x) {
    const v16f lo = {0}, big = {0};
    const v16f cut = lo - 87.3365447f, magic = big + 12582912.0f;      /* 1.5 * 2^23: round to nearest */
    const v16i under = x < cut;
    v16f xc = (v16f)(((v16i)x & ~under) | ((v16i)cut & under));
    const v16f nf = (xc * 1.44269504088896341f + magic) - magic;
    const v16f r = (xc - nf * 0.693359375f) - nf * -2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v16i e = (__builtin_convertvector(nf, v16i) + 127) << 23;
    return (v16f)((v16i)(p * (v16f)e) & ~under);
}

#if ATT_AVX2
/* exp16's operations on eight lanes (the same bits: no FMA, the same constants and order) */
static inline __m256 exp8(__m256 x) {
    const __m256 cut = _mm256_set1_ps(-87.3365447f), magic = _mm256_set1_ps(12582912.0f);
    const __m256 under = _mm256_cmp_ps(x, cut, _CMP_LT_OQ);
    const __m256 xc = _mm256_blendv_ps(x, cut, under);
    const __m256 nf = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(nf, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(nf, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_add_ps(_mm256_mul_ps(r, _mm256_set1_ps(1.9875691500e-4f)), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(nf), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* softmax_row (below) on 8-lane registers, each 16-lane step as two: the same values in the same
   order (GCC left the generic max loop scalar here, a fifth of the attention's time) */
static void softmax_row(float *p, int S, int dtype) {
    float m = -INFINITY;
    int s = 0;
    if (S >= 16) {
        __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
        for (; s + 16 <= S; s += 16) {
            const __m256 x0 = _mm256_loadu_ps(p + s), x1 = _mm256_loadu_ps(p + s + 8);
            m0 = _mm256_blendv_ps(m0, x0, _mm256_cmp_ps(x0, m0, _CMP_GT_OQ));
            m1 = _mm256_blendv_ps(m1, x1, _mm256_cmp_ps(x1, m1, _CMP_GT_OQ));
        }
        float t[16];
        _mm256_storeu_ps(t, m0);
        _mm256_storeu_ps(t + 8, m1);
        for (int l = 0; l < 16; l++) m = t[l] > m ? t[l] : m;
    }
    for (; s < S; s++) m = p[s] > m ? p[s] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (s = 0; s + 16 <= S; s += 16) {
        const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv));
        const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + s + 8), mv));
        _mm256_storeu_ps(p + s, e0);
        _mm256_storeu_ps(p + s + 8, e1);
        a0 = _mm256_add_ps(a0, e0);
        a1 = _mm256_add_ps(a1, e1);
    }
    float t[16];
    _mm256_storeu_ps(t, a0);
    _mm256_storeu_ps(t + 8, a1);
    if (s < S) {
        float xs[16] = {0};
        for (int i = 0; s + i < S; i++) xs[i] = p[s + i] - m;
        _mm256_storeu_ps(xs, exp8(_mm256_loadu_ps(xs)));
        _mm256_storeu_ps(xs + 8, exp8(_mm256_loadu_ps(xs + 8)));
        for (int i = 0; s + i < S; i++) { p[s + i] = xs[i]; t[i] += xs[i]; }
    }
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) t[l] += t[l + w];
    const float sum = t[0];
    const __m256 sv = _mm256_set1_ps(sum);
    for (s = 0; s + 16 <= S; s += 16) {
        _mm256_storeu_ps(p + s, _mm256_div_ps(_mm256_loadu_ps(p + s), sv));
        _mm256_storeu_ps(p + s + 8, _mm256_div_ps(_mm256_loadu_ps(p + s + 8), sv));
    }
    for (; s < S; s++) p[s] = p[s] / sum;
    if (!is_q8(dtype)) round_row(dtype, p, S);
}
#else
/* p [S] scores -> softmax probabilities (max subtracted, float32), rounded to a float cache's dtype:
   16 lanes at a time (the sum in 16 lanes, then pairwise: one fixed order), the tail one by one */
static void softmax_row(float *p, int S, int dtype) {
    float m = -INFINITY;
    int s = 0;
    /* the max in 16 lanes, then across them: the value a pass one by one gives (NaNs skipped alike;
       of +0 and -0 it may keep the other, which exp16(x - m) does not see) */
    if (S >= 16) {
        const v16f ninf = {0};
        v16f mv = ninf - INFINITY;
        for (; s + 16 <= S; s += 16) {
            const v16f x = ld16(p + s);
            const v16i gt = x > mv;
            mv = (v16f)(((v16i)x & gt) | ((v16i)mv & ~gt));
        }
        float t[16];
        memcpy(t, &mv, sizeof t);
        for (int l = 0; l < 16; l++) m = t[l] > m ? t[l] : m;
    }
    for (; s < S; s++) m = p[s] > m ? p[s] : m;
    v16f acc = {0};
    s = 0;
    for (; s + 16 <= S; s += 16) {
        const v16f e = exp16(ld16(p + s) - m);
        memcpy(p + s, &e, sizeof e);
        acc += e;
    }
    float t[16];
    memcpy(t, &acc, sizeof t);
    if (s < S) {
        v16f x = {0};
        float xs[16];
        memcpy(xs, &x, sizeof xs);
        for (int i = 0; s + i < S; i++) xs[i] = p[s + i] - m;
        memcpy(&x, xs, sizeof x);
        const v16f e = exp16(x);
        memcpy(xs, &e, sizeof xs);
        for (int i = 0; s + i < S; i++) { p[s + i] = xs[i]; t[i] += xs[i]; }
    }
    memcpy(&acc, t, sizeof t);
    const float sum = hsum16(acc);
    for (s = 0; s + 16 <= S; s += 16) {
        const v16f q = ld16(p + s) / sum;
        memcpy(p + s, &q, sizeof q);
    }
    for (; s < S; s++) p[s] = p[s] / sum;
    if (!is_q8(dtype)) round_row(dtype, p, S);   /* q8_0: float32, as ggml's flash attention keeps them */
}
#endif

/* cache rows converted to float32 at a time: 32 x D floats (16 KiB at D 128) leave L1 room for the rows
   tile_load prefetches; 64 made a 48-layer decode step's attention 14-27% slower, 16 slowed prefill */
enum { ATT_TILE = 32 };
enum { ATT_AHEAD = 256 };   /* cache rows ahead of the tile that tile_load prefetches */

/* rows s0 .. s0 + n - 1 of a group's cache (kc/vc + at, rows of D) -> tile [n, D] float32, each row
   prefetching the row ATT_AHEAD further on (while < S). A decode step reads its whole cache once
   from memory (3 GiB a token at 32K, Qwen3-30B-A3B shape): the hardware prefetchers alone kept
   the conversion waiting on DRAM (RESULTS.md: 15 -> 22 GB/s with 32-row tiles at 4-32K, 48 layers, 2 threads).
   l2 (one query token: a decode step) prefetches into L2 rather than L1: on the Zen 4 a burst of L1 prefetches
   kept the tile's compute from overlapping the reads (48 layers' decode attention at 4K 40-45 -> 31-38 ms,
   16K 164-178 -> 121-124 ms), while a prefill chunk, which re-reads its rows from cache, ran its 512 x 512
   row ~6% slower so. Prefetching changes no value. */
static inline void tile_load(const void *c, int dtype, long at, int s0, int n, int S, int D, float *tile, int l2) {
    const long rb = kv_bytes_at(dtype, D);
    const char *base = (const char *)c + kv_bytes_at(dtype, at);
    for (int t = 0; t < n; t++) {
        if (s0 + t + ATT_AHEAD < S) {
            const char *ahead = base + (long)(s0 + t + ATT_AHEAD) * rb;
            if (l2)
                for (long o = 0; o < rb; o += 64) __builtin_prefetch(ahead + o, 0, 2);
            else
                for (long o = 0; o < rb; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        row_load(c, dtype, at + (long)(s0 + t) * D, D, tile + (long)t * D);
    }
}
enum { ATT_BLOCK = 4 };     /* a prefill's query tokens per work item (their rows share each converted tile) */

/* n rounded up to a multiple of 16 floats (64 bytes) */
static inline size_t up16(size_t n) { return (n + 15) & ~(size_t)15; }

/* floats of scratch one attend_block call needs: B tokens of hg rows of D, their scores over S (each
   row up16(S) long), a tile; each part a multiple of 16, so on an aligned buffer every part and
   score row starts on a cache line */
static size_t attend_need(int B, int hg, int S, int D) {
    return up16((size_t)B * hg * D) + (size_t)B * hg * up16(S) + up16((size_t)ATT_TILE * D);
}

/* pv_rows (below) for rows j .. rows - 1 one row at a time (16 columns, then one) */
FORCE_INLINE void pv_rows_from(int j, const float *p, long ps, int rows, const float *tile, int n, int D, float *o,
                               const int fx) {
    for (; j < rows; j++) {
        const float *pj = p + (long)j * ps;
        float *oj = o + (long)j * D;
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            v16f acc = ld16(oj + d);
            for (int t = 0; t < n; t++) MADD16(fx, acc, pj[t] - (v16f){0}, ld16(tile + (long)t * D + d));
            memcpy(oj + d, &acc, sizeof acc);
        }
        for (; d < D; d++) {
            float a = oj[d];
            for (int t = 0; t < n; t++) MADD1(fx, a, pj[t], tile[(long)t * D + d]);
            oj[d] = a;
        }
    }
}

#if ATT_AVX2
/* AVX2: the same two kernels with each 16-lane value as two 8-lane registers (lanes 0-7, 8-15),
   written out: GCC's 16-lane vector code blocked as for AVX-512 needs 32 of AVX2's 16 registers and
   ran at a fifth of the multiply-adds' rate (AMD Zen 3: half of ggml's attention speed). The same
   operations on every lane in the same order, so the same bits as the generic code. */
/* IN_REG's 8-lane form (GCC folded these loads too: a p.v step 4 broadcasts and 8 loads to 8 FMAs) */
#define IN_REG8(v) __asm__("" : "+x"(v))
#define MADD8(fx, acc, a, b) ((acc) = (fx) ? _mm256_fmadd_ps((a), (b), (acc)) : _mm256_add_ps((acc), _mm256_mul_ps((a), (b))))

/* hsum16 of eight 16-lane values (halves lo[i], hi[i]) -> lane i: 8 + 8, 4 + 4, 2 + 2, 1 + 1 */
static inline __m256 hsum16x8(const __m256 *lo, const __m256 *hi) {
    __m256 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++) s[i] = _mm256_add_ps(lo[i], hi[i]);
    for (int i = 0; i < 4; i++)           /* lanes 0-3: s[2i]'s l + (l + 4); 4-7: s[2i + 1]'s */
        t[i] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * i], s[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)           /* l + (l + 2): each 128-bit lane [t[2i] 0, 1, t[2i + 1] 0, 1] */
        u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    /* 1 + 1: values 0, 2, 4, 6 in the low 128 bits, 1, 3, 5, 7 in the high, then in order */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

FORCE_INLINE void scores2(const float *qa, const float *qb, const float *tile, int n, int D, float scale,
                          float *s0, float *s1, const int fx) {
    int t = 0;
    if (D % 16 == 0)
        for (; t + 8 <= n; t += 8) {
            __m256 lo[16], hi[16];             /* [i]: qa . row t + i; [8 + i]: qb . row t + i */
            for (int i0 = 0; i0 < 8; i0 += 2) {   /* two rows at a time: 8 accumulators */
                __m256 c[8];
                for (int z = 0; z < 8; z++) c[z] = _mm256_setzero_ps();
                const float *k0 = tile + (long)(t + i0) * D, *k1 = k0 + D;
                for (int d = 0; d < D; d += 16) {
                    __m256 x0 = _mm256_loadu_ps(qa + d), x1 = _mm256_loadu_ps(qa + d + 8);
                    __m256 y0 = _mm256_loadu_ps(qb + d), y1 = _mm256_loadu_ps(qb + d + 8);
                    __m256 a0 = _mm256_loadu_ps(k0 + d), a1 = _mm256_loadu_ps(k0 + d + 8);
                    IN_REG8(x0); IN_REG8(x1); IN_REG8(y0); IN_REG8(y1); IN_REG8(a0); IN_REG8(a1);
                    MADD8(fx, c[0], x0, a0); MADD8(fx, c[1], x1, a1); MADD8(fx, c[4], y0, a0); MADD8(fx, c[5], y1, a1);
                    __m256 b0 = _mm256_loadu_ps(k1 + d), b1 = _mm256_loadu_ps(k1 + d + 8);
                    IN_REG8(b0); IN_REG8(b1);
                    MADD8(fx, c[2], x0, b0); MADD8(fx, c[3], x1, b1); MADD8(fx, c[6], y0, b0); MADD8(fx, c[7], y1, b1);
                }
                lo[i0] = c[0], hi[i0] = c[1], lo[i0 + 1] = c[2], hi[i0 + 1] = c[3];
                lo[8 + i0] = c[4], hi[8 + i0] = c[5], lo[9 + i0] = c[6], hi[9 + i0] = c[7];
            }
            const __m256 sv = _mm256_set1_ps(scale);
            _mm256_storeu_ps(s0 + t, _mm256_mul_ps(hsum16x8(lo, hi), sv));
            _mm256_storeu_ps(s1 + t, _mm256_mul_ps(hsum16x8(lo + 8, hi + 8), sv));
        }
    for (; t < n; t++) {
        s0[t] = dot16x(qa, tile + (long)t * D, D, fx) * scale;
        s1[t] = dot16x(qb, tile + (long)t * D, D, fx) * scale;
    }
}

/* four rows by 16 columns at a time (8 accumulators), each column's running sum in t order */
FORCE_INLINE void pv_rows(const float *p, long ps, int rows, const float *tile, int n, int D, float *o, const int fx) {
    int j = 0;
    if (D % 16 == 0)
        for (; j + 4 <= rows; j += 4)
            for (int d = 0; d < D; d += 16) {
                __m256 acc[4][2];
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 2; c++) acc[r][c] = _mm256_loadu_ps(o + (long)(j + r) * D + d + 8 * c);
                for (int t = 0; t < n; t++) {
                    const float *vt = tile + (long)t * D + d;
                    __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
                    IN_REG8(v0); IN_REG8(v1);
                    for (int r = 0; r < 4; r++) {
                        const __m256 pr = _mm256_broadcast_ss(p + (long)(j + r) * ps + t);
                        MADD8(fx, acc[r][0], pr, v0);
                        MADD8(fx, acc[r][1], pr, v1);
                    }
                }
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 2; c++) _mm256_storeu_ps(o + (long)(j + r) * D + d + 8 * c, acc[r][c]);
            }
    pv_rows_from(j, p, ps, rows, tile, n, D, o, fx);
}
#else
/* scores of two query rows against n cached rows: s0[t] = dot16(qa, row t) * scale, s1[t] likewise
   with qb; eight rows at a time share each load of qa, qb (16 chains), the 16 sums reduced together
   (hsum16x16: each dot16's bits) */
FORCE_INLINE void scores2(const float *qa, const float *qb, const float *tile, int n, int D, float scale,
                          float *s0, float *s1, const int fx) {
    int t = 0;
    if (D % 16 == 0)
        for (; t + 8 <= n; t += 8) {
            v16f a[16] = {{0}};        /* a[i]: qa . row t + i; a[8 + i]: qb . row t + i */
            for (int d = 0; d < D; d += 16) {
                const v16f x = ld16(qa + d), y = ld16(qb + d);
                for (int i = 0; i < 8; i++) {
                    v16f k = ld16(tile + (long)(t + i) * D + d);
                    IN_REG(k);
                    MADD16(fx, a[i], x, k);
                    MADD16(fx, a[8 + i], y, k);
                }
            }
            float r[16];
            const v16f h = hsum16x16(a) * scale;
            memcpy(r, &h, sizeof r);
            for (int i = 0; i < 8; i++) s0[t + i] = r[i], s1[t + i] = r[8 + i];
        }
    for (; t < n; t++) {
        s0[t] = dot16x(qa, tile + (long)t * D, D, fx) * scale;
        s1[t] = dot16x(qb, tile + (long)t * D, D, fx) * scale;
    }
}

/* o_j += sum over t < n in order of p_j[t] * row t, for `rows` rows j (o_j at o + j * D, p_j at
   p + j * ps): four rows by four 16-column blocks at a time share each load (16 chains); each
   output column is the running sum in t order that a one-row loop gives */
FORCE_INLINE void pv_rows(const float *p, long ps, int rows, const float *tile, int n, int D, float *o, const int fx) {
    int j = 0;
    if (D % 64 == 0)
        for (; j + 4 <= rows; j += 4)
            for (int d = 0; d < D; d += 64) {
                v16f acc[4][4];
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) acc[r][c] = ld16(o + (long)(j + r) * D + d + 16 * c);
                for (int t = 0; t < n; t++) {
                    const float *vt = tile + (long)t * D + d;
                    v16f v0 = ld16(vt), v1 = ld16(vt + 16), v2 = ld16(vt + 32), v3 = ld16(vt + 48);
                    IN_REG(v0); IN_REG(v1); IN_REG(v2); IN_REG(v3);
                    for (int r = 0; r < 4; r++) {
                        const v16f pr = p[(long)(j + r) * ps + t] - (v16f){0};   /* p in every lane (p - 0 is p) */
                        MADD16(fx, acc[r][0], pr, v0);
                        MADD16(fx, acc[r][1], pr, v1);
                        MADD16(fx, acc[r][2], pr, v2);
                        MADD16(fx, acc[r][3], pr, v3);
                    }
                }
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) memcpy(o + (long)(j + r) * D + d + 16 * c, &acc[r][c], sizeof(v16f));
            }
    pv_rows_from(j, p, ps, rows, tile, n, D, o, fx);
}
#endif

/* B query tokens' hg rows of one kv group against that group's cache, as models/base.attend
   computes each token: q rounded to the cache dtype (q8_0: rotated as the keys, then through q8_0),
   scores q.k in float32 times scale, softmax in float32 (max subtracted), the probabilities rounded
   to a float cache's dtype, p.v in float32 (q8_0: rotated back).
   Token b's rows are q + b * qs (hg * D floats); it sees positions 0..span[b] - 1 of the group's
   rows kc/vc + at ([S, D], S the largest span); its output goes to out + b * os. Every row is
   computed alone in one fixed order (dot16's for a score, softmax_row's, then the sum over
   positions in order), so a token's result is the same bits whichever block, span or thread
   count it is computed with: a prefill row equals the decode step's at its position. */
FORCE_INLINE void attend_block_x(const float *q, long qs, int B, const int *span, const void *kc, const void *vc,
                                 long at, int dtype, int hg, int D, float scale, float *buf, float *out, long os,
                                 const int fx) {
    int S = 0;
    for (int b = 0; b < B; b++) S = span[b] > S ? span[b] : S;
    const int R = hg * D;
    const long Sp = (long)up16(S);     /* score rows' stride */
    float *qr = buf, *sc = qr + up16((size_t)B * R), *tile = sc + (size_t)B * hg * Sp;
    for (int b = 0; b < B; b++) memcpy(qr + (long)b * R, q + b * qs, sizeof(float) * R);
    if (dtype == KV_Q8_0) rotate_rows(qr, (long)B * hg, D, rot_k_block(D));    /* as the cached keys */
    round_row(dtype, qr, B * R);
    for (int s0 = 0; s0 < S; s0 += ATT_TILE) {
        const int n = S - s0 < ATT_TILE ? S - s0 : ATT_TILE;
        tile_load(kc, dtype, at, s0, n, S, D, tile, B == 1);
        for (int b = 0; b < B; b++) {
            const int nb = span[b] - s0 < n ? span[b] - s0 : n;
            if (nb <= 0) continue;
            const float *qb = qr + (long)b * R;
            float *sb = sc + (long)b * hg * Sp + s0;
            int j = 0;
            for (; j + 2 <= hg; j += 2)
                scores2(qb + (long)j * D, qb + (long)(j + 1) * D, tile, nb, D, scale, sb + (long)j * Sp,
                        sb + (long)(j + 1) * Sp, fx);
            for (; j < hg; j++)
                for (int t = 0; t < nb; t++) sb[j * Sp + t] = dot16x(qb + (long)j * D, tile + (long)t * D, D, fx) * scale;
        }
    }
    for (int b = 0; b < B; b++) {
        for (int j = 0; j < hg; j++) softmax_row(sc + ((long)b * hg + j) * Sp, span[b], dtype);
        memset(out + b * os, 0, sizeof(float) * R);
    }
    for (int s0 = 0; s0 < S; s0 += ATT_TILE) {
        const int n = S - s0 < ATT_TILE ? S - s0 : ATT_TILE;
        tile_load(vc, dtype, at, s0, n, S, D, tile, B == 1);
        for (int b = 0; b < B; b++) {
            const int nb = span[b] - s0 < n ? span[b] - s0 : n;
            if (nb > 0) pv_rows(sc + (long)b * hg * Sp + s0, Sp, hg, tile, nb, D, out + b * os, fx);
        }
    }
    if (dtype == KV_Q8_0)           /* the output back from the values' rotation */
        for (int b = 0; b < B; b++) rotate_rows(out + b * os, hg, D, rot_v_block(D));
}
/* attend_block_x with the fused multiply-adds where they are exact (a float16 cache: q and the
   probabilities are rounded to float16 too), the plain ones otherwise */
static void attend_block(const float *q, long qs, int B, const int *span, const void *kc, const void *vc,
                         long at, int dtype, int hg, int D, float scale, float *buf, float *out, long os) {
    if (dtype == KV_F16) attend_block_x(q, qs, B, span, kc, vc, at, dtype, hg, D, scale, buf, out, os, 1);
    else attend_block_x(q, qs, B, span, kc, vc, at, dtype, hg, D, scale, buf, out, os, 0);
}

/* One query token's grouped-query attention over S cached positions: q [H*D]; kc/vc [G, ctx, D]
   (sg = ctx * D between groups); out [H*D]. Each group's heads on one thread. Returns 0, or -2
   when the scratch cannot be allocated. */
int attend_one(const float *q, const void *kc, const void *vc, int dtype, long sg, int S,
               int H, int G, int D, float scale, float *out) {
    const int hg = H / G;
    const size_t per = attend_need(1, hg, S, D);
    float *buf = attn_scratch(per * G);
    if (!buf) return -2;
    #pragma omp parallel for schedule(static) num_threads(omp_team())
    for (int g = 0; g < G; g++)
        attend_block(q + (long)g * hg * D, 0, 1, &S, kc, vc, g * sg, dtype, hg, D, scale, buf + per * g,
                     out + (long)g * hg * D, 0);
    return 0;
}

/* A prefill chunk's causal attention: T query tokens q [T, H*D] at the last T of S cached
   positions (token t sees positions 0..S - T + t), out [T, H*D]. Work items are (group, block of
   ATT_BLOCK tokens), taken by the team's threads as they come free; each token's rows get the bits
   attend_one gives at its position. Returns 0, or -2 when the scratch cannot be allocated. */
int attend_rows(const float *q, const void *kc, const void *vc, int dtype, long sg, int S, int T,
                int H, int G, int D, float scale, float *out) {
    const int hg = H / G, nb = (T + ATT_BLOCK - 1) / ATT_BLOCK, team = omp_team();
    const size_t per = attend_need(ATT_BLOCK, hg, S, D);
    float *buf = attn_scratch(per * team);
    if (!buf) return -2;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (int item = 0; item < G * nb; item++) {
        const int g = item % G, t0 = item / G * ATT_BLOCK;
        const int B = T - t0 < ATT_BLOCK ? T - t0 : ATT_BLOCK;
        int span[ATT_BLOCK];
        for (int b = 0; b < B; b++) span[b] = S - T + t0 + b + 1;
        attend_block(q + (long)t0 * H * D + (long)g * hg * D, (long)H * D, B, span, kc, vc, g * sg, dtype, hg, D,
                     scale, buf + per * omp_get_thread_num(), out + (long)t0 * H * D + (long)g * hg * D, (long)H * D);
    }
    return 0;
}

/* softmax over probs [E] (the logits, in place) and the top k, as route_topk says */
static void route_pick(float *probs, int E, int k, int renorm, int64_t *idx, float *w) {
    float m = -INFINITY, sum = 0.f;
    for (int e = 0; e < E; e++) m = probs[e] > m ? probs[e] : m;
    for (int e = 0; e < E; e++) { probs[e] = expf(probs[e] - m); sum += probs[e]; }
    for (int e = 0; e < E; e++) probs[e] = probs[e] / sum;
    float tot = 0.f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (best >= 0 && !(probs[e] > probs[best])) continue;
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= idx[i] == e;
            if (!taken) best = e;
        }
        idx[j] = best;
        w[j] = probs[best];
        tot += w[j];
    }
    if (renorm)
        for (int j = 0; j < k; j++) w[j] = w[j] / tot;
}

/* The router of one token: logits = x . W^T (W float32 [E, C]), softmax over the E experts,
   the k largest (ties to the lower index; largest first), renormalized to sum 1 if asked.
   probs [E] scratch; idx [k] int64, w [k] float32. */
void route_topk(const float *x, int C, const float *W, int E, int k, int renorm, float *probs,
                int64_t *idx, float *w) {
    #pragma omp parallel for schedule(static) num_threads(omp_team())
    for (int e = 0; e < E; e++) probs[e] = dot16(x, W + (long)e * C, C);
    route_pick(probs, E, k, renorm, idx, w);
}

/* route_topk for each of T rows of x [T, C]: every row's idx and w are the bits route_topk gives
   for that row alone (the same dot16 per expert, four rows sharing each load of W's row, then the
   same softmax and top k). probs [T, E] scratch; idx, w [T, k]. Rows are split over the team. */
void route_topk_rows(const float *x, int T, int C, const float *W, int E, int k, int renorm, float *probs,
                     int64_t *idx, float *w) {
    const int nb = (T + 3) / 4;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(omp_team())
    for (int b = 0; b < nb; b++) {
        const int t0 = b * 4, n = T - t0 < 4 ? T - t0 : 4;
        float *p = probs + (long)t0 * E;
        for (int e = 0; e < E; e++) {
            const float *we = W + (long)e * C;
            if (n == 4) {
                float o[4];
                dot16x4(x + (long)t0 * C, C, we, C, o);
                for (int j = 0; j < 4; j++) p[(long)j * E + e] = o[j];
            } else {
                for (int j = 0; j < n; j++) p[(long)j * E + e] = dot16(x + (long)(t0 + j) * C, we, C);
            }
        }
        for (int j = 0; j < n; j++)
            route_pick(p + (long)j * E, E, k, renorm, idx + (long)(t0 + j) * k, w + (long)(t0 + j) * k);
    }
}

/* What one layer of a decode step binds once (models/fastpath.DecodeAttention; the ctypes
   Structure there mirrors this field by field). */
struct dl_layer {
    const float *attn_norm, *ffn_norm;
    const uint8_t *wq, *wk, *wv, *wo;
    const float *bq, *bk, *bv, *bo;
    const float *nq, *nk;
    const float *router;           /* float32 [E, C], or NULL: the caller routes */
    void *kc, *vc;                 /* this layer's KV cache [G, ctx, D] */
    long kv_stride;                /* ctx * D */
    int tq, tk, tv, to, kind, kv_dtype;
};
struct dl_model { int C, H, G, D, E, topk, renorm, neox; float eps, scale; };

/* A decode step's layer up to the routed experts, on h [C] (the residual stream, updated in
   place): x = RMSNorm(h, attn_norm); q, k, v (attn_qkv); k, v into the cache at pos; attention
   over positions 0..pos; h += o-projection (+ bias); xf = RMSNorm(h, ffn_norm); and, with a
   router, the token's top-k experts. The same kernels, in the same order, as the separate calls
   of models/base.MoETransformer (the same bits). buf: (3H + 2G) * D + C + E floats of scratch.
   Returns 0, -1 for an unsupported weight type, -2 when scratch cannot be allocated. */
int decode_layer(const struct dl_layer *L, const struct dl_model *m, float *h, int pos,
                 const float *cs, const float *sn, float *buf, float *xf, int64_t *idx, float *w) {
    const int C = m->C, H = m->H, G = m->G, D = m->D;
    float *xn = buf, *q = xn + C, *k = q + (long)H * D, *v = k + (long)G * D, *a = v + (long)G * D;
    float *o = a + (long)H * D, *probs = o + C;
    rms_norm_rows(h, 1, C, L->attn_norm, m->eps, xn);
    if (attn_qkv(xn, C, L->wq, L->tq, L->wk, L->tk, L->wv, L->tv, L->bq, L->bk, L->bv, H, G, D, L->kind,
                 L->nq, L->nk, m->eps, cs, sn, m->neox, q, k, v)) return -1;
    kv_put(k, v, L->kc, L->vc, L->kv_dtype, G, D, L->kv_stride, pos);
    int rc = attend_one(q, L->kc, L->vc, L->kv_dtype, L->kv_stride, pos + 1, H, G, D, m->scale, a);
    if (rc) return rc;
    if (qgemm(L->to, a, 1, H * D, L->wo, C, o)) return -1;
    if (L->bo)
        for (int i = 0; i < C; i++) o[i] = o[i] + L->bo[i];
    for (int i = 0; i < C; i++) h[i] = h[i] + o[i];
    rms_norm_rows(h, 1, C, L->ffn_norm, m->eps, xf);
    if (L->router) route_topk(xf, C, L->router, m->E, m->topk, m->renorm, probs, idx, w);
    return 0;
}

/* project() over B rows: one qgemm of B rows (each row the bits of a one-row call), then the bias,
   norms and rotation row by row (rotation by each row's own cos/sin row [B, D/2]). */
static int project_rows(const float *x, int B, int C, const uint8_t *w, int type, const float *b, int heads, int D,
                        int kind, const float *nw, float eps, const float *cs, const float *sn, int neox, int rope,
                        float *y) {
    const int n = heads * D;
    if (qgemm(type, x, B, C, w, n, y) != 0) return -1;
    if (b)
        for (int r = 0; r < B; r++)
            for (int i = 0; i < n; i++) y[(long)r * n + i] = y[(long)r * n + i] + b[i];
    if (kind == NORM_HEAD) rms_norm_rows(y, B * heads, D, nw, eps, y);
    else if (kind == NORM_FULL) rms_norm_rows(y, B, n, nw, eps, y);
    if (rope) rope_rows(y, B, heads, D, cs, sn, neox, y);
    return 0;
}

/* decode_layer for one token of each of B sequences at once: the layer's weights (Ls[0]'s; every
   Ls[i] binds the same ones) are read once for all B rows (the q/k/v and output projections as one
   qgemm of B rows), while each row writes and attends to its own KV cache (Ls[i]->kc/vc) at its own
   position pos[i], rotated by its own cs/sn row. h, xf [B, C]; idx, w [B, topk]; cs, sn [B, D/2];
   buf: B * ((3H + 2G) * D + C) + E floats. Each row gets decode_layer's bits. Returns as it does. */
int decode_layer_rows(const struct dl_layer *const *Ls, int B, const struct dl_model *m, float *h, const int *pos,
                      const float *cs, const float *sn, float *buf, float *xf, int64_t *idx, float *w) {
    const int C = m->C, H = m->H, G = m->G, D = m->D;
    const struct dl_layer *L = Ls[0];
    float *xn = buf, *q = xn + (long)B * C, *k = q + (long)B * H * D, *v = k + (long)B * G * D;
    float *a = v + (long)B * G * D, *o = a + (long)B * H * D, *probs = o + (long)B * C;
    rms_norm_rows(h, B, C, L->attn_norm, m->eps, xn);
    if (project_rows(xn, B, C, L->wq, L->tq, L->bq, H, D, L->kind, L->nq, m->eps, cs, sn, m->neox, 1, q) ||
        project_rows(xn, B, C, L->wk, L->tk, L->bk, G, D, L->kind, L->nk, m->eps, cs, sn, m->neox, 1, k) ||
        project_rows(xn, B, C, L->wv, L->tv, L->bv, G, D, NORM_NONE, 0, m->eps, cs, sn, m->neox, 0, v)) return -1;
    for (int i = 0; i < B; i++) {
        const struct dl_layer *Li = Ls[i];
        kv_put(k + (long)i * G * D, v + (long)i * G * D, Li->kc, Li->vc, Li->kv_dtype, G, D, Li->kv_stride, pos[i]);
        int rc = attend_one(q + (long)i * H * D, Li->kc, Li->vc, Li->kv_dtype, Li->kv_stride, pos[i] + 1, H, G, D,
                            m->scale, a + (long)i * H * D);
        if (rc) return rc;
    }
    if (qgemm(L->to, a, B, H * D, L->wo, C, o)) return -1;
    for (int r = 0; r < B; r++) {
        float *hr = h + (long)r * C, *orow = o + (long)r * C;
        if (L->bo)
            for (int i = 0; i < C; i++) orow[i] = orow[i] + L->bo[i];
        for (int i = 0; i < C; i++) hr[i] = hr[i] + orow[i];
    }
    rms_norm_rows(h, B, C, L->ffn_norm, m->eps, xf);
    if (L->router)
        for (int r = 0; r < B; r++)
            route_topk(xf + (long)r * C, C, L->router, m->E, m->topk, m->renorm, probs,
                       idx + (long)r * m->topk, w + (long)r * m->topk);
    return 0;
}
