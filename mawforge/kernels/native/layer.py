"""The fused decode layer's ctypes side (decode_step.c decode_layer and decode_layer_rows): the
structures models/fastpath.py binds once per layer, and the calls a decode step (or a batch's
step, engine/batch.py) makes."""
from __future__ import annotations

import ctypes

import torch

from mawforge.kernels.native import _I, _P, _sync_threads, library


class LayerArgs(ctypes.Structure):
    """decode_step.c's struct dl_layer: what one layer of a decode step binds once."""
    _fields_ = [(n, _P) for n in ("attn_norm", "ffn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo",
                                  "nq", "nk", "router", "kc", "vc")] + \
               [("kv_stride", ctypes.c_long)] + [(n, _I) for n in ("tq", "tk", "tv", "to", "kind", "kv_dtype")]


class ModelArgs(ctypes.Structure):
    """decode_step.c's struct dl_model: the shapes every layer shares."""
    _fields_ = [(n, _I) for n in ("C", "H", "G", "D", "E", "topk", "renorm", "neox")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def decode_layer(layer: LayerArgs, model: ModelArgs, h: torch.Tensor, pos: int, cos: torch.Tensor,
                 sin: torch.Tensor, buf: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    """decode_step.c's decode_layer on h [1, C] (updated in place): writes the FFN input x [1, C]
    and, where the layer binds a router, idx [1, k] int64 and w [1, k]. Every tensor float32
    contiguous on the CPU; buf holds (3H + 2G) * D + C + E floats."""
    lib = library()
    _sync_threads(lib)
    rc = lib.decode_layer(ctypes.byref(layer), ctypes.byref(model), h.data_ptr(), pos, cos.data_ptr(), sin.data_ptr(),
                          buf.data_ptr(), x.data_ptr(), idx.data_ptr(), w.data_ptr())
    if rc != 0:
        raise ValueError("native decode_layer: " + ("unsupported weight type" if rc == -1 else "out of memory"))


def decode_layer_rows(layers: list, model: ModelArgs, h: torch.Tensor, pos: list[int], cos: torch.Tensor,
                      sin: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    """decode_layer for one token of each of B sequences (a batch's decode step): layers[i] is row
    i's LayerArgs (the same weights, its own KV cache); h [B, C] updated in place; x [B, C], idx
    [B, k] int64, w [B, k] written; cos/sin [B, D/2] each row's rotation. The layer's weights are
    read once for all rows; each row gets decode_layer's bits."""
    lib = library()
    _sync_threads(lib)
    b = len(layers)
    arr = (ctypes.c_void_p * b)(*[ctypes.addressof(a) for a in layers])
    p = (ctypes.c_int * b)(*pos)
    n = b * ((3 * model.H + 2 * model.G) * model.D + model.C) + model.E
    buf = torch.empty(n, dtype=torch.float32)
    rc = lib.decode_layer_rows(arr, b, ctypes.byref(model), h.data_ptr(), p, cos.data_ptr(), sin.data_ptr(),
                               buf.data_ptr(), x.data_ptr(), idx.data_ptr(), w.data_ptr())
    if rc != 0:
        raise ValueError("native decode_layer_rows: " + ("unsupported weight type" if rc == -1 else "out of memory"))
