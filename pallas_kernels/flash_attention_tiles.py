"""Tiles and shared kernel pieces of the Triton-lowered FlashAttention (flash_attention.py forward,
flash_attention_bwd.py backward).

- `BlockSizes`: the tuning dataclass (tile rows, warps, pipeline stages per kernel).
- `FlashConfig`: everything static one call needs (scale, causal offset, padded lengths, GQA group).
- The loop bounds that skip causal tiles (`kv_bounds` for a query tile, `q_bounds` for a kv tile),
  the visibility mask of the tiles that need one, the fp32-accumulating 2-D matmul.
Rows are padded up to tile multiples by the wrapper; masks cover the padding, the causal
diagonal and segment ids. No kernel here: both kernel files import these, neither imports the other's
privates. Speed of the tile choices: docs/benchmarks.md#attention.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels.compat import TritonCompilerParams


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch settings. Powers of two >= 16; larger tiles cut K/V re-reads
    but cost registers (the fp32 accumulators live there) and shared memory (num_stages copies).
    Defaults are the variant measured fastest on the H200 (docs/benchmarks.md#attention): at d=128,
    64x64 tiles with 4 warps beat 128-row tiles with 8 warps in fwd+bwd."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    block_q_dq: int = 64
    block_k_dq: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    num_warps_bwd: int = 4
    num_stages_bwd: int = 3

    @classmethod
    def default(cls, head_dim: int) -> "BlockSizes":
        if head_dim <= 64:  # small rows: a 128-row query tile still fits 4 warps' registers
            return cls(block_q=128)
        if head_dim <= 128:
            return cls()
        # d=256: fp32 accumulators of 64 rows would spill; halve the kv tiles
        return cls(block_k=32, num_stages=2, block_k_dq=32, block_q_dkv=32, block_k_dkv=32, num_stages_bwd=2)


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Everything static a kernel needs; hashable so it can be a custom_vjp nondiff arg."""
    sm_scale: float
    offset: int | None          # causal: row i sees cols j <= i + offset; None = no causal mask
    q_len: int
    kv_len: int
    q_pad: int
    kv_pad: int
    groups: int                 # q heads per kv head
    has_seg: bool
    blocks: BlockSizes
    interpret: bool


def dot(a, b, trans_a=False, trans_b=False):
    """2-D matmul with fp32 accumulation; transposes are folded into the contraction so the
    Triton lowering picks the operand layout instead of materialising a transpose."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def compiler_params(num_warps, num_stages):
    return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def is_pow2(x):
    return x >= 16 and (x & (x - 1)) == 0


def round_up(x, m):
    return (x + m - 1) // m * m


def fit(block, length):
    """Never use a tile longer than the (power-of-two rounded) sequence: short inputs pad less."""
    return min(block, max(16, 1 << (max(length, 1) - 1).bit_length()))


def visible_mask(cfg: FlashConfig, rows, cols, q_seg, kv_seg):
    """Boolean [rows, cols] visibility; built only in blocks that need it (the masked loop)."""
    mask = None
    if cfg.offset is not None:
        mask = rows[:, None] + cfg.offset >= cols[None, :]
    if cfg.kv_pad != cfg.kv_len:
        pad = jnp.broadcast_to(cols[None, :] < cfg.kv_len, (rows.shape[0], cols.shape[0]))
        mask = pad if mask is None else mask & pad
    if cfg.has_seg:
        seg = q_seg[:, None] == kv_seg[None, :]
        mask = seg if mask is None else mask & seg
    return mask


def kv_bounds(cfg: FlashConfig, q_start, block_q, block_k):
    """For a query tile: kv tiles [0, n_full) need no mask, [n_full, hi) need one, the rest are
    skipped entirely (causal) -- the skipped tiles are where the causal 2x comes from."""
    nk = cfg.kv_pad // block_k
    n_full_static = 0 if cfg.has_seg else cfg.kv_len // block_k
    if cfg.offset is None:
        return n_full_static, nk
    last = jnp.maximum(q_start + block_q + cfg.offset, 0)          # one past the last visible col
    hi = jnp.minimum(lax.div(last + block_k - 1, jnp.int32(block_k)), nk)
    full = lax.div(jnp.maximum(q_start + 1 + cfg.offset, 0), jnp.int32(block_k))
    n_full = jnp.minimum(jnp.minimum(full, hi), n_full_static)
    return n_full, hi


def q_bounds(cfg: FlashConfig, k_start, block_q, block_k):
    """For a kv tile: q tiles [lo, mid) need a mask, [mid, nq) need none, [0, lo) see none of it."""
    nq = cfg.q_pad // block_q
    if cfg.offset is None:
        return 0, (nq if cfg.has_seg else 0), nq
    lo = lax.div(jnp.maximum(k_start - cfg.offset, 0), jnp.int32(block_q))
    lo = jnp.minimum(lo, nq)
    mid = lax.div(jnp.maximum(k_start + block_k - 1 - cfg.offset, 0) + block_q - 1, jnp.int32(block_q))
    mid = jnp.clip(mid, lo, nq)
    if cfg.has_seg:
        mid = jnp.int32(nq) + 0 * mid
    return lo, mid, nq


def tile_loop(lo, hi, body, carry):
    """fori_loop that vanishes when both bounds are static and the range is empty (e.g. the masked
    loop of a full, block-aligned problem), so no dead loop reaches the Triton compiler."""
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)
