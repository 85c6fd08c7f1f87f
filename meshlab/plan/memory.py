"""Memory per device: model state as meshlab stores it, activations per remat policy, KV cache.

Model state is exact: it reads the same PartitionSpecs the train step uses (`leaf_specs`), so
the bytes equal what the compiled program places. meshlab keeps fp32 params (they are the
master weights: no separate bf16 copy, the compute dtype is cast per use), an fp32 gradient
accumulator with the rule file's grads spec and Adam's mu/nu in fp32 with the optimizer spec:
4 + 4 + 8 = 16 bytes per parameter, the same total as the source material's
2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, mu, nu), split differently by ZeRO stage.

Activations and temporaries are an estimate, built from the tensors the backward pass keeps
(the residuals autodiff saves, after XLA fuses elementwise chains) for each remat policy of
models/llama.py `_remat`; the test suite holds it to the compiler's memory analysis.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from meshlab.plan import account

F32 = 4


@dataclasses.dataclass(frozen=True)
class Local:
    """Per-device sizes of one micro-batch's activations under a rule file and mesh."""
    b: int            # rows per device per micro-batch
    s: int            # residual-stream sequence per device (split by sequence/context parallelism)
    s_attn: int       # query sequence inside attention (split by context parallelism only)
    s_kv: int         # key sequence attention sees at once (full unless ring attention)
    h: int            # query heads per device
    kvh: int          # kv heads per device
    f: int            # MLP width per device
    v: int            # vocab columns per device (logits)
    d: int
    hd: int
    c: int            # bytes of the compute dtype
    t: int            # tensor-parallel size (activations all-reduced over it)
    sp: bool          # residual stream split over `tensor` (sequence parallelism)


def _size(rules, mesh, name) -> int:
    return math.prod(mesh.shape[a] for a in rules.axes(name, mesh))


