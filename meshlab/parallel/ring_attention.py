"""Ring attention: context parallelism with keys/values travelling around the `context` ring.

Each device keeps its query shard. Key/value shards (and their segment ids) move one hop per
step with `ppermute`; the send for the next step is issued before this step's attention so
XLA's async collective-permute can hide it behind the block computation. Partial results are
merged with the log-sum-exp rule. The backward pass (a `jax.custom_vjp`) runs the same ring:
k/v travel again together with their dK/dV accumulators, which take one extra hop at the end
to get home. Nothing of size S x S is ever formed: the per-block jnp attention is itself
tiled over keys (`block_k`), so per-device temporaries are ~ (S / context) x block_k.

Causal load balance (zig-zag). With a contiguous split device n-1 attends to everything and
device 0 to one block. Instead the global sequence is cut into 2n chunks and device i holds
chunks i and 2n-1-i (`zigzag_permutation`); then every device computes 2n+1 of the
(half-shard x half-shard) blocks. The caller must put the sequence in that order before
sharding (see meshlab/parallel/context.py). The schedule -- which (q chunk, kv chunk) pairs
each device computes at each step, and with which mask -- is the pure function
`ring_schedule`; the traced code is generated from it, so what tests count is what runs.

Layout: q [b, s, h, d], k/v [b, s, kvh, d] (GQA: h a multiple of kvh), lse [b, h, s] fp32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

NEG = -1e30  # finite "minus infinity": exp(NEG - NEG) stays 1 instead of NaN for empty rows


# ----------------------------------------------------------------------------- zig-zag order
def zigzag_permutation(seq_len: int, n: int) -> np.ndarray:
    """Indices `perm` with x_zigzag = x[perm]: shard i of the result is chunks (i, 2n-1-i)."""
    if seq_len % (2 * n):
        raise ValueError(f"zig-zag needs the sequence length ({seq_len}) divisible by 2 x context "
                         f"size ({2 * n}); pad the sequence or change the context size")
    c = seq_len // (2 * n)
    chunks = [np.arange(j * c, (j + 1) * c) for j in range(2 * n)]
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def zigzag_inverse_permutation(seq_len: int, n: int) -> np.ndarray:
    """Indices undoing `zigzag_permutation`: x == x_zigzag[inverse]."""
    return np.argsort(zigzag_permutation(seq_len, n))


def _chunks_of(device: int, n: int, zigzag: bool) -> tuple[int, int]:
    """Global chunk indices (out of 2n) held by `device`, in local order."""
    return (device, 2 * n - 1 - device) if zigzag else (2 * device, 2 * device + 1)


# ----------------------------------------------------------------------------- schedule
class BlockPair(NamedTuple):
    q_chunk: int   # global chunk index (of 2n) of the queries
    kv_chunk: int  # global chunk index of the keys/values
    kind: str      # "full" (no causal mask) or "causal" (the diagonal chunk)


def ring_schedule(n: int, *, causal: bool = True, zigzag: bool = True) -> list[list[tuple[BlockPair, ...]]]:
    """schedule[device][step]: the half-shard blocks `device` computes at ring step `step`.

    At step t device i holds the k/v shard of device (i - t) mod n. A pair whose keys all lie
    after its queries (causal) is fully masked and is left out: that is the skipping.
    """
    sched = []
    for i in range(n):
        steps = []
        for t in range(n):
            j = (i - t) % n
            pairs = []
            for qc in _chunks_of(i, n, zigzag):
                for kc in _chunks_of(j, n, zigzag):
                    if not causal or kc < qc:
                        pairs.append(BlockPair(qc, kc, "full"))
                    elif kc == qc:
                        pairs.append(BlockPair(qc, kc, "causal"))
            steps.append(tuple(pairs))
        sched.append(steps)
    return sched


def blocks_per_device(schedule) -> list[int]:
    """Number of computed (not skipped) half-shard blocks per device."""
    return [sum(len(s) for s in steps) for steps in schedule]


class _Call(NamedTuple):
    q_halves: tuple[int, ...]   # contiguous local halves of the query shard (0, 1 or both)
    kv_halves: tuple[int, ...]  # contiguous local halves of the k/v shard
    causal: bool                # bottom-right aligned causal mask (the diagonal is the last kv half)


def _plan(pairs: tuple[BlockPair, ...], i: int, j: int, n: int, zigzag: bool):
    """Turn one device-step's pairs into as few attention calls as possible (bigger calls run
    faster). Returns a hashable tuple of _Call in local half indices."""
    qloc = {c: a for a, c in enumerate(_chunks_of(i, n, zigzag))}
    kloc = {c: b for b, c in enumerate(_chunks_of(j, n, zigzag))}
    per_q: dict[int, list[tuple[int, str]]] = {}
    for p in pairs:
        per_q.setdefault(qloc[p.q_chunk], []).append((kloc[p.kv_chunk], p.kind))
    calls = []
    for a, kvs in sorted(per_q.items()):
        kvs.sort()
        kinds = [k for _, k in kvs]
        # The diagonal pair, when present, is the last kv half (local order follows positions).
        assert "causal" not in kinds[:-1]
        causal = kinds[-1] == "causal"
        halves = tuple(b for b, _ in kvs)
        calls.append(_Call((a,), halves, causal))
    if len(calls) == 2 and calls[0][1:] == calls[1][1:] and not calls[0].causal:  # same kv, no mask
        calls = [_Call((0, 1), calls[0].kv_halves, False)]
    return tuple(calls)


# ----------------------------------------------------------------------------- jnp blocks
def _tile(ck: int, block_k: int) -> int:
    return block_k if ck > block_k and ck % block_k == 0 else ck


def _scan(body, init, xs):
    """lax.scan, but a single tile is traced straight (no while loop: faster to compile and run)."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        carry, y = body(init, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda x: x[None], y)
    return lax.scan(body, init, xs)


