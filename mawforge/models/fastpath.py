"""The one-token (M=1) decode step of the standard GQA layer in native calls.

A resident decode step on a small CPU spends a large share of its time crossing from Python
into C and making small tensors: before the KV append, `MoETransformer.attention` makes three
projections, two q/k RMSNorms and two RoPEs, each its own call with its own tensors. Here they
are one call (kernels/native/decode_step.c attn_qkv) into one reused buffer, computed by the same
C kernels on the same inputs, so q, k and v are the same bits as the separate calls give.

It is taken only where that holds: native kernels loaded, a CPU model, GGUF q/k/v rows of a type
the kernels take, float32 norm weights and biases, the shared `attention`, `qk_norm`, `proj` and
`Rope` (an architecture that overrides one of them computes its own way and never gets here),
and one float32 token. Anything else runs the separate calls, as before.

Where the whole layer up to the routed experts is the shared code too (`norm`, `mixer_out`,
`ffn_input`, `layer_out`, `ffn`; the attention output rows native, the norm weights float32),
`layer_step` goes further: one call (decode_step.c decode_layer) computes the attention norm,
q/k/v, the KV write, the attention over the cache (native attend_one, which `attend` also calls
for one token), the output projection and residual, the FFN norm and, with the shared `route`
and a float32 router, the top-k (native route_topk, which `route` also calls, for every row of a prompt).
Python is left with the expert cache and the experts: a layer costs two crossings, and the bits
are those of the separate calls, which run the same kernels in the same order.

Legend: C hidden, H query heads, G kv heads, D head dim.
"""
from __future__ import annotations

import torch

from mawforge.kernels import native

NORM_KIND = {"none": 0, "head": 1, "full": 2}


def _native_rows(w) -> tuple | None:
    """(raw rows, GGML type) of a weight the native gemm takes, else None."""
    from mawforge.kernels.cpu import native_rows
    rows = native_rows(w)
    return None if rows is None else (rows.contiguous(), int(w.ggml_type))


def _f32_vector(t, n: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 1 and t.numel() == n
            and t.is_contiguous() and t.device.type == "cpu")


