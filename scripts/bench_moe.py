"""Mixture of experts on one GPU: the expert GEMM, then training throughput, in one call.

1. Grouped GEMM, [M, K] rows in E ragged groups x [E, K, N] (M = 32768 assignments, K = 2048,
   N = 1536) at 8/16/64 experts: ours (pallas_kernels.grouped_matmul) with each backend: mosaic
   (JAX's Mosaic ragged-dot kernel + the row mask; Hopper only) against the Mosaic kernel called bare
   (the peer), triton (our Pallas Triton kernels, any CUDA GPU; a small tile sweep at 16 experts) and
   xla (jax.lax.ragged_dot), forward and forward+backward; the padded batched einsum (capacity factor
   1.25) and one dense GEMM of the same useful FLOPs. TFLOP/s of useful work (2 M K N, x3 with the
   backward). Each result is checked against lax.ragged_dot first (triton's gradients against xla's
   up to 16 experts). `--gemm-backends` picks among mosaic, triton, xla.
2. Training tokens/s and MFU (active FLOPs, datasheet peak) of moe_1b_8e with dropless and with
   capacity dispatch, against llama3_1b (same attention, same active SwiGLU width), and against the
   peer: transformers' Mixtral of the same shape (scripts/bench_moe_torch.py, its own process, run
   before JAX takes the GPU). `--chunks 1,2,4` adds each dispatch cut into pieces
   (strategies.experts.chunks): on one device there is no all-to-all to hide, so this prices the
   smaller expert GEMMs alone (must stay within ~1% of 1 piece).

    PYTHONPATH=$PWD python3 scripts/bench_moe.py [--steps 6] [--batch 4] [--seq 4096] [--skip gemm,dense,peer]
        [--gemm-backends mosaic,triton,xla] [--train-gemm auto,triton] [--layers 8]
Prints the tables and appends them, dated, to docs/archive/benchmarks-diary.md ($OUT/bench_moe.json too).
"""
import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from meshlab import rules as R  # noqa: E402
from meshlab.bench import diary  # noqa: E402
from meshlab.bench.timing import median_time  # noqa: E402
from meshlab.mesh import make_mesh  # noqa: E402
from meshlab.plan import account  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

PEAK = account.DATASHEET_BF16_FLOPS["h200"]


def groups(m, e, seed=0):
    """Router-like sizes: a skewed multinomial (some experts 2-3x the mean), summing to m."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(e, 4.0))
    return jnp.asarray(rng.multinomial(m, p), jnp.int32)


# Triton tiles tried at 16 experts (the forward; the backward at its default dW tiles and one more):
# smem per stage (block_m + block_n) x block_k x 2 B, within the 99 KiB of sm_86/89 parts but the wide one
TRITON_SWEEP = [gm.TritonTiles(), gm.TritonTiles(block_k=64, num_stages=3),
                gm.TritonTiles(block_m=64, block_k=64, num_stages=4),
                gm.TritonTiles(block_n=256, block_k=64, num_warps=8, num_stages=3)]
TRITON_DW = [gm.TritonTiles().dw_block_m, 64]     # dw_block_m (rows of x per step) of the backward rows


def _tiles_label(t, dw=False):
    fwd = f"{t.block_m}x{t.block_n}x{t.block_k}/w{t.num_warps}/s{t.num_stages}"
    return fwd + (f", dW {t.dw_block_m}x{t.dw_block_k}x{t.dw_block_n}/w{t.dw_num_warps}/s{t.dw_num_stages}" if dw else "")


def _keep_best(best, tiles, row, e):
    """(tiles, row) of the fastest timed row at e experts: a row at a new expert count replaces the last
    count's best (the sweeps run at 16 first; the other counts time only the winner)."""
    if row and "tflops" in row and (best is None or best[1]["experts"] != e or row["tflops"] > best[1]["tflops"]):
        return tiles, row
    return best