def _mask(q_pos, kv_pos, q_seg, kv_seg, causal):
    """[b or 1, cq, bk] boolean mask or None."""
    m = None
    if causal:
        m = (q_pos[:, None] >= kv_pos[None, :])[None]
    if q_seg is not None:
        s = q_seg[:, :, None] == kv_seg[:, None, :]
        m = s if m is None else m & s
    return m


def _split_kv(x, nt, bk):
    """[b, ck, ...] -> [nt, b, bk, ...] for a scan over key tiles."""
    return jnp.moveaxis(x.reshape(x.shape[0], nt, bk, *x.shape[2:]), 1, 0)


MAX_SPLITS = 2  # diagonal waste c^2/2 -> c^2/8; deeper costs more calls and compile time than it saves


def _split_diagonal(causal, cq, ck, block_k, depth):
    """A square causal block is split in two along the queries: the first half is again a square
    causal block (recursing), the second half sees all keys up to its diagonal. Without this a
    jnp causal block computes (and throws away) its whole upper triangle; each split halves that."""
    return causal and cq == ck and cq % 2 == 0 and cq // 2 >= block_k and depth < MAX_SPLITS


def _seg_half(seg, lo, hi):
    return None if seg is None else seg[:, lo:hi]


def jnp_block_fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_k=512, _depth=0):
    """Attention of one query block against one k/v block, tiled over keys with an online
    softmax. Returns (out fp32 [b, cq, h, d], lse fp32 [b, h, cq]); rows with no visible key get
    out 0 and lse NEG. `causal` is aligned to the bottom-right (queries are the last cq keys)."""
    if _split_diagonal(causal, q.shape[1], k.shape[1], block_k, _depth):
        hq = q.shape[1] // 2
        kw = dict(causal=True, scale=scale, block_k=block_k, _depth=_depth + 1)
        o0, l0 = jnp_block_fwd(q[:, :hq], k[:, :hq], v[:, :hq], _seg_half(q_seg, 0, hq), _seg_half(kv_seg, 0, hq), **kw)
        o1, l1 = jnp_block_fwd(q[:, hq:], k, v, _seg_half(q_seg, hq, None), kv_seg, **kw)
        return jnp.concatenate([o0, o1], 1), jnp.concatenate([l0, l1], 2)
    b, cq, h, d = q.shape
    ck, kvh = k.shape[1], k.shape[2]
    g, bk = h // kvh, _tile(ck, block_k)
    nt = ck // bk
    qg = q.reshape(b, cq, kvh, g, d)
    q_pos = jnp.arange(cq) + (ck - cq)
    xs = (_split_kv(k, nt, bk), _split_kv(v, nt, bk),
          None if kv_seg is None else _split_kv(kv_seg, nt, bk), jnp.arange(nt) * bk)

    def body(carry, x):
        o, m, l = carry
        kt, vt, st, start = x
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kt, preferred_element_type=jnp.float32) * scale
        mask = _mask(q_pos, start + jnp.arange(bk), q_seg, st, causal)
        if mask is not None:
            s = jnp.where(mask[:, None, None], s, NEG)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        if mask is not None:  # a fully masked row has s == m_new == NEG: zero it explicitly
            p = jnp.where(mask[:, None, None], p, 0.0)
        alpha = jnp.exp(m - m_new)  # rescale what was accumulated under the old max
        l = l * alpha + p.sum(-1)
        o = o * alpha[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vt,
                                              preferred_element_type=jnp.float32)
        return (o, m_new, l), None

    init = (jnp.zeros((b, kvh, g, cq, d), jnp.float32), jnp.full((b, kvh, g, cq), NEG, jnp.float32),
            jnp.zeros((b, kvh, g, cq), jnp.float32))
    (o, m, l), _ = _scan(body, init, xs)
    ok = l > 0
    lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), NEG)
    o = o / jnp.where(ok, l, 1.0)[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(b, cq, h, d), lse.reshape(b, h, cq)


def jnp_block_bwd(q, k, v, do, lse, delta, q_seg, kv_seg, *, causal, scale, block_k=512, _depth=0):
    """Gradients of one block from the *global* lse and delta = rowsum(dO * O).
    Returns fp32 (dq [b, cq, h, d], dk, dv [b, ck, kvh, d]); tiled over keys like the forward."""
    if _split_diagonal(causal, q.shape[1], k.shape[1], block_k, _depth):
        hq = q.shape[1] // 2
        kw = dict(causal=True, scale=scale, block_k=block_k, _depth=_depth + 1)
        dq0, dk0, dv0 = jnp_block_bwd(q[:, :hq], k[:, :hq], v[:, :hq], do[:, :hq], lse[..., :hq], delta[..., :hq],
                                      _seg_half(q_seg, 0, hq), _seg_half(kv_seg, 0, hq), **kw)
        dq1, dk1, dv1 = jnp_block_bwd(q[:, hq:], k, v, do[:, hq:], lse[..., hq:], delta[..., hq:],
                                      _seg_half(q_seg, hq, None), kv_seg, **kw)
        return jnp.concatenate([dq0, dq1], 1), dk1.at[:, :hq].add(dk0), dv1.at[:, :hq].add(dv0)
    b, cq, h, d = q.shape
    ck, kvh = k.shape[1], k.shape[2]
    g, bk = h // kvh, _tile(ck, block_k)
    nt = ck // bk
    qg, dog = q.reshape(b, cq, kvh, g, d), do.reshape(b, cq, kvh, g, d)
    lse, delta = lse.reshape(b, kvh, g, cq), delta.reshape(b, kvh, g, cq)
    q_pos = jnp.arange(cq) + (ck - cq)
    xs = (_split_kv(k, nt, bk), _split_kv(v, nt, bk),
          None if kv_seg is None else _split_kv(kv_seg, nt, bk), jnp.arange(nt) * bk)

    def body(dq, x):
        kt, vt, st, start = x
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kt, preferred_element_type=jnp.float32) * scale
        p = jnp.exp(s - lse[..., None])
        mask = _mask(q_pos, start + jnp.arange(bk), q_seg, st, causal)
        if mask is not None:
            p = jnp.where(mask[:, None, None], p, 0.0)
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), dog, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, vt, preferred_element_type=jnp.float32)
        ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kt, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg, preferred_element_type=jnp.float32)
        return dq, (dk, dv)

    dq, (dk, dv) = _scan(body, jnp.zeros((b, cq, kvh, g, d), jnp.float32), xs)
    unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, ck, kvh, d)  # noqa: E731
    return dq.reshape(b, cq, h, d), unsplit(dk), unsplit(dv)


