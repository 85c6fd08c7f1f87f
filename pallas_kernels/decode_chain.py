"""A decode layer's matrix-vector products after attention in one launch (Pallas Triton).

    decode_mlp_chain(o, x, wo, s_mlp, w_gate_up, w_down, sync)   -> (x2, None, sync)
        x1 = x + o @ wo.T                                      [wo + residual]
        h  = SwiGLU(RMSNorm(x1) * s_mlp @ w_gate_up.T)         [norm + gate|up + SwiGLU]
        x2 = x1 + h @ w_down.T                                 [down + residual]
    next_qkv=(wqkv, s_attn) adds the next layer's first launch:
        qkv = RMSNorm(x2) * s_attn @ wqkv.T                    -> (x2, qkv, sync)

Weights are stored [n, k] (w_gate_up [2, f, k]) as pallas_kernels/decode_gemv.py takes them, and
each phase runs that kernel's programs (`gemv_program`) with its own tiles.

Why: at batch 1 a decode layer is six short launches (12.6 MB q|k|v, 8.4 MB wo: 2-4 us each on
an H200), and each pays a ramp (its programs start, their first loads are a memory latency away)
and a tail (the last programs finish while most SMs idle). Here the phases are ranges of one grid,
in program-id order, and a program of phase i + 1 issues its first weight loads and only then
waits for phase i: its weights stream in during phase i's tail instead of after it.

Hand-off between phases: phase i's programs each store their outputs, synchronise their threads
and add 1 to counter sync[i] (a GPU-scope acquire-release atomic); phase i + 1's programs spin
on sync[i] until all of phase i has counted, then read its outputs past L1 (volatile loads: an
SM's L1 is not coherent with the others'). No program waits for a later one, and a GPU starts a
1-D grid's programs in increasing id order, so every program a waiting one depends on has already
started: the spin cannot deadlock however many programs are resident. Each waiting program then
adds 1 more, and the last of them puts the counter back to 0, so a launch leaves `sync` all zeros
(sync is aliased in place; create it zeroed once with `sync_counters` and pass it on).
In interpret mode the programs run one after another, each phase's before the next's: the waits
return at once, the counting and the reset run as on the GPU.
Limits: decode_gemv's (at most MAX_ROWS rows, tiles dividing each matrix); every phase runs on
the launch's one `num_warps`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.compat import TritonCompilerParams as _CompilerParams
from pallas_kernels.decode_gemv import MAX_ROWS, BlockSizes, gemv_program, program_tiles

PHASES = ("wo", "gate_up", "down", "qkv")


@dataclasses.dataclass(frozen=True)
class ChainTiles:
    """Each phase's decode_gemv tiles (their num_warps and num_stages are not used: the launch's are)."""
    wo: BlockSizes = BlockSizes(block_n=2)
    gate_up: BlockSizes = BlockSizes(block_n=2, tiles_per_program=4, prefetch=1)
    down: BlockSizes = BlockSizes(block_n=2, block_k=8192, prefetch=1)
    qkv: BlockSizes = BlockSizes(block_n=4)
    num_warps: int = 2
    # How a waiting program watches its counter: "load" (volatile loads, then one atomic that
    # acquires), or "atomic" (every poll an atomic read: thousands of programs polling one address
    # queue at its L2 slice, the producers' adds behind them).
    poll: str = "load"
    # How a phase reads the one before's outputs past L1: "volatile" loads or ".cg" (cache global).
    handoff: str = "volatile"

    def __post_init__(self):
        if self.poll not in ("load", "atomic") or self.handoff not in ("volatile", ".cg"):
            raise ValueError(f"ChainTiles: poll={self.poll!r} must be 'load' or 'atomic', handoff={self.handoff!r} "
                             f"'volatile' or '.cg'")


def sync_counters() -> jax.Array:
    """The zeroed counters a chain launch takes (and leaves zeroed)."""
    return jnp.zeros((len(PHASES),), jnp.int32)


def decode_mlp_chain_reference(o, x, wo, s_mlp, w_gate_up, w_down, *, next_qkv=None, eps=1e-5):
    """The same math as four decode_gemv calls (models/serving.py decode_step's order and roundings)."""
    from pallas_kernels.decode_gemv import decode_gemv_reference as mv
    x1 = mv(o, wo, residual=x)
    x2 = mv(mv(x1, w_gate_up, norm_scale=s_mlp, eps=eps, swiglu=True), w_down, residual=x1)
    return x2, (None if next_qkv is None else mv(x2, next_qkv[0], norm_scale=next_qkv[1], eps=eps))


def _signal(sync, i: int, interpret: bool):
    """This program's outputs of phase i are stored: count it."""
    if not interpret:                  # every thread's stores issued before the atomic releases them
        plgpu.debug_barrier()
    plgpu.atomic_add(sync, (jnp.int32(i),), jnp.int32(1))


def _wait(sync, i: int, producers: int, consumers: int, pid, poll: str, interpret: bool):
    """Spin until phase i's `producers` programs have counted; the last of the `consumers` programs
    to get past resets the counter for the next launch."""
    zero = pid * 0                   # traced, not literals: interpret mode's while-loop discharge
    at = (zero + i,)                 # rejects constants in the loop body
    if poll == "atomic":
        read = lambda _: plgpu.atomic_add(sync, at, zero)   # noqa: E731 - an acquiring read
    else:
        read = lambda _: plgpu.load(sync.at[at], volatile=not interpret)   # noqa: E731
    lax.while_loop(lambda seen: seen < producers, read, read(None))
    before = plgpu.atomic_add(sync, at, zero + 1)          # acquires what the producers released

    @pl.when(before == producers + consumers - 1)
    def _():
        plgpu.atomic_add(sync, at, zero - (producers + consumers))     # back to 0


def _kernel(*refs, phases, eps, poll, handoff, interpret):
    """phases: ((start, programs, tiles dict) per phase, in PHASES order)."""
    o_ref, x_ref, wo_ref, smlp_ref, wgu_ref, wdown_ref, *refs = refs
    qkv_in = len(phases) == 4
    wqkv_ref, sattn_ref = (refs.pop(0), refs.pop(0)) if qkv_in else (None, None)
    _, x1_ref, h_ref, x2_ref, *refs = refs                       # the sync input: its aliased output is last
    qkv_ref = refs.pop(0) if qkv_in else None
    (sync,) = refs
    #          x       w          norm scale  residual  out      swiglu volatile x / residual
    specs = [(o_ref, wo_ref, None, x_ref, x1_ref, False, False),
             (x1_ref, wgu_ref, smlp_ref, None, h_ref, True, True),
             (h_ref, wdown_ref, None, x1_ref, x2_ref, False, True),
             (x2_ref, wqkv_ref, sattn_ref, None, qkv_ref, False, True)]
    pid = pl.program_id(0)
    for i, ((start, programs, tiles), spec) in enumerate(zip(phases, specs)):
        @pl.when((pid >= start) & (pid < start + programs))
        def _(i=i, start=start, programs=programs, tiles=tiles, spec=spec):
            ready = None if i == 0 else functools.partial(_wait, sync, i - 1, phases[i - 1][1], programs, pid,
                                                          poll, interpret)
            past_l1 = None if interpret or not spec[6] else handoff
            gemv_program(pid - start, *spec[:5], swiglu=spec[5], past_l1=past_l1, ready=ready, eps=eps, **tiles)
            if i < len(phases) - 1:
                _signal(sync, i, interpret)


def decode_mlp_chain(o, x, wo, s_mlp, w_gate_up, w_down, sync, *, next_qkv=None, eps: float = 1e-5,
                     tiles: ChainTiles | None = None, interpret: bool = False):
    """See the module doc. o [m, h hd], x [m, d] (m <= MAX_ROWS) in the weights' dtype; wo [d, h hd],
    w_gate_up [2, f, d], w_down [d, f], next_qkv (wqkv [n_qkv, d], s_attn [d]); s_mlp [d] (read in
    fp32); sync from sync_counters() or the last chain launch. Returns (x2, qkv or None, sync)."""
    return _chain(o, x, wo, s_mlp, w_gate_up, w_down, sync, next_qkv, eps=eps, tiles=tiles or ChainTiles(),
                  interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "tiles", "interpret"))