def gemm_rows(m, k, n, experts, tiles_list, backends=("mosaic", "triton", "xla")):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    rows = []
    useful = 2 * m * k * n
    best = None
    best_triton = best_triton_bwd = None
    on_hopper = gm.on_hopper()
    # The tile sweeps run at 16 experts (the must's shape) first; the other counts reuse their winners.
    for e in sorted(experts, key=lambda e: e != 16):
        gs = groups(m, e)
        kx, kw = jax.random.split(jax.random.key(e))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (e, k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        ref = jax.jit(lambda x, w: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(x, w)
        ct = jax.random.normal(jax.random.key(e + 1), (m, n), jnp.bfloat16)

        def grad(backend, **kw):
            """(<out, ct>, dx, dw): the value reads the forward's output, so XLA keeps the forward kernel
            (the gradients of a plain sum need only the backward's, and the forward would be dropped)."""
            loss = lambda x, w: jnp.sum(gm.grouped_matmul(x, w, gs, backend=backend, **kw).astype(jnp.float32)  # noqa: E731
                                        * ct.astype(jnp.float32))
            return lambda x, w: (lambda v, g: (v, *g))(*jax.value_and_grad(loss, argnums=(0, 1))(x, w))
        # the xla backend's value and gradients, the triton backward's check (64 groups: GBs of padded temporaries)
        ref_grads = jax.jit(grad("xla"))(x, w) if "triton" in backends and e <= 16 else None

        def check(out):
            if isinstance(out, tuple):   # (value, dx, dw) against xla's
                if ref_grads is None:
                    return 0.0
                err = max(float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) /
                                jnp.linalg.norm(b.astype(jnp.float32))) for a, b in zip(out, ref_grads))
            else:
                err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            return err if np.isfinite(err) and err < 2e-2 else None

        def timed(label, f, args, useful_flops=useful, verify=True):
            try:
                f = jax.jit(f)
                err = check(f(*args)) if verify else 0.0
                if err is None:
                    rows.append({"experts": e, "variant": label, "error": "wrong result vs lax.ragged_dot"})
                    return None
                t = median_time(f, *args, warmup=2, reps=10, inner=5)
                row = {"experts": e, "variant": label, "ms": round(t * 1e3, 3),
                       "tflops": round(useful_flops / t / 1e12, 1), "rel_err": err}
            except Exception as ex:   # a failing variant is a row, not the end of the call
                row = {"experts": e, "variant": label, "error": f"{type(ex).__name__}: {str(ex)[:160]}"}
            rows.append(row)
            print(row, flush=True)
            return row

        if on_hopper and "mosaic" in backends:
            sweep = tiles_list if best is None else [best[0]]
            for tiles in sweep:          # the bare Mosaic kernel at each tiling: the peer takes its best
                kw_ = dict(block_m=tiles.block_m, block_n=tiles.block_n, block_k=tiles.block_k,
                           max_concurrent_steps=tiles.max_concurrent_steps, grid_block_n=tiles.grid_block_n)
                r = timed(f"mosaic ragged_dot (bare) {tiles.block_m}x{tiles.block_n}x{tiles.block_k}/"
                          f"{tiles.max_concurrent_steps}/g{tiles.grid_block_n}",
                          lambda x, w, kw_=kw_: gm._call(ragged_dot_mgpu.ragged_dot, x, w, group_sizes=gs, **kw_),
                          (x, w))
                best = _keep_best(best, tiles, r, e)
            tiles = best[0] if best else gm.Tiles()
            timed("ours: grouped_matmul (mosaic, all rows real: the model's 1-device dropless path)",
                  lambda x, w: gm.grouped_matmul(x, w, gs, backend="mosaic", tiles=tiles, all_rows=True), (x, w))
            timed("ours with the padding-row mask (the expert-parallel path)",
                  lambda x, w: gm.grouped_matmul(x, w, gs, backend="mosaic", tiles=tiles), (x, w))
            timed("ours fwd+bwd (x3 FLOPs)", grad("mosaic", tiles=tiles, all_rows=True), (x, w),
                  useful_flops=3 * useful, verify=False)
        if "triton" in backends:
            sweep = TRITON_SWEEP if best_triton is None else [best_triton[0]]
            for tt in sweep:
                r = timed(f"triton: grouped_matmul (triton) {_tiles_label(tt)}",
                          lambda x, w, tt=tt: gm.grouped_matmul(x, w, gs, backend="triton", triton_tiles=tt), (x, w))
                best_triton = _keep_best(best_triton, tt, r, e)
            tt = best_triton[0] if best_triton else gm.TritonTiles()
            # the forward's tiles at 16 experts with each dW row chunk; the winner's at the other counts
            bwd_sweep = ([dataclasses.replace(tt, dw_block_m=b) for b in TRITON_DW] if best_triton_bwd is None
                         else [best_triton_bwd[0]])
            for tb in bwd_sweep:
                r = timed(f"triton fwd+bwd (x3 FLOPs) {_tiles_label(tb, dw=True)}", grad("triton", triton_tiles=tb), (x, w),
                          useful_flops=3 * useful)
                best_triton_bwd = _keep_best(best_triton_bwd, tb, r, e)
        if "xla" in backends and e <= 16:   # 64 groups: GBs of padded temporaries
            timed("jax.lax.ragged_dot", lambda x, w: jax.lax.ragged_dot(x, w, gs), (x, w))
            timed("jax.lax.ragged_dot fwd+bwd (x3 FLOPs)", grad("xla"), (x, w), useful_flops=3 * useful, verify=False)
        cap = int(np.ceil(1.25 * m / e))
        xb = jax.random.normal(kx, (e, cap, k), jnp.bfloat16)
        timed("padded batched einsum (capacity 1.25)", lambda xb, w: jnp.einsum("eck,ekn->ecn", xb, w), (xb, w),
              verify=False)
        timed("dense GEMM [M,K]x[K,N]", lambda x, w0: x @ w0, (x, w[0]), verify=False)
    return rows