def _block_fns(block_impl: str, block_k: int):
    if block_impl == "jnp":
        return (functools.partial(jnp_block_fwd, block_k=block_k),
                functools.partial(jnp_block_bwd, block_k=block_k))
    if block_impl == "pallas":
        try:
            from pallas_kernels import flash_attention as fa
            fwd, bwd = fa.flash_attention_block_fwd, fa.flash_attention_block_bwd
        except (ImportError, AttributeError) as e:
            raise RuntimeError(
                "ring_attention(block_impl='pallas') needs pallas_kernels.flash_attention to provide "
                f"flash_attention_block_fwd/_bwd ({e}); use block_impl='jnp'") from None

        # Adapter: the one place that knows the kernel's calling convention. Our `causal` is
        # bottom-right aligned, i.e. the kernel's causal_offset = kv_len - q_len. Off GPU the
        # kernel runs in interpret mode (slow; tests only).
        interpret = jax.default_backend() != "gpu"

        def _kw(q, k, q_seg, kv_seg, causal, scale):
            return dict(causal_offset=(k.shape[1] - q.shape[1]) if causal else None, sm_scale=scale,
                        segment_ids=None if q_seg is None else (q_seg, kv_seg), interpret=interpret)

        def pfwd(q, k, v, q_seg, kv_seg, *, causal, scale):
            return fwd(q, k, v, out_dtype=jnp.float32, **_kw(q, k, q_seg, kv_seg, causal, scale))

        def pbwd(q, k, v, do, lse, delta, q_seg, kv_seg, *, causal, scale):
            return bwd(q, k, v, do, lse, delta, grad_dtype=jnp.float32, **_kw(q, k, q_seg, kv_seg, causal, scale))
        return pfwd, pbwd
    raise ValueError(f"unknown block_impl {block_impl!r}; choose 'jnp', 'pallas' or 'auto'")


