"""The decode layer's four matmuls (pallas_kernels/decode_gemv.py) against XLA, for bench_decode.

Each op at the model's shapes: [norm + q|k|v], [wo + residual], [norm + gate|up + SwiGLU],
[down + residual]. The XLA peer is the same math as the model's serving path writes it (the
zero second row at one token, models/serving.py _mm_decode), jitted, so XLA fuses what it can.
Both are timed over enough distinct weight copies (>= 2 GB) that every call reads its weight
from HBM, not from the 50 MB L2 a repeated 8 MB weight would sit in, and that one timed call
holds ~0.5 ms of device work: with 16 copies (200 MB) the host's dispatch set the time (H200,
2026-12-01: XLA's q|k|v at 16 us against 6 us in the decode step's profile).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from meshlab.bench.timing import median_time
from meshlab.bench.decode import emit, torch_event_seconds

F32 = jnp.float32


def _xla(x, w, norm_scale=None, residual=None, swiglu=False, eps=1e-5):
    """The serving path's XLA math on [k, n] weights (gate|up concatenated: one GEMM, split after),
    with _mm_decode's zero second row at one token; pallas_kernels/decode_gemv.py's roundings."""
    from jax import lax
    if x.shape[0] == 1:
        two = lambda a: None if a is None else jnp.concatenate([a, jnp.zeros_like(a)], axis=0)  # noqa: E731
        return _xla(two(x), w, norm_scale, two(residual), swiglu, eps)[:1]
    dt = x.dtype
    if norm_scale is not None:
        xf = x.astype(F32)
        x = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * norm_scale.astype(F32)).astype(dt)
    y = jnp.dot(x, w, preferred_element_type=F32).astype(dt)                                    # [m, n]
    if swiglu:
        gate, up = jnp.split(y, 2, axis=-1)
        return (jax.nn.silu(gate.astype(F32)) * up.astype(F32)).astype(dt)
    return y if residual is None else (residual.astype(F32) + y.astype(F32)).astype(dt)


def _nk(w, swiglu: bool):
    """[k, n] -> decode_gemv's layout: [n, k], or [2, f, k] for gate|up (a copy, as serving keeps)."""
    if swiglu:
        gate, up = jnp.split(w, 2, axis=1)
        return jnp.stack([gate.T, up.T])
    return jnp.asarray(w.T)


def ops(cfg, batch: int) -> dict:
    """name -> (x shape, w shape, extra kwargs maker) at the model's widths."""
    d, f, hd = cfg.d_model, cfg.mlp_dim, cfg.head_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    return {"qkv+norm": ((batch, d), (d, qkv), {"norm": True}),
            "wo+residual": ((batch, cfg.n_heads * hd), (cfg.n_heads * hd, d), {"residual": True}),
            "gate_up+norm+swiglu": ((batch, d), (d, 2 * f), {"norm": True, "swiglu": True}),
            "down+residual": ((batch, f), (f, d), {"residual": True})}


def matmul_peers(cfg, bw, batch: int, configs: dict) -> list[dict]:
    """us per call and % of copy bandwidth (weight bytes) for XLA ([k, n] weights) and decode_gemv
    ([n, k] copies) under each {label: BlockSizes, or (BlockSizes, op names it runs on)} of `configs`;
    a timed row's "gemv_key" is "n,k,swiglu" as decode_gemv's default_block_sizes sees the op."""
    from pallas_kernels.decode_gemv import decode_gemv
    interpret = jax.default_backend() != "gpu"
    out = []
    for name, (xs, ws, kind) in ops(cfg, batch).items():
        key = jax.random.split(jax.random.key(1), 4)
        wbytes = math.prod(ws) * 2
        # >= 2 GB of weights per call: ~0.5 ms of device time, longer than dispatching the call
        copies = 1 if interpret else max(1, min(256, math.ceil(2e9 / wbytes)))
        x = jax.random.normal(key[0], xs, jnp.bfloat16)
        ws_ = [(jax.random.normal(jax.random.fold_in(key[1], i), ws, F32) / math.sqrt(ws[0])).astype(jnp.bfloat16)
               for i in range(copies)]
        kw = {}
        if kind.get("norm"):
            kw["norm_scale"] = 1 + 0.1 * jax.random.normal(key[2], (xs[1],), F32)
        if kind.get("residual"):
            kw["residual"] = jax.random.normal(key[3], (xs[0], ws[1]), jnp.bfloat16)
        swiglu = kind.get("swiglu", False)
        gemv_key = f"{ws[1] // 2 if swiglu else ws[1]},{ws[0]},{int(swiglu)}"   # decode_gemv's (n, k, swiglu)
        want = _xla(x, ws_[0], swiglu=swiglu, **kw).astype(F32)
        impls = {"xla": (lambda x, w, **k: _xla(x, w, swiglu=swiglu, **k), "kn")}
        for label, bs in configs.items():
            bs, only = bs if isinstance(bs, tuple) else (bs, None)
            if only is not None and name not in only:
                continue
            impls[f"ours[{label}]"] = (lambda x, w, bs=bs, **k: decode_gemv(
                x, w, swiglu=swiglu, block_sizes=bs, interpret=interpret, **k), "nk")
        ws_t = None
        for label, (fn, layout) in impls.items():
            if layout == "nk" and ws_t is None:
                ws_t = [_nk(w, swiglu) for w in ws_]
            weights = ws_t if layout == "nk" else ws_
            setting = f"{name} {label} b={batch}"
            try:
                many = jax.jit(lambda x, ws, kw, fn=fn: [fn(x, w, **kw) for w in ws])
                err = float(jnp.max(jnp.abs(many(x, weights[:1], kw)[0].astype(F32) - want)))
                if not err <= 0.06:     # bf16 outputs of O(1): a few ulps
                    out.append(emit({"section": "matmul", "setting": setting, "value": float("nan"), "unit": "us",
                                     "note": f"WRONG: max error {err:.1e}"}))
                    continue
                t = median_time(many, x, weights, kw, warmup=3, reps=10, inner=5) / copies
                out.append(emit({"section": "matmul", "setting": setting, "value": t * 1e6, "unit": "us",
                                 "gemv_key": gemv_key, "note": f"{wbytes / t / 1e9:.0f} GB/s = {wbytes / t / bw:.0%} of copy bw, "
                                         f"{copies} weight copies, max error {err:.1e}"}))
            except Exception as e:  # noqa: BLE001 - one failing config must not lose the others
                out.append(emit({"section": "matmul", "setting": setting, "value": float("nan"), "unit": "us",
                                 "note": f"FAILED {type(e).__name__}: {str(e)[:200]}"}))
    return out