def run_peer(args) -> dict:
    """The transformers Mixtral peer's JSON row, from its own process (torch must not share JAX's GPU)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_moe_torch.py"), "--model", args.model,
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.peer_timeout)
        line = [x for x in out.stdout.splitlines() if x.startswith("{")]
        row = json.loads(line[-1]) if line else {"error": (out.stderr or out.stdout)[-400:]}
    except Exception as e:  # the peer failing must not hide our numbers
        row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    print({"peer": row}, flush=True)
    return row


def train_rows(args):
    from meshlab.bench.train import build
    from meshlab.train.state import init_state
    mesh = make_mesh("data=1", devices=jax.devices()[:1])
    dense_rules = R.load_rules("dp")
    ep = R.load_rules("ep")
    variants = [] if "dense" in args.skip else [(f"{args.dense} (dense, same active width)", args.dense, dense_rules)]
    # MoE variants: (label, preset, rules, model.gemm)
    for mode in args.modes.split(","):
        for n in (int(c) for c in args.chunks.split(",")):
            for gemm in args.train_gemm.split(","):
                rules = dataclasses.replace(ep, strategies={**ep.strategies, "experts": {
                    "dispatch": mode, "capacity_factor": 1.25, "chunks": n}})
                variants.append((f"{args.model} {mode}" + (f", {n} chunks" if n > 1 else "")
                                 + (f", gemm {gemm}" if gemm != "auto" else ""), args.model, rules, gemm))
    rows = []
    for label, name, rules, *gemm in variants:
        cfg = dataclasses.replace(models.preset(name), dtype="bfloat16", attention=args.attention, remat=args.remat)
        if gemm:
            cfg = dataclasses.replace(cfg, gemm=gemm[0])
        if args.layers:   # fewer layers: the model's state and step fit a smaller card (an 80 GB H100)
            cfg = dataclasses.replace(cfg, n_layers=args.layers)
            label += f", {args.layers} layers"
        try:
            md, tx, sh, step, b = build(cfg, rules, mesh, args.batch, args.seq)
            state = init_state(md, tx, sh, 0, False)
            t0 = time.perf_counter()
            state, m = step(state, b)
            float(m["loss"])
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                state, m = step(state, b)
                loss = float(m["loss"])
                times.append(time.perf_counter() - t)
            metrics = {k: float(v) for k, v in jax.device_get(m).items() if k.startswith("moe_")}
            del state
            dt = float(np.median(times))
            tok_s = args.batch * args.seq / dt
            fl = cfg.train_flops_per_token(args.seq)
            row = {"variant": label, "tokens_per_s": round(tok_s), "step_ms": round(dt * 1e3, 1),
                   "mfu": tok_s * fl / PEAK, "loss": round(loss, 3), "compile_s": round(compile_s, 1),
                   "active_params": cfg.matmul_param_count(), **metrics}
            if not np.isfinite(loss):
                row = {"variant": label, "error": f"non-finite loss {loss}"}
        except Exception as ex:
            row = {"variant": label, "error": f"{type(ex).__name__}: {str(ex)[:200]}"}
        rows.append(row)
        print(row, flush=True)
    return rows


def write(dev, gemm, train, peer, args):
    date = datetime.date.today().isoformat()
    lines = [f"\n### MoE ({date}, {dev.device_kind}, jax {jax.__version__})\n"]
    if gemm:
        lines += [f"Grouped GEMM {args.m} x {args.k} x {args.n} bf16, skewed groups; TFLOP/s of useful work (2MKN).\n",
                  "| experts | variant | ms | TFLOP/s | rel err vs ragged_dot |", "|---|---|---|---|---|"]
    for r in gemm:
        lines.append(f"| {r['experts']} | {r['variant']} | " + (f"FAILED: {r['error']} | | |" if "error" in r else
                     f"{r['ms']} | {r['tflops']} | {r['rel_err']:.1e} |"))
    for e in sorted({r["experts"] for r in gemm}):
        bare = max((r["tflops"] for r in gemm if r["experts"] == e and "bare" in r["variant"] and "tflops" in r),
                   default=None)   # not `peer`: that name is the Mixtral peer's row, written below
        ours = [r["tflops"] for r in gemm if r["experts"] == e and r["variant"].startswith("ours:") and "tflops" in r]
        if bare and ours:
            lines.append(f"\n{e} experts: ours / Mosaic ragged dot = {ours[0] / bare:.3f} (must be >= 0.9 at 16).")
        best = lambda prefix: max((r["tflops"] for r in gemm if r["experts"] == e  # noqa: E731
                                   and r["variant"].startswith(prefix) and "tflops" in r), default=None)
        tri, tri_bwd = best("triton: "), best("triton fwd+bwd")
        xla_bwd = best("jax.lax.ragged_dot fwd+bwd")
        xla = next((r["tflops"] for r in gemm if r["experts"] == e and r["variant"] == "jax.lax.ragged_dot"
                    and "tflops" in r), None)
        parts = [f"{name} = {a / b:.2f}" for name, a, b in (
            ("triton / lax.ragged_dot fwd", tri, xla), ("fwd+bwd", tri_bwd, xla_bwd),
            ("triton / Mosaic ragged dot fwd", tri, bare)) if a and b]
        if parts:
            lines.append(f"\n{e} experts: " + ", ".join(parts) + ".")
    if train or peer:
        lines += [f"\nTraining, batch {args.batch} x seq {args.seq}, attention {args.attention}, remat {args.remat}; "
                  f"MFU = tokens/s x (6 N_active + 6 L S d) / {PEAK / 1e12:g} TFLOP/s.\n",
                  "| variant | tokens/s | step ms | MFU | loss | dropped | tokens/expert CV | compile s |",
                  "|---|---|---|---|---|---|---|---|"]
    for r in train:
        lines.append(f"| {r['variant']} | " + (f"FAILED: {r['error']} | | | | | | |" if "error" in r else
                     f"{r['tokens_per_s']:,} | {r['step_ms']} | {100 * r['mfu']:.1f}% | {r['loss']} | "
                     f"{r.get('moe_dropped_frac', 0):.3f} | {r.get('moe_tokens_cv', 0):.2f} | {r['compile_s']} |"))
    if peer:
        lines.append(f"| peer: {peer.get('peer', '')} | " + (f"FAILED: {peer['error'][:200]} | | | | | | |"
                     if "error" in peer else f"{round(peer['tokens_per_s']):,} | {peer['step_ms']:.1f} | "
                     f"{100 * peer['mfu']:.1f}% | {peer['loss']:.3f} | | | |"))
    dense = next((r for r in train if "dense" in r["variant"] and "mfu" in r), None)
    def first_like(label):
        return next((b for b in train if "step_ms" in b and b["variant"] == label), None)
    for r in train:
        one_piece = re.sub(r", \d+ chunks", "", r["variant"])
        base, chunked = first_like(one_piece), one_piece != r["variant"]          # the same variant in 1 piece
        gemm_of = re.search(r", gemm (\w+)", r["variant"])
        auto = first_like(r["variant"].replace(gemm_of.group(0), "")) if gemm_of else None
        if auto and "step_ms" in r:
            lines.append(f"\n{r['variant']}: step {100 * (r['step_ms'] / auto['step_ms'] - 1):+.1f}% against "
                         f"model.gemm=auto ({gm.resolve_backend('auto')}).")
        if dense and "mfu" in r and r is not dense and r is base:
            lines.append(f"\n{r['variant']}: {r['mfu'] / dense['mfu']:.2f} of the dense model's MFU (must be >= 0.60).")
        if peer and "tokens_per_s" in peer and "mfu" in r and r is not dense and r is base:
            lines.append(f"\n{r['variant']}: {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x the Mixtral peer's tokens/s.")
        if chunked and base and "step_ms" in r:
            lines.append(f"\n{r['variant']}: step {100 * (r['step_ms'] / base['step_ms'] - 1):+.1f}% against 1 piece "
                         "(one device: no all-to-all to hide, only the pieces' partial weight-gradient sums).")
    text = "\n".join(lines) + "\n"
    print(text)
    diary.append(text, backend=jax.default_backend())
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_moe.json").write_text(json.dumps({"gemm": gemm, "train": train, "peer": peer},
                                                                        indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=32768)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=1536)
    p.add_argument("--experts", default="8,16,64")
    p.add_argument("--model", default="moe_1b_8e")
    p.add_argument("--dense", default="llama3_1b", help="the dense model of the same active size")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--attention", default="cudnn")
    p.add_argument("--remat", default="none")
    p.add_argument("--modes", default="dropless,capacity", help="expert dispatch modes timed")
    p.add_argument("--chunks", default="1", help="dispatch pieces timed per mode, e.g. 1,2,4")
    p.add_argument("--peer-timeout", type=float, default=300)
    p.add_argument("--skip", default="", help="any of gemm, train, dense, peer")
    p.add_argument("--layers", type=int, default=0, help="train rows with this many layers (0: the preset's)")
    p.add_argument("--train-gemm", default="auto", help="model.gemm values the MoE training rows run, e.g. auto,triton")
    p.add_argument("--gemm-backends", default="mosaic,triton,xla",
                   help="grouped GEMM backends timed (mosaic rows only on Hopper)")
    args = p.parse_args()
    # the peer first, in its own process, before this one's JAX takes the GPU's memory
    peer = {} if "peer" in args.skip or "train" in args.skip else run_peer(args)
    dev = jax.devices()[0]
    backends = tuple(b for b in args.gemm_backends.split(",") if b)
    if not set(backends) <= {"mosaic", "triton", "xla"}:
        sys.exit(f"--gemm-backends={args.gemm_backends!r} must name mosaic, triton or xla")
    if "gemm" not in args.skip and jax.default_backend() != "gpu":
        sys.exit(f"bench_moe.py's GEMM part needs a GPU (found {dev.device_kind}); --skip gemm")
    if "gemm" not in args.skip and "mosaic" in backends and not gm.on_hopper():
        print(f"no mosaic rows: the Mosaic kernels need a Hopper GPU (found {dev.device_kind})", flush=True)
    tiles = [gm.Tiles(), gm.Tiles(grid_block_n=1), gm.Tiles(grid_block_n=4),
             gm.Tiles(block_n=256, max_concurrent_steps=3, grid_block_n=1),
             gm.Tiles(block_m=64, grid_block_n=2), gm.Tiles(max_concurrent_steps=5)]
    gemm = [] if "gemm" in args.skip else gemm_rows(args.m, args.k, args.n,
                                                     [int(e) for e in args.experts.split(",")], tiles, backends)
    train = [] if "train" in args.skip else train_rows(args)
    write(dev, gemm, train, peer, args)


if __name__ == "__main__":
    main()