def resolve_block_impl(block_impl: str, head_dim: int) -> str:
    """'auto': the Pallas block kernels on GPU when present and the head dim suits them, else jnp."""
    if block_impl != "auto":
        return block_impl
    if jax.default_backend() != "gpu" or head_dim not in (16, 32, 64, 128, 256):
        return "jnp"
    try:
        from pallas_kernels import flash_attention as fa
        return "pallas" if hasattr(fa, "flash_attention_block_fwd") else "jnp"
    except ImportError:
        return "jnp"


# ----------------------------------------------------------------------------- the ring
@dataclasses.dataclass(frozen=True)
class _Cfg:
    n: int
    axis: str
    causal: bool
    zigzag: bool
    scale: float
    block_impl: str
    block_k: int

    @functools.cached_property
    def steps(self):
        """Per step: (distinct plans, per-device index into them) -- derived from ring_schedule."""
        sched = ring_schedule(self.n, causal=self.causal, zigzag=self.zigzag)
        out = []
        for t in range(self.n):
            plans = [_plan(sched[i][t], i, (i - t) % self.n, self.n, self.zigzag) for i in range(self.n)]
            distinct = sorted(set(plans))
            out.append((distinct, np.array([distinct.index(p) for p in plans], np.int32)))
        return out


def _sl(halves, c):
    return slice(halves[0] * c, (halves[-1] + 1) * c)


def _run_step(cfg, t, fn, *operands):
    """Call fn(plan, *operands) with this device's plan for step t (a switch only if plans differ)."""
    plans, table = cfg.steps[t]
    if len(plans) == 1:
        return fn(plans[0], *operands)
    idx = jnp.asarray(table)[lax.axis_index(cfg.axis)]
    return lax.switch(idx, [functools.partial(fn, p) for p in plans], *operands)


def _fwd_local(cfg, q, k, v, q_seg, kv_seg):
    block_fwd, _ = _block_fns(cfg.block_impl, cfg.block_k)
    b, sl, h, d = q.shape
    c = sl // 2
    perm = [(i, (i + 1) % cfg.n) for i in range(cfg.n)]

    def apply(plan, o, lse, kv):
        kk, vv, ks = kv
        for call in plan:
            qs, ksl = _sl(call.q_halves, c), _sl(call.kv_halves, c)
            ob, lb = block_fwd(q[:, qs], kk[:, ksl], vv[:, ksl], None if q_seg is None else q_seg[:, qs],
                               None if ks is None else ks[:, ksl], causal=call.causal, scale=cfg.scale)
            # Merge: m = max of the two log-sum-exps; both partial results are rescaled by
            # exp(lse_part - m), i.e. the old accumulator by exp(m_old - m_new).
            lo = lse[:, :, qs]
            m = jnp.maximum(lo, lb)
            wo, wb = jnp.exp(lo - m), jnp.exp(lb - m)
            den = wo + wb
            to_o = lambda w: jnp.swapaxes(w / den, 1, 2)[..., None]  # noqa: E731  [b,h,q]->[b,q,h,1]
            o = o.at[:, qs].set(o[:, qs] * to_o(wo) + ob * to_o(wb))
            lse = lse.at[:, :, qs].set(m + jnp.log(den))
        return o, lse

    o = jnp.zeros((b, sl, h, d), jnp.float32)
    lse = jnp.full((b, h, sl), NEG, jnp.float32)
    kv = (k, v, kv_seg)
    for t in range(cfg.n):
        nxt = lax.ppermute(kv, cfg.axis, perm) if t < cfg.n - 1 else None  # in flight during compute
        o, lse = _run_step(cfg, t, lambda plan, o, lse, kv: apply(plan, o, lse, kv), o, lse, kv)
        kv = nxt
    return o.astype(q.dtype), lse


