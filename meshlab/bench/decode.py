"""Decode measurements that scripts/bench_decode.py runs, one process per XLA flag set.

Each function returns rows (dicts: section, setting, value, unit, note, plus details) and the
script's child process prints each as a `ROW {json}` line as soon as it exists, so a process
killed at its time limit still hands back everything measured before.

`hlo_traffic` reads the optimized HLO of a compiled decode program and counts, per generated
token, the bytes written by instructions with a large result (copies of weight slices, KV
gathers, transposes) and the number of kernel-launching instructions. For a bandwidth-bound
decode step those bytes are the waste: a weight slice copied before its GEMM is read, written
and read again (3x the bytes the step needs).
"""
from __future__ import annotations

import collections
import functools
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.bench.timing import median_time
from meshlab.infer import kv_cache
from meshlab.infer.engine import ContiguousGenerator, Engine
from meshlab.infer.programs import make_programs, serving_params
from meshlab.infer.sampler import SamplingParams, row_arrays
from meshlab.plan.hlo import COMPUTATION, shape_bytes

ROW_PREFIX = "ROW "


def emit(row: dict) -> dict:
    print(ROW_PREFIX + json.dumps(row, default=float), flush=True)
    return row


def weights_read_per_step(params, cfg, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` rows reads: every leaf once, except a mixture of
    experts' routed experts (only those the rows touch, `_share_read`) and an untied
    embedding table, of which each row reads only its token's row (a tied one is read whole as the
    LM head). Counting an untied table whole would lower the roofline by its share of the bytes
    (6.5% at llama3_8b) and raise every fraction of it."""
    total = int(sum(x.nbytes * _share_read(path, cfg, batch) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]))
    if cfg.tie_embeddings:
        return total
    embed = params["embed"]                                           # [V, d]
    return total - embed.nbytes + batch * embed.nbytes // embed.shape[0]


ROUTED_NK = ("experts_gate_up_t", "experts_down_t")


def _share_read(path, cfg, batch: int) -> float:
    """The share of a leaf one step reads: 1, or for a mixture of experts' routed expert weights
    ([..., E, ...] under `moe`, not its shared expert) the experts the step's rows are expected to
    touch, E (1 - (1 - k/E)^batch) of E: each row routes to k distinct experts, taken here as uniform
    (a random router's; a trained one's skew touches fewer, so the roofline is then a little low).
    Serving's kernels layers hold the routed experts as `experts_*_t` (programs._experts_nk)."""
    n_experts = getattr(cfg, "n_experts", 0)
    keys = [getattr(k, "key", None) for k in path]
    routed = keys[-1] in ROUTED_NK or (len(keys) >= 2 and keys[-2] == "moe" and keys[-1] in ("w_gate", "w_up", "w_down"))
    if not n_experts or not routed:
        return 1.0
    return 1.0 - (1.0 - cfg.top_k / n_experts) ** batch


def timeit(fn, reps=5) -> float:
    """Median seconds of `reps` calls after one warm call."""
    return median_time(fn, warmup=1, reps=reps)


def copy_bandwidth(nbytes: int = 1 << 30, donate: bool = False) -> float:
    """Bytes/s of an elementwise pass over `nbytes` (read + write): the card's usable HBM rate.
    donate=True updates the buffer in place (no fresh output allocation per call)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    if not donate:
        f = jax.jit(lambda a: a * 1.000001)
        return 2 * x.nbytes / timeit(lambda: f(x), reps=10)
    f = jax.jit(lambda a: a * 1.000001, donate_argnums=0)
    state = {"x": x}

    def run():
        state["x"] = f(state["x"])
        return state["x"]
    return 2 * x.nbytes / timeit(run, reps=10)


def torch_copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> dict:
    """The same read + write rate measured by torch (CUDA events, no JAX in the process): a copy
    into a second buffer and an in-place scale. The peer check on `copy_bandwidth`."""
    import torch
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return {name: 2 * x.nbytes / torch_event_seconds(op, reps)
            for name, op in (("copy_", lambda: y.copy_(x)), ("mul_", lambda: x.mul_(1.0)))}


def torch_event_seconds(op, reps: int = 20) -> float:
    """Median seconds of the CUDA work `op()` queues, timed by CUDA events after one warm call."""
    import torch
    op()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        op()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# -- HLO traffic ------------------------------------------------------------------------------
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([a-z][\w\-]*)\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "add-dependency", "opt-barrier", "optimization-barrier"}
_IN_PLACE = ("dynamic-update-slice", "scatter")


def _category(ops: set) -> str:
    if any(o in ops for o in _IN_PLACE):
        return "in-place update"
    for cat, keys in (("gemm", ("dot", "custom-call", "convolution")), ("gather", ("gather",)),
                      ("slice copy", ("dynamic-slice", "slice")), ("copy/transpose", ("copy", "transpose")),
                      ("reduce", ("reduce", "reduce-window", "sort"))):
        if any(k in ops for k in keys):
            return cat
    return "elementwise"


def hlo_traffic(text: str, tokens: int, min_bytes: int = 1 << 20, top: int = 8) -> dict:
    """Per token: MB written by instructions whose result is >= min_bytes (in-place updates and
    GEMMs excluded), split by category, the largest ones, and kernel-launching instructions."""
    comps: dict[str, list] = {}       # computation -> [(name, op, shape text, line)]
    entry, comp = None, None
    for line in text.splitlines():
        m = COMPUTATION.match(line)
        if m:
            comp = m.group(1)
            comps[comp] = []
            if line.lstrip().startswith("ENTRY"):
                entry = comp
            continue
        i = _INSTR.match(line)
        if i and comp is not None:
            comps[comp].append((i.group(1), i.group(3), i.group(2), line))
    ops_of = {c: {op for _, op, _, _ in instrs} for c, instrs in comps.items()}
    mult = collections.Counter({entry: 1})
    order, seen = [entry], {entry}
    for c in order:                    # breadth-first: while bodies x trip count, branches/calls x 1
        for name, op, _, line in comps.get(c, ()):
            callees = []
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", line)
                trip = _TRIP.search(line)
                callees = [(body.group(1), int(trip.group(1)) if trip else 1)] if body else []
            elif op in ("conditional", "call") or (op.startswith("async") and "calls=" in line):
                names = re.findall(r"(?:branch_computations=\{|to_apply=|calls=|true_computation=|"
                                   r"false_computation=)([^}\s]+)", line)
                callees = [(n.strip("%,"), 1) for group in names for n in group.split(",")]
            for callee, k in callees:
                mult[callee] += mult[c] * k
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    by_cat, big, kernels = collections.Counter(), [], 0
    for c in order:
        for name, op, shape, line in comps.get(c, ()):
            if op in _NO_KERNEL or op.startswith("async") and "calls=" in line:
                continue
            kernels += mult[c]
            called = re.search(r"calls=%?([\w.\-]+)", line)
            cat = _category(ops_of.get(called.group(1), set()) if called and op == "fusion" else {op})
            nbytes = shape_bytes(shape)
            # GEMM results are the step's activations (and a cuBLAS call's tuple holds its workspace)
            if cat in ("in-place update", "gemm") or nbytes < min_bytes:
                continue
            by_cat[cat] += nbytes * mult[c]
            big.append((nbytes * mult[c], name, shape.split("{")[0], cat, mult[c]))
    big.sort(reverse=True)
    mb = lambda b: round(b / tokens / 1e6, 2)
    return {"written_mb_per_token": mb(sum(by_cat.values())), "kernels_per_token": round(kernels / tokens, 1),
            "by_category_mb": {k: mb(v) for k, v in by_cat.most_common()},
            "top": [f"{n} {s} {cat} x{m / tokens:g}/token = {mb(b)} MB" for b, n, s, cat, m in big[:top]]}


# -- decode steps -----------------------------------------------------------------------------
def decode_state(cfg, batch, ctx, page_size=16):
    """A paged cache where every row holds ctx tokens' pages (values irrelevant for timing)."""
    pages = ctx // page_size
    cache = kv_cache.init_paged(cfg, batch * pages + 1, page_size)
    table = (1 + np.arange(batch * pages, dtype=np.int32)).reshape(batch, pages)
    return cache, jnp.asarray(table)


def measure_decode(md, params, bw, batch, ctx, *, impl="xla", layers="split", n=32, reps=3, label="",
                   hlo_file=None, profile_dir=None, layout="paged") -> dict:
    """Tokens/s of `n` greedy decode steps per call at context `ctx` (paged cache, or a contiguous
    one of exactly ctx rows: the attention's reference cost without the page gather), against the
    roofline: bytes of weights + KV read per step over the copy bandwidth `bw`."""
    cfg = md.cfg
    served = serving_params(md, params, layers)
    _, loop = make_programs(md, layout, impl, interpret=jax.default_backend() != "gpu", layers=layers)
    if layout == "contiguous":
        cache, table = kv_cache.init_contiguous(cfg, batch, ctx), jnp.zeros((batch, 1), jnp.int32)
    else:
        cache, table = decode_state(cfg, batch, ctx)
    seen = jnp.zeros((batch, cfg.vocab_size), bool)
    rows = row_arrays([SamplingParams()] * batch)
    tok, pos = np.ones(batch, np.int32), np.full(batch, ctx - n, np.int32)
    active, counters = np.ones(batch, bool), np.zeros(batch, np.int32)
    t0 = time.perf_counter()
    compiled = loop.lower(served, cache, seen, tok, pos, active, table, rows, counters, n=n, greedy=True).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    traffic = hlo_traffic(text, n)
    if hlo_file:
        import gzip
        with gzip.open(hlo_file, "wt") as fh:
            fh.write(text)
    state = {"cache": cache, "seen": seen}

    def run():
        toks, state["cache"], state["seen"] = compiled(served, state["cache"], state["seen"], tok, pos, active,  # noqa: F821
                                                       table, rows, counters)
        return toks
    first = np.asarray(run())[:, 0].tolist()                                      # greedy tokens of row 0
    step = timeit(run, reps=reps) / n
    moved = weights_read_per_step(served, cfg, batch) + batch * ctx * kv_cache.cache_bytes(cfg, 1)
    where = "" if layout == "paged" else f" {layout}"
    row = {"section": "decode", "setting": f"{label or layers}{where} {impl} b={batch} ctx={ctx}",
           "value": batch / step, "unit": "tok/s", "batch": batch, "ctx": ctx, "layers": layers, "impl": impl, "layout": layout,
           "tpot_ms": step * 1e3, "gbps": moved / step / 1e9, "frac_copy_bw": moved / step / bw,
           "roofline_tok_s": bw / moved * batch, "compile_s": round(compile_s, 1), "hlo": traffic,
           "tokens": first,
           "note": f"TPOT {step * 1e3:.2f} ms, {moved / step / 1e9:.0f} GB/s = {moved / step / bw:.0%} of copy bw "
                   f"(roofline {bw / moved * batch:.0f} tok/s); HLO: {traffic['written_mb_per_token']} MB of "
                   f"large writes, {traffic['kernels_per_token']} kernels per token"}
    if profile_dir:
        row["profile"] = profile(run, profile_dir, n, step)
    del served, state, cache
    return row


def profile(run, trace_dir, n, step_s) -> dict:
    """Device time per token by kernel class from a Perfetto trace of one call (XLA replaces
    command buffers by op-by-op launches while profiling, so busy% is a lower bound)."""
    from meshlab.profile_summary import summarize
    try:
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            jax.block_until_ready(run())
        s = summarize(trace_dir, steps=n, top=40)
    except Exception as e:  # noqa: BLE001 - a profile is a bonus, never a failure
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    return {"busy_ms_per_token": round(s["busy_ms_per_step"], 3), "tpot_ms": round(step_s * 1e3, 3),
            "classes": [(c, round(t, 3)) for c, t, _ in s["classes"]],
            "kernels": [(k, round(t, 3), c) for k, t, c, _ in s["kernels"]]}


def engine_profile(engine, trace_dir, ctx: int = 2048, n: int = 64) -> dict:
    """Where a batch-1 token goes through `Engine` (the user's path: host scheduling, chained decode
    calls, sampling on device): one request at context ~ctx decodes n tokens twice after its first
    token (cached prompt, programs compiled): untimed by the profiler, for the wall time and the
    engine's own counters per token (host time, device calls), with decode calls chained and (the
    A/B) read back one by one; then traced, for the device time
    per kernel (profiling runs the ops one by one, so only the kernel times of that run count)."""
    prompt, sp = list(range(1, ctx - n // 2)), SamplingParams(max_tokens=n)   # contexts average ctx
    engine.generate([prompt], sp)                                              # compiles, caches the prompt

    def decode(trace: bool) -> tuple[float, dict, int]:
        req = engine.add_request(prompt, sp)
        while not req.output:                                                  # the cached tail, first token
            engine.step()
        before, t = dict(engine.stats), time.perf_counter()
        if trace:
            with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                engine.run()
        else:
            engine.run()
        return time.perf_counter() - t, {k: engine.stats[k] - before[k] for k in before}, len(req.output) - 1
    engine.chain_decode = False                  # the A/B: every decode call read back before the next
    unchained, _, _ = decode(False)
    engine.chain_decode = True
    wall, st, tokens = decode(False)
    row = {"section": "profile", "setting": f"engine b=1 ctx={ctx}, {tokens} decode tokens", "unit": "us/token",
           "value": wall / tokens * 1e6, "wall_ms_per_token": wall / tokens * 1e3,
           "unchained_ms_per_token": unchained / tokens * 1e3,
           "host_ms_per_token": st["host_s"] / tokens * 1e3, "device_calls": st["device_calls"],
           "dispatch_ms_per_call": st.get("dispatch_s", 0.0) / max(st["device_calls"], 1) * 1e3,
           "decode_steps_per_call": st["steps"] / max(st["decode_calls"], 1)}
    s = _kernel_table(row, trace_dir, lambda: decode(True)[2])
    busy = (f"device busy {s['busy_ms_per_step'] * 1e3:.0f} us/token ({s['busy_ms_per_step'] / row['wall_ms_per_token']:.0%})"
            if s else "no profile")
    row["note"] = (f"wall {row['wall_ms_per_token'] * 1e3:.0f} us/token chained ({unchained / tokens * 1e6:.0f} "
                   f"unchained), host {row['host_ms_per_token'] * 1e3:.0f} us/token (overlapped when calls chain; dispatch "
                   f"{row['dispatch_ms_per_call'] * 1e3:.0f} us per call), "
                   f"{row['decode_steps_per_call']:.1f} steps per call; {busy}")
    return row


def _kernel_table(row: dict, trace_dir, run_traced) -> dict | None:
    """Run `run_traced()` (it writes a trace to trace_dir and returns the steps it traced) and add its
    per-kernel summary to `row`; on failure the row carries the error (a profile is a bonus)."""
    from meshlab.profile_summary import summarize
    try:
        s = summarize(trace_dir, steps=run_traced(), top=40)
    except Exception as e:  # noqa: BLE001 - a profile is a bonus, never a failure
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        return None
    row.update(busy_ms_per_token=round(s["busy_ms_per_step"], 4), classes=[(c, round(t, 4)) for c, t, _ in s["classes"]],
               kernels=[(k, round(t * 1e3, 2), round(c, 2)) for k, t, c, _ in s["kernels"]])
    return s


def correctness_gate(impls=("xla", "pallas"), layers="split", preset="llama3_1b", max_seqs=2) -> dict:
    """`preset` widths, 2 layers, fp32 (highest matmul precision): cached greedy decode
    (contiguous, paged per impl) must equal the argmax of the uncached forward at every step.
    max_seqs=1 runs the prompts one at a time (the batch-1 decode program).
    Returns path -> "ok" or the failure."""
    import dataclasses
    import models
    from meshlab.infer.loading import random_params
    from models import model_def
    cfg = dataclasses.replace(models.preset(preset), n_layers=2, dtype="float32",
                              init_std=0.2 if preset == "tiny" else 0.05)   # spread logits: no argmax ties
    md, params = model_def(cfg), random_params(cfg, seed=1)
    prompts = [list(range(200, 213)), list(range(5, 40))]        # inside any vocabulary (tiny: 257)
    interpret = jax.default_backend() != "gpu"
    result = {}
    with jax.default_matmul_precision("highest"):
        fwd = jax.jit(lambda p, x: md.bind(p)(x)[..., :cfg.vocab_size])
        makers = {"contiguous": lambda: ContiguousGenerator(md, params, batch=2, max_len=64, chunk=32,
                                                            steps_per_call=4, layers=layers).generate(
                                                                prompts, SamplingParams(max_tokens=12))}
        for impl in impls:
            makers[f"paged-{impl}"] = lambda impl=impl: [r.output for r in Engine(
                md, params, max_len=64, max_seqs=max_seqs, page_size=16, chunk=32, steps_per_call=4, impl=impl,
                interpret=interpret, layers=layers).generate(prompts, SamplingParams(max_tokens=12))]
        for name, make in makers.items():
            try:
                out = make()
                bad = []
                for p, o in zip(prompts, out):
                    ref = np.asarray(fwd(params, jnp.asarray([p + o])))[0, len(p) - 1:-1].argmax(-1).tolist()
                    if ref != o:
                        bad.append(f"{o} vs {ref}")
                result[name] = "ok" if not bad else "cached greedy != uncached argmax: " + "; ".join(bad)[:200]
            except Exception as e:  # noqa: BLE001 - a path that fails to compile is reported
                result[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return result


def kernel_peers(cfg, bw, batch, ctx=2048, page_size=16, configs=None, layers=None) -> list[dict]:
    """Decode attention of one layer at `batch` x `ctx` (bf16, scattered pages): ours (Pallas) in each
    BlockSizes configuration, the gather + dense XLA path, JAX's Pallas paged_attention, and JAX's
    decode_attention on the same K/V laid out contiguously. Each is jitted with the data as arguments,
    checked against an fp32 reference, then timed (us per call; % of copy bandwidth for the K+V bytes).

    configs: {label: BlockSizes} for ours (default: the kernel's named CONFIGS on GPU; on CPU, where
    interpret mode takes seconds per configuration, only the default "dot8").
    layers: also time ours and XLA over a stacked [layers, ...] cache, one call per layer inside ONE jit
    (a python loop over layer indices, the cache read in place), reported per layer: the time without
    dispatch, and with the layers' K/V (67 MB at llama3_1b b=1) past the 50 MB L2 that a single layer's
    4 MB sits in when one call is repeated. None: cfg.n_layers on GPU, none in CPU interpret mode."""
    import importlib
    import math

    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference, plan
    from pallas_kernels.paged_tiles import CONFIGS
    interpret = jax.default_backend() != "gpu"
    if configs is None:
        configs = CONFIGS if not interpret else {"dot8": CONFIGS["dot8"]}
    n_layers = (0 if interpret else cfg.n_layers) if layers is None else layers
    kvh, h, d, g = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
    pages = ctx // page_size
    kq, kk, kv_ = jax.random.split(jax.random.key(0), 3)
    shape = (batch * pages, page_size, kvh, d)
    k = jax.random.normal(kk, shape, jnp.bfloat16)
    v = jax.random.normal(kv_, shape, jnp.bfloat16)
    q = jax.random.normal(kq, (batch, h, d), jnp.bfloat16)
    table = jnp.asarray(np.random.default_rng(0).permutation(batch * pages).reshape(batch, pages), jnp.int32)
    lengths = jnp.full((batch,), ctx, jnp.int32)
    f32 = lambda x: x.astype(jnp.float32)
    ref = paged_attention_reference(f32(q), f32(k), f32(v), table, lengths)
    kv_bytes = 2 * k.nbytes

    # JAX's paged_attention: K/V [kv_heads, pages, page_size, d]; it applies no 1/sqrt(d) (q comes
    # pre-scaled); lengths are token counts as ours. decode_attention: gqa takes K/V [b, seq, kv_heads, d]
    # and transposes them to head-major inside its jit (a copy, timed with it); mqa over b*kv_heads rows
    # on head-major K/V is the kernel gqa runs, without that copy.
    qs = (f32(q) * d ** -0.5).astype(q.dtype)
    kt, vt = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))
    kc, vc = (x[table].reshape(batch, ctx, kvh, d) for x in (k, v))             # contiguous [b, s, kvh, d]
    kh, vh = (jnp.transpose(x, (0, 2, 1, 3)).reshape(batch * kvh, ctx, d) for x in (kc, vc))
    impls = {}                                                                    # label -> (fn, args, extra)
    for name, bs in configs.items():
        p = plan(bs, batch, kvh, pages, page_size, g, d)
        impls[f"ours[{name}]"] = (functools.partial(paged_attention, block_sizes=bs, interpret=interpret),
                                  (q, k, v, table, lengths),
                                  {"config": name, "block_sizes": str(bs), "splits": p["splits"],
                                   "pages_per_block": p["pages_per_block"], "dot": p["use_dot"]})
    impls["xla_gather"] = (paged_attention_reference, (q, k, v, table, lengths), {})
    splits = math.gcd(pages, 16)                  # JAX's kernels need the splits to divide the pages
    ops = lambda name: importlib.import_module(f"jax.experimental.pallas.ops.gpu.{name}")  # at trace: a missing
    impls["jax_paged_attention"] = (                                                     # module is a FAILED row
        lambda q, k, v, t, n: ops("paged_attention").paged_attention(
            q, k, v, t, n, pages_per_compute_block=8, k_splits=splits, interpret=interpret),
        (qs, kt, vt, table, lengths), {})
    impls["jax_decode_gqa+transpose"] = (
        lambda q, k, v, n: ops("decode_attention").gqa(q, k, v, kv_seq_len=n, k_splits=splits, interpret=interpret),
        (q, kc, vc, lengths), {})
    impls["jax_decode_mqa_headmajor"] = (
        lambda q, k, v, n: ops("decode_attention").mqa(q.reshape(-1, g, d), k, v, kv_seq_len=jnp.repeat(n, kvh),
                                                       k_splits=splits, interpret=interpret).reshape(q.shape),
        (q, kh, vh, lengths), {})

    if n_layers:
        # layer l holds K and V * (l+1)/L: its output is (l+1)/L * ref, so a wrong layer shows as an error
        scale = (jnp.arange(n_layers, dtype=jnp.float32) + 1) / n_layers
        ks = jax.jit(lambda k: jnp.broadcast_to(k, (n_layers, *k.shape)) + jnp.zeros((), k.dtype))(k)
        vs = jax.jit(lambda v: (f32(v)[None] * scale[:, None, None, None, None]).astype(v.dtype))(v)
        ref_stack = ref[None] * scale[:, None, None, None]

        def stacked(one):
            return lambda q, ks, vs, t, n: jnp.stack([one(q, ks, vs, t, n, l) for l in range(n_layers)])
        for name, bs in configs.items():
            impls[f"ours[{name}] x{n_layers}L"] = (
                stacked(lambda q, ks, vs, t, n, l, bs=bs: paged_attention(q, ks, vs, t, n, jnp.int32(l), block_sizes=bs,
                                                                          interpret=interpret)),
                (q, ks, vs, table, lengths), {"config": name, "block_sizes": str(bs), "layers": n_layers})
        impls[f"xla_gather x{n_layers}L"] = (
            stacked(lambda q, ks, vs, t, n, l: paged_attention_reference(q, ks[l], vs[l], t, n)),
            (q, ks, vs, table, lengths), {"layers": n_layers})

    out = []
    for name, (fn, args, extra) in impls.items():
        per = extra.get("layers", 1)
        want = ref_stack if per > 1 else ref
        setting = f"{name} b={batch} ctx={ctx}"
        base = {"section": "kernel", "setting": setting, "unit": "us", **extra}
        try:
            f = jax.jit(fn)
            err = float(jnp.max(jnp.abs(f32(f(*args)) - want)))
            if not err <= 5e-2:                                                   # NaN is wrong too
                out.append(emit({**base, "value": float("nan"), "note": f"WRONG: max error {err:.1e}"}))
                continue
            t = timeit(lambda: f(*args), reps=10) / per
            how = f"per layer, {per} layers in one jit; " if per > 1 else ""
            out.append(emit({**base, "value": t * 1e6,
                             "note": f"{how}{kv_bytes / t / bw:.0%} of copy bw, max error {err:.1e}"}))
        except Exception as e:  # noqa: BLE001 - a peer that fails here is reported, not fatal
            out.append(emit({**base, "value": float("nan"), "note": f"FAILED {type(e).__name__}: {str(e)[:200]}"}))
    return out


def fail_row(section: str, setting: str, e: BaseException) -> dict:
    print(f"{section} {setting} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return emit({"section": section, "setting": setting, "value": float("nan"), "unit": "",
                 "note": f"FAILED {type(e).__name__}: {str(e)[:200]}"})