def local_sizes(cfg, rules, mesh, global_batch: int, seq: int, microbatches: int = 1) -> Local:
    dp = rules.data_parallel_size(mesh)
    b = max(global_batch // (dp * microbatches), 1)
    seq_split = _size(rules, mesh, "act_seq")
    attn_split = _size(rules, mesh, "act_attn_seq")
    ring = rules.strategies.get("attention") == "ring"
    t = mesh.shape["tensor"]
    return Local(b=b, s=seq // seq_split, s_attn=seq // attn_split, s_kv=seq // attn_split if ring else seq,
                 h=cfg.n_heads // _size(rules, mesh, "act_heads"),
                 kvh=max(cfg.n_kv_heads // _size(rules, mesh, "act_kv_heads"), 1),
                 f=cfg.mlp_dim // _size(rules, mesh, "act_mlp"), v=cfg.padded_vocab // _size(rules, mesh, "act_vocab"),
                 d=cfg.d_model, hd=cfg.head_dim, c=np.dtype(cfg.dtype).itemsize, t=t,
                 sp="tensor" in rules.axes("act_seq", mesh))


# -- model state -------------------------------------------------------------------------------
def zero_stage(rules) -> int:
    st = rules.state
    return {("replicated",) * 3: 0, ("replicated", "replicated", "sharded"): 1,
            ("replicated", "sharded", "sharded"): 2}.get((st["params"], st["grads"], st["optimizer"]), 3)


def state_memory(md, rules, mesh) -> dict:
    """Exact per-device bytes of fp32 params (= master), fp32 grad accumulator, Adam mu+nu."""
    got = account.state_bytes(md, rules, mesh)
    return {"params": got["params"], "grads": got["grads"], "optimizer": got["optimizer"], "total": got["total"]}


def textbook_memory(n_params: int, stage: int, p: int) -> dict:
    """The source material's 16 B/param (bf16 params+grads, fp32 master+mu+nu) per ZeRO stage, p shards."""
    params = 2 * n_params / (p if stage >= 3 else 1)
    grads = 2 * n_params / (p if stage >= 2 else 1)
    opt = 12 * n_params / (p if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


# -- activations -------------------------------------------------------------------------------
def layer_residuals(lc: Local, policy: str, attention: str = "xla") -> dict:
    """Bytes one layer keeps for its backward pass, by tensor, for one micro-batch on one device.

    `none`: what autodiff saves once XLA has fused elementwise chains: matmul inputs, norm inputs
    (fp32), the softmax output of XLA attention ([b,h,s,s] fp32: the S^2 term; a flash kernel
    keeps only the [b,h,s] log-sum-exp), SwiGLU's fp32 gate and up. `save_dots`: every matmul
    output (fp32 accumulators, incl. attention's two batched dots); `save_dots_no_batch`: only the
    projections (no batch dimension); `full`: the layer input alone (everything else recomputed).
    """
    tok = lc.b * lc.s
    atok = lc.b * lc.s_attn
    flash = attention not in ("xla",)
    probs = atok * lc.h * (1 if flash else lc.s_kv) * F32
    x_in = tok * lc.d * lc.c
    if policy == "full":
        return {"layer input": x_in}
    if policy in ("save_dots", "save_dots_no_batch"):
        out = {"layer input": x_in,
               "q,k,v proj (fp32)": atok * (lc.h + 2 * lc.kvh) * lc.hd * F32,
               "o proj (fp32)": tok * lc.d * F32,
               "gate, up (fp32)": 2 * atok * lc.f * F32,
               "down (fp32)": tok * lc.d * F32}
        if policy == "save_dots" and not flash:
            out["scores, p@v (fp32)"] = probs + atok * lc.h * lc.hd * F32
        return out
    if policy != "none":
        raise ValueError(f"unknown remat policy {policy!r}; one of none, full, save_dots, save_dots_no_batch")
    return {"norm inputs (fp32)": 2 * tok * lc.d * F32,
            "normed inputs": 2 * atok * lc.d * lc.c,
            "q,k,v (roped)": atok * (lc.h + 2 * lc.kvh) * lc.hd * lc.c,
            "softmax probs" if not flash else "lse": probs,
            "attention out": atok * lc.h * lc.hd * lc.c,
            "gate, up (fp32)": 2 * atok * lc.f * F32,
            "silu*up": atok * lc.f * lc.c}


def activation_memory(cfg, lc: Local, policy: str, attention: str = "xla") -> dict:
    """Peak activation bytes: L layers' residuals + one layer's working set in the backward + the loss head."""
    per_layer = layer_residuals(lc, policy, attention)
    saved = cfg.n_layers * sum(per_layer.values())
    # Backward of one layer: its full residual set exists again (recomputed unless `none`), plus the
    # cotangents of the widest tensors (fp32 [b,s,f] x2 and the residual stream).
    none = layer_residuals(lc, "none", attention)
    working = sum(none.values()) if policy != "none" else 0
    working += 2 * lc.b * lc.s_attn * lc.f * F32 + 2 * lc.b * lc.s * lc.d * F32
    # Loss head: fp32 logits and their gradient [b, s, V/t], the dense cross-entropy.
    head = 2 * lc.b * lc.s_attn * lc.v * F32 + lc.b * lc.s * lc.d * F32
    return {"saved per layer": sum(per_layer.values()), "saved (all layers)": saved, "backward working set": working,
            "loss head": head, "total": saved + working + head, "detail": per_layer}


def gathered_weights(md, rules, mesh, policy: str) -> int:
    """ZeRO-3: the all-gathered compute-dtype copy of each layer's weights. Under `none` autodiff saves
    every layer's gathered copy for the backward (the gather is not recomputed); otherwise one layer's."""
    if rules.state["params"] != "sharded" or not rules.batch_axes(mesh):
        return 0
    c = np.dtype(md.cfg.dtype).itemsize
    rows = account.param_table(md, rules, mesh, "params")
    gathered = 0
    layer = 0
    for r in rows:
        full = account.bytes_per_device(r.shape, np.float32, _drop(r.spec, rules.batch_axes(mesh)), mesh) // F32 * c
        if r.names and r.names[0] == "layers":
            layer += full // r.shape[0]
        else:
            gathered += full
    return gathered + (md.cfg.n_layers * layer if policy == "none" else 2 * layer)


def _drop(spec, axes):
    from meshlab.train.state import only_axes
    keep = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e) if a not in axes]
    return only_axes(spec, keep)


def kv_cache_bytes(cfg, batch: int, seq: int, tensor: int = 1, dtype_bytes: int = 2) -> int:
    """Serving: K and V for every layer, [batch, seq, kv_heads/tensor, head_dim] each."""
    return 2 * cfg.n_layers * batch * seq * max(cfg.n_kv_heads // tensor, 1) * cfg.head_dim * dtype_bytes


def plan_memory(md, rules, mesh, global_batch: int, seq: int, microbatches: int = 1, policy: str | None = None,
                attention: str | None = None) -> dict:
    """Everything per device for one training step; `temporaries` is the stated allowance beside activations."""
    cfg = md.cfg
    policy = policy or cfg.remat
    attention = attention or cfg.attention
    lc = local_sizes(cfg, rules, mesh, global_batch, seq, microbatches)
    state = state_memory(md, rules, mesh)
    act = activation_memory(cfg, lc, policy, attention)
    # Temporaries beside activations: the fp32 gradients of one micro-batch before they reach the
    # accumulator (full layer size for ZeRO-0/1, reduce-scattered per layer for ZeRO-3), the accumulator
    # itself when it is not the output, Adam's update tree, and the gathered weights of ZeRO-3.
    grads_local = _grads_before_reduce(md, rules, mesh)
    temps = {"micro-batch grads (fp32)": grads_local,
             "accumulator": state["grads"] if microbatches > 1 else 0,
             "optimizer update": state["optimizer"] // 2,
             "gathered weights": gathered_weights(md, rules, mesh, policy)}
    temps["total"] = sum(temps.values())
    total = state["params"] + state["optimizer"] + act["total"] + temps["total"]
    return {"state": state, "activations": act, "temporaries": temps, "local": lc, "total": total,
            "textbook": textbook_memory(account.param_count(md), zero_stage(rules), rules.data_parallel_size(mesh))}


def _grads_before_reduce(md, rules, mesh) -> int:
    """fp32 gradient of one micro-batch as the backward produces it: the params storage spec with the
    data-parallel axes removed (each device holds the full local gradient until it is reduced). ZeRO-3
    reduce-scatters per layer inside the loop, so only the non-layer leaves and one layer are full."""
    batch = rules.batch_axes(mesh)
    rows = account.param_table(md, rules, mesh, "params")
    total = 0
    for r in rows:
        full = account.bytes_per_device(r.shape, np.float32, _drop(r.spec, batch), mesh)
        if rules.state["params"] == "sharded" and r.names and r.names[0] == "layers":
            full = full // r.shape[0] + r.bytes_per_device
        total += full
    return total