def _torch_read_rates(nbytes: int, k: int, reps: int = 20) -> dict:
    """torch's read-only streams over nbytes of bf16 (CUDA events, median of reps): a sum, and
    one row times an [n, k] weight through cuBLAS (torch.mv). {name: bytes read per second}."""
    import torch
    t = {"x": torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda"),
         "w": torch.randn(nbytes // (2 * k), k, dtype=torch.bfloat16, device="cuda"),
         "v": torch.randn(k, dtype=torch.bfloat16, device="cuda")}
    out = {name: nbytes / torch_event_seconds(op, reps)
           for name, op in (("sum", lambda: t["x"].sum(dtype=torch.float32)), ("mv", lambda: torch.mv(t["w"], t["v"])))}
    t.clear()
    torch.cuda.empty_cache()
    return out


def read_rates(bw: float, smoke: bool = False) -> list[dict]:
    """How fast a stream that only reads can go, against the copy rate `bw` (read + write) the decode
    roofline divides by: a decode step reads its weights and writes almost nothing, so its ceiling is
    this rate, not the copy's. Over 1 GiB of bf16: a sum and a one-row GEMV in torch (cuBLAS) and in
    XLA, and decode_gemv in each role's shipped tiles (shape_block_sizes) at a width of 1 GiB, where
    its steady rate shows without the launch's ramp and tail that a layer-sized call pays. JAX calls are
    timed ten back to back, waited on once, so the host's dispatch and sync stay out of a ~0.25 ms call."""
    from pallas_kernels.decode_gemv import decode_gemv, shape_block_sizes
    interpret = jax.default_backend() != "gpu"
    nbytes = (1 << 20) if smoke else (1 << 30)
    size = f"{nbytes >> 20} MiB"
    rows = []

    def row(setting, rate, note=""):
        rows.append(emit({"section": "read", "setting": setting, "value": rate / 1e9, "unit": "GB/s",
                          "note": f"{rate / bw:.0%} of copy bw (read + write){'; ' + note if note else ''}"}))
    if not interpret:
        for name, rate in _torch_read_rates(nbytes, 2048).items():
            row(f"torch {name} {size} bf16", rate, "CUDA events")
    key = jax.random.split(jax.random.key(2), 3)
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=F32))
    row(f"xla sum {size} bf16", nbytes / median_time(total, x, reps=10, inner=10))
    del x
    # each role's shipped tiles at llama3_1b's shapes, run on a [n, k] weight of 1 GiB at that role's k
    roles = {"q|k|v": (3072, 2048, False), "wo": (2048, 2048, False), "gate|up": (8192, 2048, True),
             "down": (2048, 8192, False)}
    tiles = {}
    for role, (n, k, swiglu) in roles.items():
        bs = shape_block_sizes(n, k, swiglu)
        tiles[f"{role} n{bs.block_n}k{bs.block_k}w{bs.num_warps}t{bs.tiles_per_program}p{bs.prefetch}"] = (k, bs)
    for k in sorted({k for k, _ in tiles.values()}):
        n = nbytes // (2 * k)
        w = (jax.random.normal(key[0], (n, k), F32) / math.sqrt(k)).astype(jnp.bfloat16)             # [n, k]
        v = jax.random.normal(key[1], (1, k), jnp.bfloat16)                                          # [1, k]
        want = jax.jit(lambda v, w: jnp.dot(v, w.T, preferred_element_type=F32))(v, w)               # [1, n]
        dot = jax.jit(lambda v, w: jnp.dot(v, w.T, preferred_element_type=F32).astype(v.dtype))
        row(f"xla one-row dot [{n}, {k}]", nbytes / median_time(dot, v, w, reps=10, inner=10))
        for label, (tk, bs) in tiles.items():
            if tk != k:
                continue
            fn = jax.jit(lambda v, w, bs=bs: decode_gemv(v, w, block_sizes=bs, interpret=interpret))
            err = float(jnp.max(jnp.abs(fn(v, w).astype(F32) - want)))
            row(f"decode_gemv {label} [{n}, {k}]", nbytes / median_time(fn, v, w, reps=10, inner=10), f"max error {err:.1e}")
        del w
    return rows
