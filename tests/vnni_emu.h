/* The six AVX-512 operations kquant_gemm.c's VNNI kernels use, emulated on AVX2 by their
   definitions in Intel's reference (two independent 256-bit halves: maddubs and dpwssd work
   within adjacent bytes and words, so a 512-bit operation is the 256-bit one on each half), so
   that an AVX2 machine checks that code's lanes and offsets (tests/test_native_prefill.py). */
#include <immintrin.h>
typedef struct { __m256i lo, hi; } emu512;
#define __m512i emu512
static inline emu512 emu_zero(void) { emu512 r = {_mm256_setzero_si256(), _mm256_setzero_si256()}; return r; }
static inline emu512 emu_cast(__m256i a) { emu512 r = {a, _mm256_setzero_si256()}; return r; }
static inline emu512 emu_insert(emu512 a, __m256i b, int hi) { if (hi) a.hi = b; else a.lo = b; return a; }
static inline __m256i emu_low(emu512 a) { return a.lo; }
static inline __m256i emu_extract(emu512 a, int hi) { return hi ? a.hi : a.lo; }
static inline emu512 emu_loadu(const void *p) {
    emu512 r = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)((const char *)p + 32))};
    return r;
}
static inline emu512 emu_maddubs(emu512 a, emu512 b) {
    emu512 r = {_mm256_maddubs_epi16(a.lo, b.lo), _mm256_maddubs_epi16(a.hi, b.hi)};
    return r;
}
static inline emu512 emu_dpwssd(emu512 s, emu512 a, emu512 b) {
    emu512 r = {_mm256_add_epi32(s.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(s.hi, _mm256_madd_epi16(a.hi, b.hi))};
    return r;
}
#undef _mm512_setzero_si512
#undef _mm512_castsi256_si512
#undef _mm512_inserti64x4
#undef _mm512_castsi512_si256
#undef _mm512_extracti64x4_epi64
#undef _mm512_loadu_si512
#undef _mm512_maddubs_epi16
#undef _mm512_dpwssd_epi32
#define _mm512_setzero_si512 emu_zero
#define _mm512_castsi256_si512 emu_cast
#define _mm512_inserti64x4 emu_insert
#define _mm512_castsi512_si256 emu_low
#define _mm512_extracti64x4_epi64 emu_extract
#define _mm512_loadu_si512 emu_loadu
#define _mm512_maddubs_epi16 emu_maddubs
#define _mm512_dpwssd_epi32 emu_dpwssd
