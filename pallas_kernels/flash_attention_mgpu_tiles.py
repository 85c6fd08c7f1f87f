"""Tiles of the Mosaic GPU FlashAttention (flash_attention_mgpu.py), and the rules that pick them.

- `MgpuBlockSizes`: the tuning dataclass (rows per CTA, streamed tile rows, ring depths, ping-pong,
  fused or split backward); `default_block_sizes(head_dim)`: the measured defaults.
- `use_fused_bwd`: where `fused_bwd=None` takes the one-kernel backward (head_dim 64 only).
- `resolve_block_sizes`: the tiles a call runs, with one clear error, before Mosaic would fail, for
  tiles that do not fit in shared memory, do not divide seq_len, or ask for the fused backward at
  a head dim it does not take.
Pure Python (no jax import): the choices read in one place. The measurements behind each default:
docs/benchmarks.md#attention.
"""
from __future__ import annotations

import dataclasses
import os

COMPUTE_WGS = 2   # compute warpgroups per CTA in every kernel (plus one producer)


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    """Tiles of the Mosaic GPU kernels. `block_q` (fwd), `block_q_dq` (dQ) and `block_kv_dkv` (dK/dV)
    are the rows one CTA owns, split over 2 compute warpgroups, so they are multiples of 128; the
    streamed tiles (`block_kv`, `block_kv_dq`, `block_q_dkv`) are multiples of 64. `num_stages`:
    shared-memory ring depth of the streamed tiles. `pingpong`: the FA3 warpgroup ping-pong in
    the forward. Shared memory at d=128 bf16: fwd 32 KiB (Q) + 2*stages*block_kv*256 B (K, V).
    `fused_bwd`: one backward kernel (head_dim 64 only; dQ by TMA reduce-add, flash_attention_mgpu_bwd.dqkv_call)
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
            if getattr(self, name) % (64 * COMPUTE_WGS):
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of {64 * COMPUTE_WGS} "
                                 f"(64 rows per compute warpgroup)")
        for name in ("block_kv", "block_kv_dq", "block_q_dkv"):
            if getattr(self, name) % 64:
                raise ValueError(f"{name}={getattr(self, name)} must be a multiple of 64")
        if self.num_stages < 1 or self.num_stages_bwd < 1:
            raise ValueError("num_stages and num_stages_bwd must be >= 1")


def dq_split(block_q_dkv: int, head_dim: int) -> tuple[int, int]:
    """The [m, n] piece of a [block_q_dkv, head_dim] dQ tile that each compute warpgroup of the fused
    backward computes and reduce-adds: half the q rows (a wgmma M-tile of 64 or more each), all
    columns. block_q_dkv = 64 leaves no row split."""
    if block_q_dkv % 128 == 0:
        return block_q_dkv // COMPUTE_WGS, head_dim
    raise ValueError(f"fused_bwd needs block_q_dkv a multiple of 128; got {block_q_dkv=} "
                     f"(set fused_bwd=False or block_q_dkv=128)")


def fused_bwd_smem_bytes(bs: "MgpuBlockSizes", head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of the fused backward: K, V resident; the Q/dO ring; dS^T double-buffered for
    both warpgroups; each warpgroup's fp32 dQ staging tile; lse/delta rows."""
    m, n = dq_split(bs.block_q_dkv, head_dim)
    bkv, bq, st = bs.block_kv_dkv, bs.block_q_dkv, bs.num_stages_bwd
    return (2 * bkv * head_dim + 2 * st * bq * head_dim + 2 * bkv * bq) * itemsize + COMPUTE_WGS * m * n * 4 \
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
    """The backward kernel where `fused_bwd` is None: the fused one at head_dim 64 for full attention
    and causal seq_len >= 4096, where it measured faster than the split kernels (H200, backward alone;
    docs/benchmarks.md#attention). Short causal rows leave too few steps per CTA to pay for the fp32
    dQ memset, reduce-adds and convert, so causal seq_len < 4096 keeps the split kernels. At head_dim
    128 only a head-dim split of dQ fits in shared memory, which was slower at every shape measured
    and did not finish compiling at seq_len 8192: refused there (`check_fused_bwd`)."""
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
    """Tiles per head dim, each the faster of the variants measured (docs/benchmarks.md#attention).
    d=64: dK/dV streams 128-row q tiles (half the K/V-resident kernel's loop trips; its smem is
    64 KiB smaller at d=64 than at d=128, so 2 stages of 128 rows fit), and the dQ kernel streams
    128-row K/V tiles (half the steps, each S/dP tile twice as wide). d=128: 64-row dQ K/V tiles,
    since beside the O tile for delta 128 rows do not fit (dq_smem_bytes), and split backward."""
    if head_dim == 64:
        return MgpuBlockSizes(block_q_dkv=128, block_kv_dq=128)
    return MgpuBlockSizes()   # block_kv_dq=128 does not fit beside the dQ kernel's O tile (dq_smem_bytes)


FUSED_BWD_HEAD_DIMS = (64,)


def check_fused_bwd(bs: MgpuBlockSizes, head_dim: int) -> None:
    """One clear error for `fused_bwd=True` at a head dim the fused backward does not take. At 128
    only its head-dim split of dQ fits in shared memory: slower than the split kernels at every shape
    measured, and its compile at causal seq_len 8192 did not finish in 200 s (LLVM), so it is refused
    instead of reached."""
    if bs.fused_bwd and head_dim not in FUSED_BWD_HEAD_DIMS:
        raise ValueError(f"fused_bwd=True takes head_dim {' or '.join(map(str, FUSED_BWD_HEAD_DIMS))}, got "
                         f"{head_dim=}; use fused_bwd=None (the default: at head_dim {head_dim} the split dQ and "
                         "dK/dV kernels) or fused_bwd=False")


def resolve_block_sizes(block_sizes: MgpuBlockSizes | None, head_dim: int, seq_len: int,
                        causal: bool) -> MgpuBlockSizes:
    """The tiles a call runs: the default for head_dim when None, `fused_bwd=None` decided (the
    split kernels when XLA is asked for determinism), then one clear error, before Mosaic would fail
    or stall on them, for the fused backward at a head dim it does not take and for tiles that do
    not fit in shared memory or do not divide seq_len."""
    bs = block_sizes or default_block_sizes(head_dim)
    check_fused_bwd(bs, head_dim)
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
                         f"(> {_SMEM_BYTES}); use smaller tiles or fused_bwd=False")
    for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_kv_dkv", "block_q_dkv"):
        if seq_len % (blk := getattr(bs, name)):
            raise ValueError(f"seq_len={seq_len} must be a multiple of {name}={blk}")
    return bs