def _bwd_local(cfg, q, k, v, q_seg, kv_seg, o, lse, do):
    _, block_bwd = _block_fns(cfg.block_impl, cfg.block_k)
    b, sl, h, d = q.shape
    c = sl // 2
    perm = [(i, (i + 1) % cfg.n) for i in range(cfg.n)]
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1), 1, 2)  # [b, h, sl]

    def apply(plan, dq, dk, dv, kv):
        kk, vv, ks = kv
        for call in plan:
            qs, ksl = _sl(call.q_halves, c), _sl(call.kv_halves, c)
            gq, gk, gv = block_bwd(q[:, qs], kk[:, ksl], vv[:, ksl], do[:, qs], lse[:, :, qs], delta[:, :, qs],
                                   None if q_seg is None else q_seg[:, qs], None if ks is None else ks[:, ksl],
                                   causal=call.causal, scale=cfg.scale)
            dq = dq.at[:, qs].add(gq)
            dk = dk.at[:, ksl].add(gk)
            dv = dv.at[:, ksl].add(gv)
        return dq, dk, dv

    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)  # travels with the k/v shard it belongs to
    dv = jnp.zeros(v.shape, jnp.float32)
    kv = (k, v, kv_seg)
    for t in range(cfg.n):
        nxt = lax.ppermute(kv, cfg.axis, perm) if t < cfg.n - 1 else None
        dq, dk, dv = _run_step(cfg, t, lambda plan, dq, dk, dv, kv: apply(plan, dq, dk, dv, kv), dq, dk, dv, kv)
        if cfg.n > 1:  # after the last step this hop brings dK/dV back to their owner
            dk, dv = lax.ppermute((dk, dv), cfg.axis, perm)
        kv = nxt
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def shard_map_region(mesh, axis_name, *axis_groups):
    """(mesh, axis_names, axis groups) for a shard_map that may be nested in a manual region.

    The training step is itself a shard_map, manual over the data-parallel axes. Inside it the
    arrays are already local along those axes, so they are dropped from our specs, and the
    inner shard_map must be given the context's abstract mesh and made manual over the rest.
    """
    am = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(am, "manual_axes", ()) or ()) if am is not None and not am.empty else frozenset()
    if axis_name in manual:
        raise ValueError(f"'{axis_name}' is already manual here (inside a shard_map over it); "
                         "call context attention outside that region")

    def drop(axes):
        if axes is None:
            return None
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in manual)
        return None if not kept else kept[0] if len(kept) == 1 else kept
    groups = tuple(drop(tuple(g) if isinstance(g, list) else g) for g in axis_groups)
    if not manual:
        return mesh, None, groups
    return am, frozenset(a for a in am.axis_names if a not in manual), groups


def _axis_size(mesh, axes) -> int:
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))


@functools.lru_cache(maxsize=None)
def _build(cfg: _Cfg, mesh, axis_names, batch_axes, head_axes, has_seg: bool):
    qs = P(batch_axes, cfg.axis, head_axes, None)
    ss = P(batch_axes, cfg.axis)
    ls = P(batch_axes, head_axes, cfg.axis)
    segs = (ss, ss) if has_seg else ()

    # check_vma=False: the block code is mesh-agnostic (its scan carries start replicated) and
    # Pallas calls need it; safe because these regions are never differentiated by JAX (the
    # custom_vjp below supplies the backward ring).
    def smap(f, in_specs, out_specs):
        kw = {} if axis_names is None else {"axis_names": set(axis_names)}
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **kw)

    def unpack(args):
        return (*args, None, None) if not has_seg else args

    fwd_sm = smap(lambda *a: _fwd_local(cfg, *unpack(a)), (qs, qs, qs, *segs), (qs, ls))
    bwd_sm = smap(lambda *a: _bwd_local(cfg, *unpack(a[:-3]), *a[-3:]), (qs, qs, qs, *segs, qs, ls, qs), (qs, qs, qs))

    @jax.custom_vjp
    def attn(q, k, v, *segs_):
        return fwd_sm(q, k, v, *segs_)[0]

    def attn_fwd(q, k, v, *segs_):
        o, lse = fwd_sm(q, k, v, *segs_)
        return o, (q, k, v, segs_, o, lse)

    def attn_bwd(res, do):
        q, k, v, segs_, o, lse = res
        dq, dk, dv = bwd_sm(q, k, v, *segs_, o, lse, do)
        return (dq, dk, dv, *(None for _ in segs_))

    attn.defvjp(attn_fwd, attn_bwd)
    return attn


