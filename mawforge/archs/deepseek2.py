"""DeepSeek V2 / V3 (HF `deepseek_v2` / `deepseek_v3`, GGUF `deepseek2`).

Multi-head latent attention, computed in its absorbed form over a compressed KV cache: per
position the cache holds only the normalized latent c (kv_lora_rank) and the shared rope key
(qk_rope), never per-head keys or values. Scores are (q_nope W_uk) . c + q_pe . k_pe; the
output is W_uv (probs . c). W_uk / W_uv come from HF's kv_b_proj ([H*(N+Vd), R], head-major,
keys first) or from GGUF's split attn_k_b [H, R, N] and attn_v_b [H, Vd, R].
Routing: sigmoid (V3) or softmax (V2) scores; V3 adds e_score_correction_bias for the choice
only, limits the choice to the best groups (sum of each group's top-2), renormalizes and
scales by routed_scaling_factor. Shared experts run beside the routed ones; the first
first_k_dense_replace layers have a dense MLP and no routed experts.

DeepSeek-V3's MTP (nextn) layer, llama.cpp's layer n_layers, drafts for `--speculative mtp`:
`mtp_step` is one step (see its docstring), models/mtp.py chains them.

Legend: T tokens, C hidden, H heads, N qk_nope dim, P qk_rope dim, R kv_lora_rank,
Vd v head dim, S cached positions, E experts, G expert groups, k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mawforge.archs._yarn import _gguf_yarn, _hf_yarn, yarn_mscale
from mawforge.archs.spec import Arch, ArchArgs, nextn_names
from mawforge.errors import FormatError


@dataclass(frozen=True)
class Args(ArchArgs):
    dense_ff: int = 0
    mla: dict | None = None         # q_lora_rank (0: plain attn_q), kv_lora_rank, qk_nope, qk_rope, v_head_dim
    router: dict | None = None      # gating (sigmoid|softmax), groups, groups_used, group_score (top2sum|max), scale
    rope_scaling: dict | None = None    # YaRN: factor, original_context, beta_fast, beta_slow, attn_factor, ...


# ---- readers (torch-free): config.json / GGUF metadata -> ModelConfig field overrides ----
# kv_layers: one {"kind": "latent", "dim": kv_lora_rank + qk_rope} per layer (the compressed latent
# and the shared rope key, one row per position).
def _deepseek(n: int, heads: int, *, q_rank: int, kv_rank: int, nope: int, rope: int, v: int, dense: int,
              dense_ff: int, moe_ff: int, n_shared: int, router: dict, rope_scaling: dict | None,
              mtp: int) -> dict:
    if router["groups"] < 1 or router["groups_used"] > router["groups"]:
        raise FormatError(f"deepseek2: {router['groups_used']} of {router['groups']} expert groups")
    if rope % 2:
        raise FormatError(f"deepseek2: rope head dim {rope} is odd")
    return {"n_kv_heads": heads, "head_dim": nope + rope, "expert_ff": moe_ff, "shared_ff": moe_ff * n_shared,
            "rope_layout": "norm", "extra": {
                "kv_layers": [{"kind": "latent", "dim": kv_rank + rope}] * n,
                "dense_layers": list(range(min(dense, n))), "dense_ff": dense_ff,
                "mla": {"q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope": nope, "qk_rope": rope,
                        "v_head_dim": v},
                "router": router, "rope_scaling": rope_scaling, "mtp_layers": mtp}}


def read_hf(c: dict[str, Any]) -> dict:
    v3 = c.get("model_type") == "deepseek_v3"
    n_experts = int(c.get("n_routed_experts") or c.get("num_experts"))
    if int(c.get("moe_layer_freq") or 1) != 1:
        raise FormatError("deepseek2: moe_layer_freq other than 1 is not supported")
    groups, used = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    if not v3 and c.get("topk_method", "greedy") == "greedy":
        groups = used = 1
    if n_experts % groups:
        raise FormatError(f"deepseek2: {n_experts} experts do not split into {groups} groups")
    router = {"gating": "sigmoid" if v3 else "softmax", "groups": groups, "groups_used": used,
              "group_score": "top2sum" if v3 else "max",
              "scale": float(c.get("routed_scaling_factor") or 1.0)}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    return _deepseek(int(c["num_hidden_layers"]), int(c["num_attention_heads"]), q_rank=int(c.get("q_lora_rank") or 0),
                     kv_rank=int(c["kv_lora_rank"]), nope=int(c["qk_nope_head_dim"]), rope=int(c["qk_rope_head_dim"]),
                     v=int(c["v_head_dim"]), dense=int(c.get("first_k_dense_replace") or 0),
                     dense_ff=int(c["intermediate_size"]), moe_ff=int(c["moe_intermediate_size"]),
                     n_shared=int(c.get("n_shared_experts") or 0), router=router,
                     rope_scaling=_hf_yarn(rope, int(c.get("max_position_embeddings", 4096))),
                     mtp=int(c.get("num_nextn_predict_layers") or 0)) | {
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)) if v3 else False}


def read_gguf(m: dict[str, Any]) -> dict:
    a = "deepseek2."
    rope = int(m[a + "rope.dimension_count"])
    # MLA files (convert_hf_to_gguf since 2025) carry the per-head widths in *_mla keys and the
    # compressed ones in key_length/value_length; older files carry per-head widths only.
    k_mla = m.get(a + "attention.key_length_mla")
    qk = int(k_mla if k_mla is not None else m[a + "attention.key_length"])
    v = int(m.get(a + "attention.value_length_mla") or m[a + "attention.value_length"])
    gating = {1: "softmax", 2: "sigmoid"}.get(int(m.get(a + "expert_gating_func", 1)))
    if gating is None:
        raise FormatError(f"deepseek2: expert_gating_func {m.get(a + 'expert_gating_func')} is not softmax or sigmoid")
    router = {"gating": gating, "groups": int(m.get(a + "expert_group_count", 1) or 1),
              "groups_used": int(m.get(a + "expert_group_used_count", 1) or 1),
              "group_score": "top2sum" if gating == "sigmoid" else "max",
              "scale": float(m.get(a + "expert_weights_scale", 1.0) or 1.0)}
    log_mul = float(m.get(a + "rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    mtp = int(m.get(a + "nextn_predict_layers", 0) or 0)     # counted in block_count, after the model's layers
    out = _deepseek(int(m[a + "block_count"]) - mtp, int(m[a + "attention.head_count"]),
                    q_rank=int(m.get(a + "attention.q_lora_rank", 0) or 0),
                    kv_rank=int(m[a + "attention.kv_lora_rank"]),
                    nope=qk - rope, rope=rope, v=v, dense=int(m.get(a + "leading_dense_block_count", 0)),
                    dense_ff=int(m[a + "feed_forward_length"]), moe_ff=int(m[a + "expert_feed_forward_length"]),
                    n_shared=int(m.get(a + "expert_shared_count", 0)), router=router,
                    rope_scaling=_gguf_yarn(m, a, log_mul / 0.1), mtp=mtp)
    out["norm_topk_prob"] = bool(m.get(a + "expert_weights_norm", False))
    return out


HF_NAMES = (   # MLA projections, dense first layers, shared experts, router correction bias
    (r"layers\.(\d+)\.self_attn\.q_a_proj\.weight", "blk.{0}.attn_q_a.weight"),
    (r"layers\.(\d+)\.self_attn\.q_a_layernorm\.weight", "blk.{0}.attn_q_a_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.q_b_proj\.weight", "blk.{0}.attn_q_b.weight"),
    (r"layers\.(\d+)\.self_attn\.kv_a_proj_with_mqa\.weight", "blk.{0}.attn_kv_a_mqa.weight"),
    (r"layers\.(\d+)\.self_attn\.kv_a_layernorm\.weight", "blk.{0}.attn_kv_a_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.kv_b_proj\.weight", "blk.{0}.attn_kv_b.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}.weight"),
    (r"layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight", "blk.{0}.ffn_{1}_shexp.weight"),
    (r"layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", "blk.{0}.exp_probs_b.bias"),
    # DeepSeek-V3 MTP (nextn) layer n_layers, as llama.cpp's gguf-py names it (glm4moe's loader);
    # its embed_tokens and shared_head.head repeat the model's own and are not read
) + nextn_names(r"eh_proj\.weight", r"enorm\.weight", r"hnorm\.weight", r"shared_head\.norm\.weight")

# MLA up-projections, used per head (absorbed)
DENSE = ("attn_kv_b.weight", "attn_k_b.weight", "attn_v_b.weight")


def required(cfg, layer: int) -> tuple:
    mla = cfg.args.mla or {}
    q = ("attn_q_a.weight", "attn_q_b.weight") if mla.get("q_lora_rank") else ("attn_q.weight",)
    ffn = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") if layer in cfg.args.dense_layers \
        else ("ffn_gate_inp.weight",)
    return ("attn_norm.weight", "ffn_norm.weight", "attn_kv_a_mqa.weight", "attn_output.weight") + q + ffn


def model() -> type:
    import torch

    from mawforge.kernels import linear
    from mawforge.models.base import MoETransformer, Rope, rms_norm
    from mawforge.models.kv import KVCache
    from mawforge.models.mtp import MtpMixin

    def swiglu_mlp(w, prefix: str, suffix: str, x: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU from blk.N.ffn_{gate,up,down}{suffix}.weight. x [T, C] -> [T, C]."""
        g = linear(x, w.packed(f"{prefix}ffn_gate{suffix}.weight")).float()
        u = linear(x, w.packed(f"{prefix}ffn_up{suffix}.weight")).float()
        return linear(torch.nn.functional.silu(g) * u, w.packed(f"{prefix}ffn_down{suffix}.weight")).float()

    class Deepseek2(MtpMixin, MoETransformer):
        def __init__(self, cfg, weights, experts, device):
            super().__init__(cfg, weights, experts, device)
            x = cfg.args
            self.mla, self.router, self.dense_layers = x.mla, x.router, set(x.dense_layers)
            m, yarn = self.mla, x.rope_scaling
            self.rope = Rope(m["qk_rope"], cfg.rope_base, "norm", device, yarn)
            self.scale = (m["qk_nope"] + m["qk_rope"]) ** -0.5
            if yarn and yarn.get("mscale_all_dim"):
                self.scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2

        # ---- attention -----------------------------------------------------------------------
        def _up(self, p: str) -> tuple[torch.Tensor, torch.Tensor]:
            """W_uk [H, N, R] and W_uv [H, Vd, R] of one layer."""
            H, N, Vd, R = self.cfg.n_heads, self.mla["qk_nope"], self.mla["v_head_dim"], self.mla["kv_lora_rank"]
            if self.w.has(p + "attn_k_b.weight"):
                return (self.w.dense(p + "attn_k_b.weight").reshape(H, R, N).transpose(1, 2),
                        self.w.dense(p + "attn_v_b.weight").reshape(H, Vd, R))
            kvb = self.w.dense(p + "attn_kv_b.weight").reshape(H, N + Vd, R)
            return kvb[:, :N], kvb[:, N:]

        def _query(self, p: str, x: torch.Tensor) -> torch.Tensor:
            if not self.mla["q_lora_rank"]:
                return self.proj(p + "attn_q.weight", x).float()
            qa = rms_norm(self.proj(p + "attn_q_a.weight", x).float(), self.w.dense(p + "attn_q_a_norm.weight"),
                          self.cfg.norm_eps)
            return self.proj(p + "attn_q_b.weight", qa).float()                       # [T, H*(N+P)]

        def attention(self, layer: int, x: torch.Tensor, pos: torch.Tensor, kv) -> torch.Tensor:
            T, H, p = x.shape[0], self.cfg.n_heads, f"blk.{layer}."
            N, R = self.mla["qk_nope"], self.mla["kv_lora_rank"]
            q = self._query(p, x).view(T, H, -1)
            q_nope, q_pe = q[..., :N], self.rope(q[..., N:], pos)                     # [T, H, N], [T, H, P]
            ckv = self.proj(p + "attn_kv_a_mqa.weight", x).float()                    # [T, R+P]
            c = rms_norm(ckv[:, :R], self.w.dense(p + "attn_kv_a_norm.weight"), self.cfg.norm_eps)
            k_pe = self.rope(ckv[:, None, R:], pos)[:, 0]                             # [T, P]
            lat = kv.append_latent(layer, torch.cat((c, k_pe), dim=-1)).float()       # [S, R+P]
            S = lat.shape[0]
            w_uk, w_uv = self._up(p)
            q_abs = torch.einsum("thn,hnr->htr", q_nope, w_uk)                        # [H, T, R]
            scores = (q_abs @ lat[:, :R].T + q_pe.transpose(0, 1) @ lat[:, R:].T) * self.scale   # [H, T, S]
            mask = torch.arange(S, device=x.device)[None] > (S - T + torch.arange(T, device=x.device))[:, None]
            probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            o_lat = probs @ lat[:, :R]                                                # [H, T, R]
            out = torch.einsum("htr,hvr->thv", o_lat, w_uv).reshape(T, -1)            # [T, H*Vd]
            return self.proj(p + "attn_output.weight", out)

        # ---- feed-forward --------------------------------------------------------------------
        def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            T, k, p, r = h.shape[0], self.cfg.top_k, f"blk.{layer}.", self.router
            if layer in self.dense_layers:       # no router (lookahead may still ask)
                return (torch.zeros(T, 0, dtype=torch.long, device=h.device),
                        torch.zeros(T, 0, device=h.device))
            logits = h.float() @ self.w.dense(p + "ffn_gate_inp.weight").T            # [T, E]
            scores = logits.sigmoid() if r["gating"] == "sigmoid" else logits.softmax(dim=-1)
            choice = scores + self.w.dense(p + "exp_probs_b.bias") if self.w.has(p + "exp_probs_b.bias") else scores
            if r["groups_used"] < r["groups"]:
                g = choice.view(T, r["groups"], -1)                                   # [T, G, E/G]
                gs = g.topk(2, dim=-1).values.sum(-1) if r["group_score"] == "top2sum" else g.amax(-1)
                keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(
                    1, gs.topk(r["groups_used"], dim=-1).indices, True)
                choice = choice.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1), float("-inf"))
            idx = choice.topk(k, dim=-1).indices                                      # [T, k]
            w = scores.gather(1, idx)
            if self.cfg.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            return idx, w * r["scale"]

        def ffn(self, layer: int, x: torch.Tensor) -> torch.Tensor:
            if layer in self.dense_layers:
                return swiglu_mlp(self.w, f"blk.{layer}.", "", x)
            return super().ffn(layer, x)

        def beside_experts(self, layer: int, h: torch.Tensor) -> torch.Tensor | None:
            p = f"blk.{layer}."
            return swiglu_mlp(self.w, p, "_shexp", h) if self.w.has(p + "ffn_gate_shexp.weight") else None

        # ---- multi-token prediction ---------------------------------------------------------
        def mtp_cache(self, context: int, dtype: torch.dtype = torch.float32) -> KVCache:
            """The MTP layer's own compressed KV cache (its layer index is n_layers)."""
            c, m = self.cfg, self.mla
            layout = [{"kind": "none"}] * c.n_layers + [{"kind": "latent", "dim": m["kv_lora_rank"] + m["qk_rope"]}]
            return KVCache(c.n_layers + 1, c.n_kv_heads, c.head_dim, context, dtype, self.device, layout)

        def mtp_step(self, hidden: torch.Tensor, tokens: torch.Tensor, pos0: int,
                     mtp_kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
            """hidden [T, C] at positions pos0.. (`hidden()`, or a previous step's output), tokens [T]
            at pos0+1.. -> (the layer's output [T, C], draft logits [T, V] for pos0+2..). DeepSeek-V3
            MTP: eh_proj(cat(enorm(embed(tok)), hnorm(hidden))), one decoder layer (MLA + MoE with
            shared experts), shared_head.norm, the shared LM head. The next chained step reads the
            un-normed output (as vLLM's DeepSeek MTP). The caller commits mtp_kv."""
            L, eps = self.cfg.n_layers, self.cfg.norm_eps
            p = f"blk.{L}."
            e = rms_norm(self.w.embed(tokens), self.w.dense(p + "nextn.enorm.weight"), eps)
            hh = rms_norm(hidden, self.w.dense(p + "nextn.hnorm.weight"), eps)
            h = self.proj(p + "nextn.eh_proj.weight", torch.cat((e, hh), dim=-1)).float()
            pos = torch.arange(pos0, pos0 + tokens.shape[0], device=self.device)
            h = h + self.attention(L, rms_norm(h, self.w.dense(p + "attn_norm.weight"), eps), pos, mtp_kv)
            x = rms_norm(h, self.w.dense(p + self.ffn_norm_name), eps)
            idx, wts = self.route(L, x)
            h = h + self.mtp_experts(L, x, idx, wts)
            shared = self.beside_experts(L, x)
            h = h if shared is None else h + shared
            out = rms_norm(h, self.w.dense(p + "nextn.shared_head_norm.weight"), eps)
            return h, linear(out, self.w.head()).float()

    return Deepseek2


ARCH = Arch("deepseek2", ("deepseek_v3", "deepseek_v2"), model, order=6, args=Args, read_hf=read_hf,
            read_gguf=read_gguf, hf_names=HF_NAMES, dense=DENSE, required=required,
            defaults=dict(qk_norm="none", rope_layout="norm"))   # interleaved-pair RoPE on the rope part
