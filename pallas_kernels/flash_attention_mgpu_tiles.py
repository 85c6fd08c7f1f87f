"""Tiles of the Mosaic GPU FlashAttention (flash_attention_mgpu.py): the tuning dataclass, the
default per head dim, the shared-memory budgets that reject tiles before Mosaic does, and the rule
that picks the fused or split backward. Kept apart so the choices and their measurements read in
one place; every number quoted is in docs/benchmarks.md."""
from __future__ import annotations

import dataclasses
import os

_COMPUTE_WGS = 2   # compute warpgroups per CTA in every kernel (plus one producer)


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """Tiles of the Mosaic GPU kernels. `block_q` (fwd), `block_q_dq` (dQ) and `block_kv_dkv` (dK/dV)
    are the rows one CTA owns, split over 2 compute warpgroups, so they are multiples of 128; the
    streamed tiles (`block_kv`, `block_kv_dq`, `block_q_dkv`) are multiples of 64. `num_stages`:
    shared-memory ring depth of the streamed tiles. `pingpong`: the FA3 warpgroup ping-pong in
    the forward. Shared memory at d=128 bf16: fwd 32 KiB (Q) + 2*stages*block_kv*256 B (K, V).
    `fused_bwd`: one backward kernel (dQ by TMA reduce-add, flash_attention_mgpu_bwd._dqkv_call)
    instead of the dQ and dK/dV kernels; None chooses by `use_fused_bwd`."""
    block_q: int = 128
    block_kv: int = 128
    num_stages: int = 2
    pingpong: bool = True
    block_q_dq: int = 128
    block_kv_dq: int = 64
    block_kv_dkv: int = 128
    block_q_dkv: int = 64
    num_stages_bwd: int = 2
    fused_bwd: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_q_dq", "block_kv_dkv"):
            if getattr(self, name) % (64 * _COMPUTE_WGS):
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of {64 * _COMPUTE_WGS} "
                                 f"(64 rows per compute warpgroup)")
        for name in ("block_kv", "block_kv_dq", "block_q_dkv"):
            if getattr(self, name) % 64:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 64")
        if self.num_stages < 1 or self.num_stages_bwd < 1:
            raise ValueError("num_stages and num_stages_bwd must be >= 1")


def dq_split(block_q_dkv: int, head_dim: int) -> tuple[int, int]:
    """The [m, n] piece of a [block_q_dkv, head_dim] dQ tile that each compute warpgroup of the fused
    backward computes and reduce-adds: half the q rows when block_q_dkv >= 128 (a wgmma M-tile of 64
    or more each), else half the head dim (block_q_dkv = 64 leaves no row split; d must be 128)."""
    if block_q_dkv % 128 == 0:
        return block_q_dkv // _COMPUTE_WGS, head_dim
    if head_dim % 128 == 0:
        return block_q_dkv, head_dim // _COMPUTE_WGS
    raise ValueError(f"fused_bwd needs block_q_dkv a multiple of 128 or head_dim 128; got {block_q_dkv=}, "
                     f"{head_dim=} (set fused_bwd=False or block_q_dkv=128)")


