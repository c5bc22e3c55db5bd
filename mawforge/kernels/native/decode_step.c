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