def ring_attention(q, k, v, *, mesh, axis_name: str = "context", causal: bool = True, segment_ids=None,
                   sm_scale=None, zigzag: bool = True, block_impl: str = "jnp", batch_axes=None,
                   head_axes=None, block_k: int = 512):
    """Attention over a sequence sharded along `axis_name` of `mesh`, by ring.

    q [b, s, h, d], k/v [b, s, kvh, d]: global arrays; the sequence dim is split over
    `axis_name`, the batch dim over `batch_axes` and both head dims over `head_axes` (mesh
    axis name, tuple of names, or None). With `causal and zigzag` the sequence must already be
    in zig-zag order (`zigzag_permutation(s, context size)`); the output is in the same order.
    segment_ids: [b, s] int (same order as q), or a (q_ids, kv_ids) pair; tokens attend only
    within their segment. block_impl: "jnp" (tiled over `block_k` keys; a causal diagonal call
    computes its masked half too), "pallas" (`pallas_kernels.flash_attention` block kernels,
    GPU; skips masked tiles) or "auto" (pallas on GPU when usable, else jnp).
    Returns [b, s, h, d] in q.dtype.
    """
    n = mesh.shape[axis_name]
    b, s, h, d = q.shape
    if k.shape[1] != s or v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"ring attention is self-attention: got q {q.shape}, k {k.shape}, v {v.shape}")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[2]})")
    if s % (2 * n):
        raise ValueError(f"ring attention needs the sequence length ({s}) divisible by 2 x the "
                         f"'{axis_name}' size ({2 * n}); pad the sequence")
    scale = float(sm_scale) if sm_scale is not None else d ** -0.5
    block_impl = resolve_block_impl(block_impl, d)
    cfg = _Cfg(n, axis_name, bool(causal), bool(zigzag) and bool(causal), scale, block_impl, int(block_k))
    _block_fns(block_impl, block_k)  # fail early with the clear message
    mesh, axis_names, (batch_axes, head_axes) = shard_map_region(mesh, axis_name, batch_axes, head_axes)
    if k.shape[2] % _axis_size(mesh, head_axes):
        raise ValueError(f"kv heads ({k.shape[2]}) must be divisible by the head axes {head_axes} "
                         f"({_axis_size(mesh, head_axes)}); replicate kv heads over them or change the rule")
    fn = _build(cfg, mesh, axis_names, batch_axes, head_axes, segment_ids is not None)
    if segment_ids is None:
        return fn(q, k, v)
    q_ids, kv_ids = segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    return fn(q, k, v, q_ids, kv_ids)


# ----------------------------------------------------------------------------- local flash (jnp)
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _jnp_flash(q, k, v, q_seg, kv_seg, causal, scale, block_k):
    return jnp_block_fwd(q, k, v, q_seg, kv_seg, causal=causal, scale=scale, block_k=block_k)[0].astype(q.dtype)


def _jnp_flash_fwd(q, k, v, q_seg, kv_seg, causal, scale, block_k):
    o, lse = jnp_block_fwd(q, k, v, q_seg, kv_seg, causal=causal, scale=scale, block_k=block_k)
    o = o.astype(q.dtype)
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _jnp_flash_bwd(causal, scale, block_k, res, do):
    q, k, v, q_seg, kv_seg, o, lse = res
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1), 1, 2)
    dq, dk, dv = jnp_block_bwd(q, k, v, do, lse, delta, q_seg, kv_seg, causal=causal, scale=scale, block_k=block_k)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_jnp_flash.defvjp(_jnp_flash_fwd, _jnp_flash_bwd)


def jnp_flash_attention(q, k, v, *, causal: bool, segment_ids=None, sm_scale=None, block_k: int = 512):
    """Single-device attention in jnp with memory ~ s x block_k (not s x s), forward and backward:
    the ring's block pieces on one block. A portable `attention_fn` for Ulysses at long S."""
    scale = float(sm_scale) if sm_scale is not None else q.shape[-1] ** -0.5
    q_ids, kv_ids = (segment_ids if isinstance(segment_ids, tuple) else (segment_ids, segment_ids))
    return _jnp_flash(q, k, v, q_ids, kv_ids, bool(causal), scale, int(block_k))
