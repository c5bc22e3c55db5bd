/* Fused dequantize-and-multiply for GGUF K-quant rows on the CPU: y[M,N] = x[M,K] . W[N,K]^T
 * where W stays in its GGUF bytes (Q6_K: 210 bytes / 256 weights, Q5_K: 176 bytes / 256).
 * For small M (decode, speculative verify): each 256-weight block is unpacked once into int8
 * and dotted with every row of x, so the packed bytes are read once per call. Rows of W are
 * split across OpenMP threads. Bit layouts follow ggml's dequantize_row_q6_K / _q5_K. */
#include <stdint.h>
#include <string.h>

#define MAXM 8   /* callers pass at most this many rows of x (NATIVE_MAX_M in kernels/cpu.py) */

static inline float f16_to_f32(uint16_t h) {
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

/* one Q6_K block -> 256 int8 values (q - 32) and 16 float scales (d * sc) */
static inline void unpack_q6k(const uint8_t *b, int8_t *q, float *s) {
    const uint8_t *ql = b, *qh = b + 128; const int8_t *sc = (const int8_t *)(b + 192);
    uint16_t dh; memcpy(&dh, b + 208, 2); float d = f16_to_f32(dh);
    for (int j = 0; j < 16; j++) s[j] = d * sc[j];
    for (int n = 0; n < 2; n++) {
        int8_t *y = q + 128 * n; const uint8_t *l = ql + 64 * n, *h = qh + 32 * n;
        for (int i = 0; i < 32; i++) {
            y[i]      = (int8_t)(((l[i] & 0xF)      | (((h[i] >> 0) & 3) << 4)) - 32);
            y[i + 32] = (int8_t)(((l[i + 32] & 0xF) | (((h[i] >> 2) & 3) << 4)) - 32);
            y[i + 64] = (int8_t)(((l[i] >> 4)       | (((h[i] >> 4) & 3) << 4)) - 32);
            y[i + 96] = (int8_t)(((l[i + 32] >> 4)  | (((h[i] >> 6) & 3) << 4)) - 32);
        }
    }
}

static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* one Q5_K block -> 256 int8 values q in [0, 31], 8 scales (d*sc) and 8 offsets (dmin*m) */
static inline void unpack_q5k(const uint8_t *b, int8_t *q, float *s, float *o) {
    uint16_t dh, mh; memcpy(&dh, b, 2); memcpy(&mh, b + 2, 2);
    float d = f16_to_f32(dh), dmin = f16_to_f32(mh);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 4; j++) {
        uint8_t sc, m;
        k_scale_min(2 * j, scales, &sc, &m);     s[2 * j] = d * sc;     o[2 * j] = dmin * m;
        k_scale_min(2 * j + 1, scales, &sc, &m); s[2 * j + 1] = d * sc; o[2 * j + 1] = dmin * m;
        const uint8_t *l = ql + 32 * j; int8_t *y = q + 64 * j;
        for (int i = 0; i < 32; i++) {
            y[i]      = (int8_t)((l[i] & 0xF) + ((qh[i] & u1) ? 16 : 0));
            y[i + 32] = (int8_t)((l[i] >> 4)  + ((qh[i] & u2) ? 16 : 0));
        }
        u1 <<= 2; u2 <<= 2;
    }
}

#ifdef __AVX2__
#include <immintrin.h>

/* x rows quantized to int8 per 256-weight block (scale = max|x| / 127), as llama.cpp's q8_K */
static void quantize_x(const float *x, int M, int K, int8_t *xq, float *dx) {
    for (int m = 0; m < M; m++)
        for (int b = 0; b < K / 256; b++) {
            const float *v = x + (long)m * K + b * 256;
            float amax = 0.f;
            for (int i = 0; i < 256; i++) { float a = v[i] < 0 ? -v[i] : v[i]; amax = a > amax ? a : amax; }
            float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
            int8_t *o = xq + (long)m * K + b * 256;
            for (int i = 0; i < 256; i++) o[i] = (int8_t)__builtin_lrintf(v[i] * id);
            dx[(long)m * (K / 256) + b] = d;
        }
}