def _chain(o, x, wo, s_mlp, w_gate_up, w_down, sync, next_qkv, *, eps, tiles, interpret):
    (m, d), f = x.shape, w_gate_up.shape[-2]
    mats = [("wo", o, wo, False), ("gate_up", x, w_gate_up, True), ("down", None, w_down, False)]
    if next_qkv is not None:
        mats.append(("qkv", x, next_qkv[0], False))
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"decode_mlp_chain: {m=} rows must be in 1..{MAX_ROWS} (decode batch)")
    want = {"wo": (d, o.shape[1]), "gate_up": (2, f, d), "down": (d, f), "qkv": (None, d)}
    phases, start = [], 0
    for name, _, w, swiglu in mats:
        shape = want[name]
        if w.ndim != len(shape) or any(a is not None and a != b for a, b in zip(shape, w.shape)) or w.dtype != x.dtype:
            raise ValueError(f"decode_mlp_chain: {name} weights {w.shape} {w.dtype} must be {shape} in {x.dtype}")
        bs = getattr(tiles, name)
        n, k = w.shape[-2], w.shape[-1]
        programs = n // bs.block_n // max(bs.tiles_per_program, 1)
        phases.append((start, programs, program_tiles(bs, m, k, bs.validate(n, k))))
        start += programs
    if sync.shape != (len(PHASES),) or sync.dtype != jnp.int32:
        raise ValueError(f"decode_mlp_chain: sync {sync.shape} {sync.dtype} must be sync_counters()'s "
                         f"[{len(PHASES)}] int32")
    args = [o, x, wo, s_mlp, w_gate_up, w_down] + (list(next_qkv) if next_qkv is not None else []) + [sync]
    outs = [(m, d), (m, f), (m, d)] + ([(m, next_qkv[0].shape[0])] if next_qkv is not None else [])
    out_shape = [jax.ShapeDtypeStruct(s, x.dtype) for s in outs] + [jax.ShapeDtypeStruct(sync.shape, sync.dtype)]
    whole = lambda shape: pl.BlockSpec(shape, lambda j: (0,) * len(shape))  # noqa: E731 - tiles picked in-kernel
    kernel = functools.partial(_kernel, phases=tuple(phases), eps=eps, poll=tiles.poll, handoff=tiles.handoff,
                               interpret=interpret)
    res = pl.pallas_call(
        kernel, grid=(start,), in_specs=[whole(a.shape) for a in args], out_specs=[whole(s.shape) for s in out_shape],
        out_shape=out_shape, input_output_aliases={len(args) - 1: len(out_shape) - 1}, interpret=interpret,
        compiler_params=_CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        name="decode_mlp_chain" + "_qkv" * (next_qkv is not None),
    )(*args)
    x2, qkv = res[2], (res[3] if next_qkv is not None else None)
    return x2, qkv, res[-1]
