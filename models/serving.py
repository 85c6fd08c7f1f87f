"""The serving forward: a decoder's new tokens over a KV cache (prompt chunks and decode tokens).

Training (models/llama.py, models/moe.py) runs whole sequences; serving runs only this step's
tokens [b, t] and threads a KV cache through the layers. The cache's layout, contiguous or paged,
belongs to meshlab/infer/kv_cache.py, which hands `forward` an `Attend`: the model projects each
layer's q/k/v, the `Attend` writes k/v into the cache and attends over it. No remat (no backward)
and no FP8 training recipe: GEMMs run in the compute dtype, except over weights that serving
stores in fp8 (below).

Per-layer weights come in three forms (meshlab/infer/programs.py, serving_params): stacked (a
layer scan), a list of per-layer dicts (a Python loop, so no weight slice is copied before its
GEMM), or pairs (params, fused) with wq|wk|wv and w_gate|w_up concatenated once at load. Fused
layers at a decode token take the one-kernel attention when the `Attend` offers it, and with
kernels=True run each layer as five Pallas launches (`decode_step`); those [n, k] matrices may be
stored fp8 with a scale per output row (serving_params(quantize="fp8")), half a decode token's bytes;
steps of many tokens multiply them in FP8 GEMMs with per-token activation scales (`fp8_gemm`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from meshlab.rules import constrain
from models.llama import F32, _interpret, _mm, _w, apply_rope, rope_scaling
from models.moe import route
from pallas_kernels import decode_gemv as decode_kernels, expert_gemv as expert_kernels, rope as rope_kernels
from pallas_kernels.grouped_matmul import grouped_matmul_nk
from pallas_kernels.swiglu import silu_mul

ACT = ("act_batch", "act_seq", "act_embed")
# The most decode rows a step runs through decode_step's kernels (at most decode_kernels.MAX_ROWS);
# more go through nk_step's XLA GEMMs. One: at 2-4 rows the kernels' vector-unit sums cost more
# than XLA's GEMMs read (H200, llama3_1b, ctx 2k, through Engine: batch 2 / 4 at 1,169 / 2,288
# tokens/s through the kernels against 1,962 / 3,728 through XLA; batch 1 level). Module-level,
# read when a step traces: a benchmark swaps it (bench_decode.py --jobs rows_ab).
KERNEL_ROWS = 1
# The most decode rows of a mixture of experts whose experts run through the expert kernels
# (pallas_kernels/expert_gemv.py: a program per (token, choice) pair and column block, a padding
# row's pairs reading nothing); past one row the attention's projections stay XLA's GEMMs
# (KERNEL_ROWS), and past these rows the dropless dispatch's grouped GEMM takes the experts. Four,
# the engine's decode bucket after one (H100, moe_1b_8e, ctx 2k, through Engine: batch 2 / 4 at
# 1,142 / 1,742 tokens/s against 742 / 1,339 through the grouped GEMM; at 8 / 16 rows the kernels'
# one row a program loses, 2,000 / 3,186 against 2,252 / 4,060). Module-level, read when a step
# traces (bench_decode.py --jobs expert_rows_ab swaps it).
EXPERT_KERNEL_ROWS = 4
# fp8 matrices (serving_params(quantize="fp8")) meet steps of at least this many tokens (prompt chunks,
# large decode batches) in FP8 GEMMs, W8A8: each token's activations scaled to e4m3 (its amax to 448,
# as the weights' rows are), one cuBLASLt FP8 GEMM at twice bf16's tensor-core rate, both scales on
# its output. Fewer rows are byte-bound: the matrices widened to the compute dtype (W8A16), which XLA
# fuses into its small-row GEMMs, and no launch quantizes the activations. H100, llama3_1b, ctx 2k:
# decode at batch 128 ran 3% slower in FP8 GEMMs (26,913 against 27,757 tokens/s), at 256 10%
# faster (28,078 against 25,632); a 2k prompt's chunks of 512, TTFT 10.7 ms against 13.0. Module-level,
# read when a step traces (fp8_gemm_rows swaps it; bench_decode.py --jobs fp8).
FP8_GEMM_ROWS = 256


@contextlib.contextmanager
def fp8_gemm_rows(rows: int | None):
    """FP8_GEMM_ROWS set to `rows` (None: unchanged) inside the block: build and use an engine there
    (its steps read it when they trace). Benchmarks and evaluations compare W8A8 with W8A16 so."""
    global FP8_GEMM_ROWS
    kept = FP8_GEMM_ROWS
    FP8_GEMM_ROWS = kept if rows is None else rows
    try:
        yield
    finally:
        FP8_GEMM_ROWS = kept


@dataclasses.dataclass(frozen=True)
class Attend:
    """How this step's attention reaches the KV cache (built by meshlab/infer/kv_cache.py).

    attend(layer, q [b, t, h, hd], k, v [b, t, kvh, hd], cache) -> (o [b, t, h, hd], cache): writes
      `layer`'s new k/v into the cache and attends q over everything cached for its sequence.
    fused(layer, qkv [b, t, h + 2 kvh, hd] before RoPE, inv_freq, cache) -> (o, cache), or None: RoPE,
      the cache write and attention in one kernel, offered for decode tokens only; a layer uses it
      when its q|k|v weights are concatenated. It passes a zero padding row through as zeros.
    live: [b] bool or None: the rows whose first token this step is real (a decode bucket's padding
      rows, and rows past their last position, are not); the expert kernels read nothing for the others.
    """
    attend: Callable
    fused: Optional[Callable] = None
    live: Optional[jax.Array] = None

    def __call__(self, layer, q, k, v, cache):
        return self.attend(layer, q, k, v, cache)


# -- the one-token GEMM ------------------------------------------------------------------------
def _mm_decode(spec, x, w, scale=None):
    """_mm for x [b, t, ...]. At one token (b*t == 1) XLA:GPU drops the unit dims, sees a vector x
    matrix dot, and below ~10M elements rewrites it into a multiply + reduce (its algebraic
    simplifier's dot strength reduction): for wo that writes and re-reads a weight-sized product,
    several times the GEMM's time in the H200 decode profile. A second, zero row keeps it a GEMM;
    the weights are read once either way. scale: w is fp8 with this per-row scale (its dims end the
    output's): below FP8_GEMM_ROWS rows the GEMM on w widened to x's dtype (exact), its fp32 output
    times the scale, rounded once, as decode_gemv's fp8 form does; from there `fp8_gemm`."""
    rows = x.shape[0] * x.shape[1]
    narrow = rows == 1
    xin = _zero_row(x) if narrow else x
    if scale is None:
        y = _mm(spec, xin, w)
    elif rows >= FP8_GEMM_ROWS:
        y = fp8_gemm(spec, xin, w, scale)
    else:
        y = (jnp.einsum(spec, xin, w.astype(x.dtype), preferred_element_type=F32) * scale).astype(x.dtype)
    return y[:, :1] if narrow else y                                       # [b, t, ...]


def fp8_gemm(spec, x, w, w_scale):
    """einsum(spec, x [b, t, k], w) for fp8 w with its per-row w_scale, in one FP8 GEMM (W8A8): x's
    tokens quantized to e4m3 with a scale each (decode_gemv.quantize_rows over k), the dot of the two
    fp8 operands accumulated in fp32 (HIGHEST: no fast accumulation over k = 8,192) and written in x's
    dtype (half an fp32 output's bytes), then times both scales (an elementwise pass over the output)
    and rounded again. Both operands are k-major, the layout cuBLASLt's FP8 GEMM reads (the H100's
    compiled HLO: one `__cublas$lt$matmul$f8` per projection)."""
    xq, x_scale = decode_kernels.quantize_rows(x)                                      # [b, t, k] e4m3, [b, t]
    y = jnp.einsum(spec, xq, w, preferred_element_type=x.dtype, precision=jax.lax.Precision.HIGHEST)  # [b, t, ...]
    x_scale = x_scale.reshape(x_scale.shape + (1,) * (y.ndim - 2))                     # [b, t, 1, ...]
    return (y.astype(F32) * x_scale * w_scale).astype(x.dtype)


def _zero_row(x):
    """x [1, 1, ...] -> [1, 2, ...] with a zero second row (_mm_decode's, carried further at decode)."""
    return jnp.concatenate([x, jnp.zeros_like(x)], axis=1)


# -- one layer -----------------------------------------------------------------------------------
def _fused_attend(attend: Attend, cfg, layer, qkv, cache):
    """attend.fused over qkv [b, t, h + 2 kvh, hd] before RoPE, with the model's RoPE frequencies."""
    inv_freq = rope_kernels.rope_frequencies(cfg.head_dim, cfg.rope_theta, rope_scaling(cfg))
    return attend.fused(layer, qkv, inv_freq, cache)


def attention(attn, x, positions, attend: Attend, layer, cache, wqkv=None):
    """models.llama.Attention's weights over this step's tokens x [b, t, d] -> ([b, t, d], cache).
    wqkv [d, h + 2 kvh, hd]: wq|wk|wv concatenated at load (serving layers="fused"): one GEMM launch
    and one pass over x instead of three small ones; then attn.wq/wk/wv are not read."""
    cfg, dt = attn.cfg, jnp.dtype(attn.cfg.dtype)
    b, t = x.shape[:2]
    if wqkv is not None and attend.fused is not None:          # RoPE + cache write + attention: one kernel
        # One token: _mm_decode's zero second row is added here once and rides through the kernel
        # (which returns it as a zero row of o) into the wo GEMM: no slice before the kernel, no
        # pad after its split merge (two XLA launches per layer at batch 1).
        xin = _zero_row(x) if b * t == 1 else x                                              # [b, t', d]
        qkv = _mm("bsd,dhk->bshk", xin, wqkv)                                                # [b, t', h + 2 kvh, hd]
        o, cache = _fused_attend(attend, cfg, layer, qkv, cache)                            # [b, t', h, hd]
        out = _mm("bshk,hkd->bsd", o, _w(attn.wo, dt))[:, :t]                               # [b, t, d]
    else:
        if wqkv is None:
            q = _mm_decode("bsd,dhk->bshk", x, _w(attn.wq, dt))   # [b, t, h, hd]
            k = _mm_decode("bsd,dhk->bshk", x, _w(attn.wk, dt))   # [b, t, kvh, hd]
            v = _mm_decode("bsd,dhk->bshk", x, _w(attn.wv, dt))   # [b, t, kvh, hd]
        else:
            qkv = _mm_decode("bsd,dhk->bshk", x, wqkv)            # [b, t, h + 2 kvh, hd]
            q, k, v = jnp.split(qkv, [cfg.n_heads, cfg.n_heads + cfg.n_kv_heads], axis=2)
        q, k = apply_rope(cfg, q, k, positions)
        o, cache = attend(layer, q, k, v, cache)                                                  # [b, t, h, hd]
        out = _mm_decode("bshk,hkd->bsd", o, _w(attn.wo, dt))                                     # [b, t, d]
    return constrain(out, ACT), cache


def feed_forward(block, x, fused=None):
    """Normed x [b, t, d] -> [b, t, d]: a mixture of experts' `moe` (models/moe.py; its router terms
    are training's), else the SwiGLU MLP, its gate and up from one GEMM over fused["w_gate_up"]
    [d, 2f] when the layer's weights are concatenated, then the MLP's own fp32 SiLU * up and down."""
    if hasattr(block, "moe"):
        return block.moe(x)[0]
    if fused is None:
        return block.mlp(x)
    gate, up = jnp.split(_mm("bsd,df->bsf", x, fused["w_gate_up"]), 2, axis=-1)   # [b, t, f] x2
    return block.mlp.down((jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(gate.dtype))


def block_step(block, x, positions, attend: Attend, layer, cache, fused=None, kernels=False):
    """One decoder block (Llama's or a mixture of experts') over x [b, t, d] -> ([b, t, d], cache).
    fused: {"wqkv", "w_gate_up"} concatenated at load (a mixture of experts: "wqkv" only), or
    {"decode": the layer's matrices stored [n, k]} (serving layers="kernels"): then a decode token
    (t == 1, at most KERNEL_ROWS rows, a mixture of experts' one row, kernels=True, the one-kernel
    attention offered) goes through `decode_step`, anything else through `nk_step` (a mixture of
    experts' decode rows up to EXPERT_KERNEL_ROWS with its experts through the expert kernels)."""
    b, t, _ = x.shape
    if fused is not None and "decode" in fused:
        moe = hasattr(block, "moe")
        if kernels and t == 1 and b <= (1 if moe else KERNEL_ROWS) and attend.fused is not None:
            return decode_step(block, x, attend, layer, cache, fused)
        rows = moe and kernels and t == 1 and b <= EXPERT_KERNEL_ROWS
        return nk_step(block, x, positions, attend, layer, cache, fused["decode"], expert_rows=rows)
    h, cache = attention(block.attn, block.attn_norm(x), positions, attend, layer, cache,
                         wqkv=None if fused is None else fused.get("wqkv"))
    x = constrain(x + h, ACT)
    x = x + feed_forward(block, block.mlp_norm(x), fused)
    return constrain(x, ACT), cache


def _mm_nk(spec, x, w, name):
    """_mm_decode over the [n, k] matrix w[name], fp8 when w holds its scale as name + "_scale"."""
    return _mm_decode(spec, x, w[name], w.get(name + "_scale"))


def nk_step(block, x, positions, attend: Attend, layer, cache, w, expert_rows: bool = False):
    """`block_step`'s math over w = the layer's matrices stored [n, k] (serving layers="kernels"):
    prompt chunks and decode batches past decode_step's rows, as XLA GEMMs on the transposed
    operands (cuBLAS and Triton read either layout at the same rate); decode rows take the
    one-kernel attention when the `Attend` offers it, as fused layers do. fp8 matrices (`_mm_nk`)
    go through FP8 GEMMs from FP8_GEMM_ROWS tokens (prompt chunks), widened below (byte-bound rows).
    expert_rows: a mixture of experts' decode rows, its experts through `experts_decode`."""
    cfg = block.attn.cfg
    b, t, _ = x.shape
    h = block.attn_norm(x)
    qkv = _mm_nk("bsd,nd->bsn", h, w, "wqkv_t").reshape(b, t, -1, cfg.head_dim)            # [b, t, h + 2 kvh, hd]
    if attend.fused is not None:           # decode rows past decode_step's: RoPE + cache write + attention in one kernel
        o, cache = _fused_attend(attend, cfg, layer, qkv, cache)                            # [b, t, h, hd]
    else:
        q, k, v = jnp.split(qkv, [cfg.n_heads, cfg.n_heads + cfg.n_kv_heads], axis=2)
        q, k = apply_rope(cfg, q, k, positions)
        o, cache = attend(layer, q, k, v, cache)                                             # [b, t, h, hd]
    x = constrain(x + _mm_nk("bsn,dn->bsd", o.reshape(b, t, -1), w, "wo_t"), ACT)           # [b, t, d]
    if expert_rows:
        return experts_decode(block, x.reshape(b, -1), w, live=attend.live).reshape(b, 1, -1), cache   # [b, 1, d]
    ffn = experts_ffn if hasattr(block, "moe") else _mlp_nk
    return constrain(x + ffn(block, block.mlp_norm(x), w), ACT), cache


def _mlp_nk(block, x, w, prefix: str = ""):
    """A SwiGLU MLP over normed x [b, t, d] from its [n, k] matrices w[prefix + "w_gate_up_t" / "w_down_t"]:
    one GEMM for gate|up, the model's fp32 SiLU * up, then down."""
    dt = x.dtype
    gu = _mm_nk("bsd,gfd->bsgf", x, w, prefix + "w_gate_up_t")                                 # [b, t, 2, f]
    act = (jax.nn.silu(gu[:, :, 0].astype(F32)) * gu[:, :, 1].astype(F32)).astype(dt)        # [b, t, f]
    return _mm_nk("bsf,df->bsd", act, w, prefix + "w_down_t")                                # [b, t, d]


def experts_ffn(block, x, w):
    """A mixture of experts' feed-forward over normed x [b, t, d] from its [n, k] matrices w
    (programs._experts_nk) for steps past one decode token (prompt chunks, decode batches): the
    model's dropless dispatch on one device, whatever a rule file's `experts.dispatch` (serving drops
    no assignment, as the one-token kernels drop none: sorted by expert, grouped GEMMs, restored,
    weighted and summed: meshlab/parallel/experts.py), its grouped GEMMs reading those
    transposed (grouped_matmul_nk), so the layer holds its experts once."""
    moe = block.moe
    cfg, dt, (b, t, d) = moe.cfg, x.dtype, x.shape
    n_experts, k, f = cfg.n_experts, cfg.top_k, w["experts_down_t"].shape[-1]
    _, _, top_w, top_i = route(cfg, x, _w(moe.router, F32))                                # [b, t, K] each
    e = top_i.reshape(-1)                                                                  # [A = b t K]
    order = jnp.argsort(e, stable=True)                                                    # by expert
    xs = x.reshape(b * t, d)[order // k]                                                   # [A, d] sorted
    gmm = functools.partial(grouped_matmul_nk, group_sizes=jnp.bincount(e, length=n_experts), backend=cfg.gemm,
                            interpret=_interpret())
    gu = gmm(xs, w["experts_gate_up_t"].reshape(n_experts, 2 * f, d))                      # [A, 2f]: gate | up
    y = gmm(silu_mul(gu[:, :f], gu[:, f:]), w["experts_down_t"])                           # [A, d]
    y = jnp.zeros_like(y).at[order].set(y).reshape(b, t, k, d)                            # assignment order
    y = jnp.sum(y.astype(F32) * top_w[..., None], axis=2).astype(dt)                      # [b, t, d]
    return y + _mlp_nk(block, x, w, "shared_") if "shared_w_down_t" in w else y


def decode_step(block, x, attend: Attend, layer, cache, fused):
    """One decode token per row x [b, 1, d] in five launches: [norm + q|k|v], [RoPE + cache write +
    attention], [wo + residual], [norm + gate|up + SwiGLU], [down + residual], over the layer's
    [n, k] copies fused["decode"] (meshlab/infer/programs.py); the same math and roundings as
    `block_step` (pallas_kernels/decode_gemv.py says why: at batch 1 a layer's XLA GEMMs and the
    small kernels between them are mostly latency). A mixture of experts (one row) replaces the last
    two with `experts_decode`."""
    cfg, w = block.attn.cfg, fused["decode"]
    b, _, d = x.shape
    mv = functools.partial(decode_kernels.decode_gemv, eps=cfg.norm_eps, interpret=_interpret())
    x = x.reshape(b, d)                                                                   # [b, d]
    sc = lambda name: {"w_scale": w[name + "_scale"]} if name + "_scale" in w else {}   # noqa: E731 - fp8 matrices
    qkv = mv(x, w["wqkv_t"], norm_scale=_stored(block.attn_norm.scale), **sc("wqkv_t"))    # [b, (h + 2 kvh) hd]
    o, cache = _fused_attend(attend, cfg, layer, qkv.reshape(b, 1, -1, cfg.head_dim), cache)   # [b, 1, h, hd]
    x = mv(o.reshape(b, -1), w["wo_t"], residual=x, **sc("wo_t"))                         # [b, h hd] . [d, h hd]^T -> [b, d]
    if hasattr(block, "moe"):
        return experts_decode(block, x, w, mv=mv).reshape(b, 1, d), cache
    h = mv(x, w["w_gate_up_t"], norm_scale=_stored(block.mlp_norm.scale), swiglu=True, **sc("w_gate_up_t"))   # [b, f]
    x = mv(h, w["w_down_t"], residual=x, **sc("w_down_t"))                                # [b, d]
    return x.reshape(b, 1, d), cache                                                      # [b, 1, d]


def _stored(var):
    """A parameter as stored (a kernel widens it after its load: no convert launch before the call)."""
    return _w(var, var[...].dtype)


def experts_decode(block, x, w, live=None, mv=None):
    """A mixture of experts' feed-forward and residual for decode tokens x [b, d] over its [n, k] matrices
    w (programs._experts_nk): the norm, the router and its top k in one launch (expert_gemv.route_rows;
    in XLA where d or k is not a power of two: about seven small launches), then gate|up + SwiGLU of
    each token's K chosen experts in one launch and their down projections, weighted and summed with
    the residual, in another (pallas_kernels/expert_gemv.py). live [b] (Attend.live): rows not live
    route nowhere and read no expert. A shared expert: decode_gemv's two launches (mv, one row) or
    XLA's GEMMs. The model's math and roundings (models/moe.py MoeFFN)."""
    moe, d = block.moe, x.shape[-1]
    cfg = moe.cfg
    if d & (d - 1) or cfg.top_k & (cfg.top_k - 1):        # route_rows' limits: the norm and router in XLA
        normed = block.mlp_norm(x[:, None])                                               # [b, 1, d]
        _, _, top_w, top_i = route(cfg, normed, _w(moe.router, F32))                      # [b, 1, K] each
        experts, combine, normed = top_i[:, 0], top_w[:, 0], normed[:, 0]
        if live is not None:
            experts, combine = jnp.where(live[:, None], experts, -1), jnp.where(live[:, None], combine, 0.0)
    else:                                                 # the norm, the router and its top k: one launch
        normed, experts, combine = expert_kernels.route_rows(
            x, _stored(block.mlp_norm.scale), _stored(moe.router), top_k=cfg.top_k, live=live, eps=block.mlp_norm.eps,
            score=cfg.router_score, norm_topk=cfg.norm_topk, interpret=_interpret())      # [b, d], [b, K], [b, K]
    gemv = functools.partial(expert_kernels.expert_gemv, experts=experts, masked=live is not None,
                             interpret=_interpret())
    h = gemv(normed, w["experts_gate_up_t"], swiglu=True)                                  # [b K, f]
    if "shared_w_gate_up_t" not in w:
        return gemv(h, w["experts_down_t"], combine=combine, residual=x)                  # [b, d]
    y = gemv(h, w["experts_down_t"], combine=combine)                                     # [b, d] the routed sums
    if mv is None:                                                                        # XLA's GEMMs
        return x + (y + _mlp_nk(block, normed[:, None], w, "shared_")[:, 0])
    hs = mv(normed, w["shared_w_gate_up_t"], swiglu=True)                                 # [1, f_shared]
    return x + mv(hs, w["shared_w_down_t"], residual=y)                                   # x + (routed + shared)


# -- the model -----------------------------------------------------------------------------------
def forward(model, tokens, positions, cache, attend: Attend, unroll: bool = False, layers=None,
            kernels: bool = False):
    """This step's tokens over a KV cache -> (final-normed hidden [b, t, d], cache).

    model: a models.llama.Llama (or a subclass: models/moe.py's MoeLM). tokens/positions [b, t];
    `cache` is any pytree (meshlab/infer owns its layout) carried through the layers, so each layer
    updates only its new tokens in place. unroll=True unrolls the layer scan: static per-layer
    weight slices instead of dynamic ones. layers: the per-layer params as a list of pure dicts,
    each its own buffers (meshlab/infer/programs.py splits them once at load); the layers then run
    as a Python loop with no slicing at all, and `model.layers` gives only the block structure.
    Why: XLA copies a slice of a stacked weight, static or dynamic, into a temporary before the GEMM
    reads it (CPU- and H200-compiled HLO), which triples the weight bytes of a bandwidth-bound
    decode step. An entry may be a pair (params, fused) with concatenated projection weights
    (`block_step`). kernels: decode tokens of those fused layers run through Pallas kernels only.
    """
    dt = jnp.dtype(model.cfg.dtype)
    x = constrain(jnp.take(_w(model.embed, dt), tokens, axis=0), ACT)                    # [b, t, d]
    block_def, block_state = nnx.split(model.layers)
    # One token through fused layers and the one-kernel attention (which passes padding rows
    # through as zeros): the residual stream carries _mm_decode's zero second row from here to
    # the head, so no layer pads or slices for its one-token GEMMs (each a launch at batch 1).
    # A zero row stays zero through RMSNorm, the GEMMs, attention's output, SwiGLU and the adds.
    two_rows = (tokens.shape == (1, 1) and layers is not None and not kernels
                and attend.fused is not None and isinstance(layers[0], tuple))
    if two_rows:
        x = _zero_row(x)                                                                 # [1, 2, d]
    if layers is not None:
        for i, one_layer in enumerate(layers):          # i static: cache writes at a constant layer index
            one_layer, fused = one_layer if isinstance(one_layer, tuple) else (one_layer, None)
            block = nnx.merge(block_def, one_layer)
            x, cache = block_step(block, x, positions, attend, i, cache, fused=fused, kernels=kernels)
        return model.final_norm(x[:, :1] if two_rows else x), cache                     # [b, t, d]

    def layer(carry, xs):
        (x, cache), (one_layer, i) = carry, xs
        block = nnx.merge(block_def, one_layer)
        return block_step(block, x, positions, attend, i, cache), None

    (x, cache), _ = jax.lax.scan(layer, (x, cache), (block_state, jnp.arange(model.cfg.n_layers)), unroll=unroll)
    return model.final_norm(x), cache