static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* one Q6_K block . one q8 block, in integers: 6-bit values (0..63) times int8 activations with
   maddubs, minus 32 * sum(x), times the int8 sub-block scales with madd. */
static inline int q6k_dot_q8(const uint8_t *b, const int8_t *q8) {
    const uint8_t *ql = b, *qh = b + 128; const int8_t *sc = (const int8_t *)(b + 192);
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
    __m256i sumi = _mm256_setzero_si256();
    for (int j = 0; j < 2; j++, ql += 64, qh += 32) {
        __m256i b1 = _mm256_loadu_si256((const __m256i *)ql), b2 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i bh = _mm256_loadu_si256((const __m256i *)qh);
        __m256i v[4];
        v[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_slli_epi16(_mm256_and_si256(bh, m2), 4));
        v[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 2), m2), 4));
        v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 4), m2), 4));
        v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(bh, 6), m2), 4));
        const int8_t *x = q8 + 128 * j, *s = sc + 8 * j;
        for (int k = 0; k < 4; k++) {
            __m256i xk = _mm256_loadu_si256((const __m256i *)(x + 32 * k));
            __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(v[k], xk), _mm256_maddubs_epi16(m32, xk));
            __m256i scl = _mm256_set_m128i(_mm_set1_epi16(s[2 * k + 1]), _mm_set1_epi16(s[2 * k]));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scl, p));
        }
    }
    return hsum_i32(sumi);
}

/* xq: caller's scratch of M*K int8, dx: M*K/256 floats */
void q6k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *xq, float *dx) {
    const int nb = K / 256; const long rb = (long)nb * 210;
    quantize_x(x, M, K, xq, dx);
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *row = w + n * rb;
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int b = 0; b < nb; b++) {
                uint16_t dh; memcpy(&dh, row + b * 210 + 208, 2);
                acc += f16_to_f32(dh) * dx[(long)m * nb + b] * (float)q6k_dot_q8(row + b * 210, xq + (long)m * K + b * 256);
            }
            y[(long)m * N + n] = acc;
        }
    }
}
int q6k_integer(void) { return 1; }
#else
void q6k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *xq, float *dx) {
    const int nb = K / 256; const long rb = (long)nb * 210;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        /* measured: this plain form beats a lane-partial-sum form for Q6_K (0.30 vs 0.46 ms for
           a 2048x768 GEMV on 2 threads); the unpack dominates */
        int8_t q[256]; float s[16]; float acc[16];
        for (int m = 0; m < M; m++) y[(long)m * N + n] = 0.f;
        for (int b = 0; b < nb; b++) {
            unpack_q6k(w + n * rb + b * 210, q, s);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (long)m * K + b * 256;
                float sum = 0.f;
                for (int j = 0; j < 16; j++) {
                    float a = 0.f;
                    for (int i = 0; i < 16; i++) a += (float)q[16 * j + i] * xb[16 * j + i];
                    acc[j] = a;
                }
                for (int j = 0; j < 16; j++) sum += s[j] * acc[j];
                y[(long)m * N + n] += sum;
            }
        }
    }
}

int q6k_integer(void) { return 0; }
#endif

void q5k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y) {
    const int nb = K / 256; const long rb = (long)nb * 176;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        int8_t q[256]; float s[8], o[8]; float part[MAXM][32];
        for (int m = 0; m < M; m++) for (int i = 0; i < 32; i++) part[m][i] = 0.f;
        for (int b = 0; b < nb; b++) {
            unpack_q5k(w + n * rb + b * 176, q, s, o);
            for (int m = 0; m < M; m++) {
                const float *xb = x + (long)m * K + b * 256;
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 32; i++) part[m][i] += (s[j] * (float)q[32 * j + i] - o[j]) * xb[32 * j + i];
            }
        }
        for (int m = 0; m < M; m++) {
            float sum = 0.f;
            for (int i = 0; i < 32; i++) sum += part[m][i];
            y[(long)m * N + n] = sum;
        }
    }
}

void set_threads(int n);
#include <omp.h>
void set_threads(int n) { omp_set_num_threads(n); }