def fused_bwd_smem_bytes(bs: "MgpuBlockSizes", head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of the fused backward: K, V resident; the Q/dO ring; dS^T double-buffered for
    both warpgroups; each warpgroup's fp32 dQ staging tile; lse/delta rows."""
    m, n = dq_split(bs.block_q_dkv, head_dim)
    bkv, bq, st = bs.block_kv_dkv, bs.block_q_dkv, bs.num_stages_bwd
    return (2 * bkv * head_dim + 2 * st * bq * head_dim + 2 * bkv * bq) * itemsize + _COMPUTE_WGS * m * n * 4 \
        + 2 * st * bq * 4


_SMEM_BYTES = 227 * 1024   # Hopper's opt-in maximum per block


def dq_smem_bytes(bs: "MgpuBlockSizes", head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of the dQ kernel: Q, dO and O rows (O for delta = rowsum(dO * O)), the K/V ring,
    lse and delta rows, each rounded up to Pallas' 1 KiB scratch alignment, plus 3 KiB for the
    barriers and what Pallas reserves (the lowering of 2x128/128/2x128 at d=128 asked 2.2 KiB more
    than the buffers). At d=128 a 128-row K/V tile over 2 stages leaves no room for O."""
    kib = lambda n: -(-n // 1024) * 1024   # noqa: E731
    ring = bs.num_stages_bwd * bs.block_kv_dq * head_dim * itemsize   # K or V
    tiles = 3 * kib(bs.block_q_dq * head_dim * itemsize) + 2 * kib(ring)
    return tiles + 2 * kib(bs.block_q_dq * 4) + 3 * 1024


def use_fused_bwd(bs: "MgpuBlockSizes", head_dim: int, seq_len: int, causal: bool) -> bool:
    """The backward kernel where `fused_bwd` is None. Measured on an H200 (jax 0.11.2, bf16, GQA 4 and
    1, backward alone, ms, fused vs split; docs/archive/benchmarks-diary.md): d=64 full attention
    3.17 vs 3.66 (S=4k), 6.22 vs 7.24 (8k), 1.65 vs 1.88 (2k); d=64 causal 3.48 vs 3.94 (8k, GQA 1),
    3.74 vs 3.91 (8k), 7.08 vs 7.69 (16k), but 2.10 vs 2.07 (4k) and 1.33 vs 1.17 (2k): short causal
    rows leave too few steps per CTA to pay for the fp32 dQ memset, reduce and convert. d=128
    (head-dim split of dQ, block_q_dkv=64) was slower at every shape tried (2.35 vs 1.76 at 4k causal).
    With the dK/dV kernel's spills fixed both got faster and tied at causal 4k, d=64 (fused 1.999-2.031
    vs split 1.993-2.032 ms); with FA3's 240/24 register split (_REGS_FUSED) the fused kernel leads
    there, 1.90-1.92 vs 1.98-2.05, so causal S >= 4096 takes it too. Causal 2k was
    1.33 vs 1.17: not re-measured, left on the split kernels."""
    if head_dim != 64 or (causal and seq_len < 4096) or bs.block_q_dkv % 128:
        return False
    return fused_bwd_smem_bytes(bs, head_dim) <= _SMEM_BYTES


def deterministic_requested() -> bool:
    """XLA's own switches for bitwise-repeatable GPU runs, read from XLA_FLAGS at trace time. With
    either on, `fused_bwd=None` takes the split kernels: the fused backward adds dQ pieces with TMA
    reduce-adds in no fixed order, so its dQ (and the run after it) varies in the last bits."""
    names = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name in names and value.lower() in ("", "true", "1"):
            return True
    return False


def default_block_sizes(head_dim: int) -> MgpuBlockSizes:
    """Tiles per head dim. d=64: dK/dV streams 128-row q tiles (half the K/V-resident kernel's
    loop trips; its smem is 64 KiB smaller at d=64 than at d=128, so 2 stages of 128 rows fit).
    H200, GQA 32/8, causal fwd+bwd ms, tiles run of 2026-12-01 (docs/benchmarks.md): S=2k 1.71 vs
    2.36, 4k 3.02 vs 3.11, 8k 5.50 vs 5.64 with the 64-row default. Both: the dQ kernel streams
    128-row K/V tiles (half the steps, each S/dP tile twice as wide): causal S=4096 GQA 4, dQ
    kernel alone 0.813-0.817 vs 0.918-0.929 ms at d=64, 0.640-0.651 vs 0.644-0.668 at d=128
    (docs/benchmarks.md#attention). At d=128 the 64-row tile is back: with the O tile for delta,
    128 rows do not fit (dq_smem_bytes), and they were within noise there."""
    if head_dim == 64:
        return MgpuBlockSizes(block_q_dkv=128, block_kv_dq=128)
    return MgpuBlockSizes()   # block_kv_dq=128 does not fit beside the dQ kernel's O tile (dq_smem_bytes)


def resolve_block_sizes(block_sizes: MgpuBlockSizes | None, head_dim: int, seq_len: int,
                        causal: bool) -> MgpuBlockSizes:
    """The tiles a call runs: the default for head_dim when None, `fused_bwd=None` decided (the
    split kernels when XLA is asked for determinism), then one clear error for tiles that do not
    fit in shared memory or do not divide seq_len, before Mosaic would fail on them."""
    bs = block_sizes or default_block_sizes(head_dim)
    if bs.fused_bwd is None:
        fused = use_fused_bwd(bs, head_dim, seq_len, causal) and not deterministic_requested()
        bs = dataclasses.replace(bs, fused_bwd=fused)
    if not bs.fused_bwd and (need := dq_smem_bytes(bs, head_dim)) > _SMEM_BYTES:
        raise ValueError(f"the dQ kernel with block_q_dq={bs.block_q_dq}, block_kv_dq={bs.block_kv_dq}, "
                         f"num_stages_bwd={bs.num_stages_bwd} at {head_dim=} needs {need} bytes of shared memory "
                         f"(> {_SMEM_BYTES}); use block_kv_dq=64 or num_stages_bwd=1")
    if bs.fused_bwd and (need := fused_bwd_smem_bytes(bs, head_dim)) > _SMEM_BYTES:
        raise ValueError(f"fused_bwd with block_kv_dkv={bs.block_kv_dkv}, block_q_dkv={bs.block_q_dkv}, "
                         f"num_stages_bwd={bs.num_stages_bwd} at {head_dim=} needs {need} bytes of shared memory "
                         f"(> {_SMEM_BYTES}); use smaller tiles (d=128: block_q_dkv=64) or fused_bwd=False")
    for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_kv_dkv", "block_q_dkv"):
        if seq_len % (blk := getattr(bs, name)):
            raise ValueError(f"seq_len={seq_len} must be a multiple of {name}={blk}")
    return bs
