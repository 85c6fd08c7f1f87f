"""FLOPs per training step, split into the S*H^2 terms (projections, MLP) and S^2*H terms (attention).

Per layer and token, forward: projections 2*d*(h + 2*kvh)*hd + 2*h*hd*d, SwiGLU 3 * 2*d*f,
causal attention 2*S*h*hd (QK^T and PV, each 2*S*h*hd, halved by the mask). Training is 3x the
forward (one forward, a backward of twice its cost: the 6N of DESIGN.md); remat adds the
recomputed forward: `full` the whole layer, `save_dots_no_batch` attention's two batched dots,
`none` no matmul, `save_dots` none with `xla` (its batched dots are kept) and the attention forward
with a flash attention (cuDNN's, ours, or ring attention's Pallas blocks: kernels, no dot to keep),
`save_dots_attn` none with a flash attention (its output and lse are kept; one forward launch per
layer and step in the H200 profiles, models/remat.py), the batched dots with `xla`. The LM head
(2*d*V per token) is the S*H^2 side too.
"""
from __future__ import annotations

import math


def layer_flops_per_token(cfg, seq: int) -> dict:
    """Forward FLOPs of one layer for one token at sequence length `seq` (causal)."""
    d, h, kvh, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
    router = 0
    if hasattr(cfg, "active_mlp_dim"):   # mixture of experts: the k experts a token runs (+ shared), its router
        f, router = cfg.active_mlp_dim, 2 * d * cfg.n_experts
    return {"projections": 2 * d * (h + 2 * kvh) * hd + 2 * h * hd * d,
            "mlp": 3 * 2 * d * f + router,
            "attention": 2 * seq * h * hd}


def crossover_seq(cfg) -> float:
    """Sequence length where causal attention's S^2*H FLOPs equal the S*H^2 ones (projections + MLP)."""
    f = layer_flops_per_token(cfg, 1)
    return (f["projections"] + f["mlp"]) / f["attention"]


def textbook_crossover(d_model: int) -> float:
    """The source material's 8SH^2 + 4S^2H + 6SH^2 (4H MLP, no mask): S = 14H^2 / 4H = 3.5 H."""
    return 14 * d_model ** 2 / (4 * d_model)


def is_flash(attention: str) -> bool:
    """cudnn, pallas and auto (which picks one of them on a GPU) run a flash kernel: an lse per row
    instead of the S x S softmax, and under save_dots_attn a kept forward (models/remat.py); xla
    materialises the softmax. The compute and memory accounts both read this."""
    return attention != "xla"


def step_flops(cfg, global_batch: int, seq: int, policy: str | None = None, flash: bool | None = None) -> dict:
    """Whole-step FLOPs (all devices), split by term, remat recompute included. flash: whether attention
    runs as a kernel with an lse (a flash kernel, or ring attention whatever `cfg.attention` says): its
    forward runs again under save_dots and is kept under save_dots_attn; default `is_flash(cfg.attention)`."""
    policy = policy or cfg.remat
    flash = is_flash(cfg.attention) if flash is None else flash
    per = layer_flops_per_token(cfg, seq)
    tokens = global_batch * seq
    sh2 = 3 * tokens * cfg.n_layers * (per["projections"] + per["mlp"]) + 3 * tokens * 2 * cfg.d_model * cfg.padded_vocab
    s2h = 3 * tokens * cfg.n_layers * per["attention"]
    attention_again = {"save_dots_no_batch": True, "save_dots": flash, "save_dots_attn": not flash, "none": False}
    if policy == "full":
        extra = tokens * cfg.n_layers * sum(per.values())
    elif policy in attention_again:
        extra = tokens * cfg.n_layers * per["attention"] if attention_again[policy] else 0.0
    else:
        raise ValueError(f"unknown remat policy {policy!r}; one of none, full, save_dots, save_dots_no_batch, "
                         "save_dots_attn")
    return {"S*H^2 (projections, MLP, head)": sh2, "S^2*H (attention)": s2h, "remat recompute": extra,
            "model": sh2 + s2h, "total": sh2 + s2h + extra}


def compute_time(cfg, global_batch: int, seq: int, devices: int, hw, policy: str | None = None,
                 pipeline_bubble: float = 0.0, flash: bool | None = None) -> float:
    """Seconds of matmul work per device at the hardware's stated efficiency (+ a pipeline bubble fraction)."""
    fl = step_flops(cfg, global_batch, seq, policy, flash)["total"]
    return fl / devices / (hw.flops * hw.efficiency) * (1 + pipeline_bubble)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """GPipe / 1F1B idle fraction (p-1)/m relative to the useful time."""
    return 0.0 if stages <= 1 else (stages - 1) / max(microbatches, 1)


def mfu(cfg, global_batch: int, seq: int, step_s: float, devices: int, peak: float) -> float:
    return step_flops(cfg, global_batch, seq, "none")["model"] / step_s / (devices * peak) if step_s > 0 else math.nan