class DecodeAttention:
    """Per layer, the bound arguments of the fused call; `qkv(layer, x, pos)` -> q [1, H, D],
    k [1, G, D], v [1, G, D] (views of one buffer that the next call overwrites)."""

    def __init__(self, model, layers: list[tuple], whole: list[native.LayerArgs] | None = None,
                 keep: list | None = None):
        cfg = model.cfg
        self.heads = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
        self.rope, self.layers = model.rope, layers
        h, g, d = self.heads
        self.out = torch.empty((h + 2 * g) * d, dtype=torch.float32)
        self.q = self.out[:h * d].view(1, h, d)
        self.k = self.out[h * d:(h + g) * d].view(1, g, d)
        self.v = self.out[(h + g) * d:].view(1, g, d)
        # the whole-layer step: per-layer arguments (None: not planned), the tensors they point
        # into (kept alive here), the KV cache they are bound to, and the step's buffers
        self.whole, self._keep, self._kv = whole, keep, None
        # a batch's coordinator (engine/batch.py): gate(fast, layer, h, pos, cos, sin) -> this row's
        # (x, routed) once native.decode_layer_rows ran the layer for every sequence of the step,
        # or None to run the layer here at once
        self.gate = None
        if whole is not None:
            self.model_args = native.ModelArgs(C=cfg.hidden, H=h, G=g, D=d, E=cfg.n_experts, topk=cfg.top_k,
                                               renorm=int(cfg.norm_topk_prob), neox=int(model.rope.layout == "neox"),
                                               eps=float(cfg.norm_eps), scale=float(model.scale))
            self.routes = whole[0].router is not None
            self.buf = torch.empty((3 * h + 2 * g) * d + cfg.hidden + cfg.n_experts, dtype=torch.float32)
            self.x = torch.empty(1, cfg.hidden, dtype=torch.float32)

    @classmethod
    def plan(cls, model) -> DecodeAttention | None:
        """The fast path for this model, or None where any of its conditions does not hold."""
        from mawforge.models.base import MoETransformer, Rope
        t = type(model)
        if (model.device.type != "cpu" or not native.available() or type(model.rope) is not Rope
                or any(getattr(t, f) is not getattr(MoETransformer, f)
                       for f in ("attention", "qk_norm", "proj", "mixer"))):
            return None
        cfg, w = model.cfg, model.w
        h, g, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kind = NORM_KIND.get(cfg.qk_norm)
        if kind is None or (cfg.args.kv_layers and any(s.get("kind") != "kv" or s.get("window")
                                                       for s in cfg.args.kv_layers)):
            return None
        norm_n = {0: (0, 0), 1: (d, d), 2: (h * d, g * d)}[kind]
        layers = []
        for layer in range(cfg.n_layers):
            p = f"blk.{layer}."
            names = [p + f"attn_{s}.weight" for s in "qkv"]
            if not all(w.has(n) for n in names):
                return None
            ws = [_native_rows(w.packed(n)) for n in names]
            biases = [w.maybe_dense(n.replace(".weight", ".bias")) for n in names]
            if any(r is None for r in ws) or any(b is not None and not _f32_vector(b, n)
                                                for b, n in zip(biases, (h * d, g * d, g * d))):
                return None
            nq = nk = None
            if kind:
                nq, nk = w.maybe_dense(p + "attn_q_norm.weight"), w.maybe_dense(p + "attn_k_norm.weight")
                if not (_f32_vector(nq, norm_n[0]) and _f32_vector(nk, norm_n[1])):
                    return None
            layers.append((tuple(ws), tuple(biases), (kind, nq, nk, float(cfg.norm_eps))))
        whole, keep = cls._plan_layers(model, layers)
        return cls(model, layers, whole, keep)

    @staticmethod
    def _plan_layers(model, layers: list[tuple]) -> tuple[list | None, list | None]:
        """decode_layer's arguments per layer, or (None, None) where a condition of layer_step fails."""
        from mawforge.models.base import MoETransformer
        t, cfg, w = type(model), model.cfg, model.w
        if any(getattr(t, f) is not getattr(MoETransformer, f)
               for f in ("norm", "norm_weight", "mixer_out", "ffn_input", "layer_out", "ffn", "hidden")):
            return None, None
        c, (h, d) = cfg.hidden, (cfg.n_heads, cfg.head_dim)
        routers = [None] * len(layers)
        if t.route is MoETransformer.route:       # else the architecture routes in Python
            routers = [model._bound(layer, "ffn_gate_inp.weight") for layer in range(len(layers))]
            if not all(native.route_takes(torch.empty(1, c), r) for r in routers):
                routers = [None] * len(layers)
        whole, keep = [], []
        for layer, (ws, biases, (kind, nq, nk, _)) in enumerate(layers):
            p = f"blk.{layer}."
            norms = [w.maybe_dense(p + n) for n in ("attn_norm.weight", model.ffn_norm_name)]
            o = w.packed(p + "attn_output.weight") if w.has(p + "attn_output.weight") else None
            wo = _native_rows(o) if o is not None and tuple(o.shape) == (c, h * d) else None
            bo = w.maybe_dense(p + "attn_output.bias")
            if not all(_f32_vector(n, c) for n in norms) or wo is None or (bo is not None and not _f32_vector(bo, c)):
                return None, None
            router, ptr = routers[layer], native.ptr
            (wq, tq), (wk, tk), (wv, tv) = ws
            args = native.LayerArgs(attn_norm=ptr(norms[0]), ffn_norm=ptr(norms[1]), wq=ptr(wq), wk=ptr(wk), wv=ptr(wv),
                                    wo=ptr(wo[0]), bq=ptr(biases[0]), bk=ptr(biases[1]), bv=ptr(biases[2]), bo=ptr(bo),
                                    nq=ptr(nq), nk=ptr(nk), router=ptr(router), tq=tq, tk=tk, tv=tv, to=wo[1],
                                    kind=kind)
            whole.append(args)
            keep.append((norms, wo, bo, router))
        return whole, keep

    def layer_step(self, h: torch.Tensor, pos0: int, kv):
        """The fused step for this forward (`step(layer, h)` -> (x, routed or None); h [1, C] is
        updated in place), or None where it does not apply: more than one token, no whole-layer
        plan, or a KV cache that is not one [G, ctx, D] float32/float16/bfloat16 tensor a layer.
        x and the routed (idx, wts) are buffers the next layer's call overwrites: their consumers
        (the expert cache, a route trace, a prefetcher) copy what they keep."""
        if self.whole is None or h.shape[0] != 1 or h.dtype != torch.float32 or h.device.type != "cpu":
            return None
        if not self._bound_to(kv) and not self._bind(kv):
            return None
        if kv.pos >= kv.context:
            return None                     # the separate calls raise the error
        cos, sin = self.rope.at(pos0)
        run, margs, buf, x = native.decode_layer, self.model_args, self.buf, self.x
        pos, whole = kv.pos, self.whole
        idx = torch.empty(1, margs.topk, dtype=torch.int64)
        wts = torch.empty(1, margs.topk, dtype=torch.float32)
        routed = (idx, wts) if self.routes else None

        def step(layer: int, hh: torch.Tensor):
            if self.gate is not None:       # a batch's step: the layer runs once for all its sequences
                out = self.gate(self, layer, hh, pos, cos, sin)
                if out is not None:
                    return out
            run(whole[layer], margs, hh, pos, cos, sin, buf, x, idx, wts)
            return x, routed
        return step

    def _bound_to(self, kv) -> bool:
        """True while the arguments point at kv's tensors (the same objects as at _bind)."""
        return (kv is self._kv and all(a is b for a, b in zip(kv.k, self._kv_tensors[0]))
                and all(a is b for a, b in zip(kv.v, self._kv_tensors[1])))

    def _bind(self, kv) -> bool:
        """Point every layer's arguments at kv's tensors; False where one is not a plain KV layer."""
        g, d = self.heads[1], self.heads[2]
        ks, vs = getattr(kv, "k", None), getattr(kv, "v", None)
        if ks is None or len(ks) < len(self.whole) or getattr(kv, "state", None) and any(kv.state[:len(self.whole)]):
            return False
        for layer, args in enumerate(self.whole):
            k, v = ks[layer], vs[layer]
            if (k is None or v is None or k.dtype not in native.KV_DTYPES or v.dtype != k.dtype or not k.is_contiguous()
                    or not v.is_contiguous() or k.shape != v.shape
                    or tuple(k.shape) != (g, kv.context, native.row_width(k.dtype, d))
                    or k.device.type != "cpu"):
                self._kv = None
                return False
            args.kc, args.vc, args.kv_stride, args.kv_dtype = (k.data_ptr(), v.data_ptr(), kv.context * d,
                                                               native.kv_code(k.dtype, kv.rotated))
        self._kv, self._kv_tensors = kv, (list(ks[:len(self.whole)]), list(vs[:len(self.whole)]))
        return True

    def qkv(self, layer: int, x: torch.Tensor, pos: torch.Tensor):
        cos, sin = self.rope.at(int(pos[0]))
        ws, biases, norm = self.layers[layer]
        native.attn_qkv(x.contiguous(), ws, biases, self.heads, norm, cos, sin, self.rope.layout == "neox", self.out)
        return self.q, self.k, self.v
