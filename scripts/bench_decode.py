"""Decode benchmark (llama3_1b shape, bf16): batch-1 tokens/s against the HBM roofline, batch
1..256 throughput at 2k context, TTFT for 512..8k prompts, engine alone and through HTTP.

    PYTHONPATH=$PWD python3 scripts/bench_decode.py [--quick]

First a correctness gate: llama3_1b widths with 2 layers in fp32 (highest matmul precision),
cached greedy decode (contiguous, paged, paged + Pallas kernel) must equal the argmax of the
uncached forward at every step, or nothing is timed. The roofline is the bytes of weights plus
KV read per decode step over the copy bandwidth measured in this call. Prints a table and
appends dated rows to docs/benchmarks.md under "## Decode". Random weights: speed only.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from meshlab.infer import kv_cache  # noqa: E402
from meshlab.infer.engine import ContiguousGenerator, Engine, make_programs  # noqa: E402
from meshlab.infer.loading import random_params  # noqa: E402
from meshlab.infer.sampler import SamplingParams, row_arrays  # noqa: E402
from meshlab.train.state import model_def  # noqa: E402

ROWS: list[tuple] = []      # (section, setting, value, unit, note)


def timeit(fn, reps=5):
    fn()                                                          # compile + warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth():
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)               # 1 GiB
    f = jax.jit(lambda a: a * 1.000001)
    return 2 * x.nbytes / timeit(lambda: f(x), reps=10)           # read + write


def correctness_gate(interpret: bool):
    cfg = dataclasses.replace(models.preset("llama3_1b"), n_layers=2, dtype="float32", init_std=0.05)
    md, params = model_def(cfg), random_params(cfg, seed=1)
    prompts = [list(range(1000, 1013)), list(range(5, 40))]
    with jax.default_matmul_precision("highest"):
        fwd = jax.jit(lambda p, x: md.bind(p)(x)[..., :cfg.vocab_size])
        gen = ContiguousGenerator(md, params, batch=2, max_len=64, chunk=32, steps_per_call=4)
        outs = {"contiguous": gen.generate(prompts, SamplingParams(max_tokens=12))}
        for impl in ("xla", "pallas"):
            eng = Engine(md, params, max_len=64, max_seqs=2, page_size=16, chunk=32, steps_per_call=4, impl=impl,
                         interpret=interpret)
            outs[f"paged-{impl}"] = [r.output for r in eng.generate(prompts, SamplingParams(max_tokens=12))]
        for name, out in outs.items():
            for p, o in zip(prompts, out):
                ref = np.asarray(fwd(params, jnp.asarray([p + o])))[0, len(p) - 1:-1].argmax(-1).tolist()
                if ref != o:
                    sys.exit(f"bench_decode: {name} cached greedy != uncached argmax ({o} vs {ref}); not timing")
    print("correctness: cached greedy == uncached argmax (contiguous, paged-xla, paged-pallas), fp32")


def decode_state(cfg, batch, ctx, page_size=16):
    """A paged cache where every row already holds ctx - n tokens (values irrelevant for timing)."""
    pages = ctx // page_size
    cache = kv_cache.init_paged(cfg, batch * pages + 1, page_size)
    table = (1 + np.arange(batch * pages, dtype=np.int32)).reshape(batch, pages)
    return cache, jnp.asarray(table)


def bench_decode(md, params, weight_bytes, bw, batches, ctx, impl, n=16, unroll=False):
    cfg = md.cfg
    _, loop = make_programs(md, "paged", impl, interpret=jax.default_backend() != "gpu", unroll=unroll)
    impl += "+unrolled" if unroll else ""
    kv_tok = kv_cache.cache_bytes(cfg, 1)
    tpot1 = None
    for b in batches:
        cache, table = decode_state(cfg, b, ctx)
        seen = jnp.zeros((b, cfg.vocab_size), bool)
        rows = row_arrays([SamplingParams()] * b)
        tok, pos = np.ones(b, np.int32), np.full(b, ctx - n, np.int32)
        active, counters = np.ones(b, bool), np.zeros(b, np.int32)
        state = {"cache": cache, "seen": seen}

        def run():
            toks, state["cache"], state["seen"] = loop(params, state["cache"], state["seen"], tok, pos, active,
                                                       table, rows, counters, n=n)
            return toks
        step = timeit(run, reps=3) / n
        tpot1 = tpot1 or step
        moved = weight_bytes + b * ctx * kv_tok
        roof = bw / moved * b
        ROWS.append(("decode", f"{impl} b={b} ctx={ctx}", b / step, "tok/s",
                     f"TPOT {step * 1e3:.2f} ms ({step / tpot1:.2f}x b=1), {moved / step / 1e9:.0f} GB/s = "
                     f"{moved / step / bw:.0%} of copy bw, roofline {roof:.0f} tok/s"))
        print(ROWS[-1])
        del cache, state


def bench_ttft(engine, lengths, label):
    rng = np.random.default_rng(0)
    for n in lengths:
        prompt = rng.integers(0, engine.md.cfg.vocab_size, size=n).tolist()
        engine.generate([prompt], SamplingParams(max_tokens=1))              # warm (compiles once)
        t = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1))
        ROWS.append(("ttft", f"{label} prompt={n}", (time.perf_counter() - t) * 1e3, "ms", ""))
        print(ROWS[-1])


def engine_tpot(engine, label, ctx=512, n=256):
    prompt = list(range(1, ctx))
    engine.generate([prompt], SamplingParams(max_tokens=n))
    t = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    t1 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=n))
    tpot = (time.perf_counter() - t1 - (t1 - t)) / (n - 1)
    ROWS.append(("decode", f"{label} b=1 ctx={ctx}", 1 / tpot, "tok/s", f"TPOT {tpot * 1e3:.2f} ms incl. host"))
    print(ROWS[-1])


def http_post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t, out


def bench_server(engine, ttft_len=2048, n=256, ctx=512):
    from meshlab.infer.server import Server
    from meshlab.train.data import ByteTokenizer
    srv = Server(engine, ByteTokenizer(), "bench", "127.0.0.1", 0).start()
    try:
        prompt = "x" * (ctx - 1)
        http_post(srv.port, {"prompt": prompt, "max_tokens": n})                 # warm
        t1, _ = http_post(srv.port, {"prompt": prompt, "max_tokens": 1})
        tn, out = http_post(srv.port, {"prompt": prompt, "max_tokens": n})
        got = out["usage"]["completion_tokens"]
        tpot = (tn - t1) / max(got - 1, 1)
        ROWS.append(("decode", f"http b=1 ctx={ctx}", 1 / tpot, "tok/s", f"TPOT {tpot * 1e3:.2f} ms, {got} tokens"))
        print(ROWS[-1])
        t, _ = http_post(srv.port, {"prompt": "y" * ttft_len, "max_tokens": 1})
        ROWS.append(("ttft", f"http prompt={ttft_len}", t * 1e3, "ms", ""))
        print(ROWS[-1])
    finally:
        srv.stop()


def kernel_peers(cfg, bw, batches=(1, 64), ctx=2048, page_size=16):
    interpret = jax.default_backend() != "gpu"
    """One layer's decode attention: ours (Pallas), the gather + dense XLA path, JAX's paged_attention."""
    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    for b in batches:
        pages = ctx // page_size
        rng = np.random.default_rng(0)
        shape = (b * pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        k = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
        q = jnp.asarray(rng.normal(size=(b, cfg.n_heads, cfg.head_dim)), jnp.bfloat16)
        table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        lengths = jnp.full((b,), ctx, jnp.int32)
        ref = paged_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        table, lengths)
        kt, vt = jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3))
        impls = {"ours_pallas": jax.jit(lambda: paged_attention(q, k, v, table, lengths, interpret=interpret)),
                 "xla_gather": jax.jit(lambda: paged_attention_reference(q, k, v, table, lengths)),
                 "jax_paged_attention": jax.jit(lambda: jax_pa.paged_attention(q, kt, vt, table, lengths,
                                                                               pages_per_compute_block=8))}
        for name, f in impls.items():
            try:
                err = float(jnp.max(jnp.abs(f().astype(jnp.float32) - ref)))
                if err > 5e-2:
                    ROWS.append(("kernel", f"{name} b={b} ctx={ctx}", float("nan"), "us", f"WRONG err {err:.1e}"))
                    continue
                t = timeit(f, reps=10)
                ROWS.append(("kernel", f"{name} b={b} ctx={ctx}", t * 1e6, "us",
                             f"{2 * k.nbytes / t / bw:.0%} of copy bw, err {err:.1e}"))
            except Exception as e:  # noqa: BLE001 - a peer that fails here is reported, not fatal
                ROWS.append(("kernel", f"{name} b={b} ctx={ctx}", float("nan"), "us", f"FAILED {str(e)[:80]}"))
            print(ROWS[-1])


def write_rows(device, bw, path):
    path.parent.mkdir(exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    add = "" if text.endswith("\n") else "\n"
    if not heads or heads[-1].strip() != "## Decode":              # append only; never edit earlier lines
        add += "\n## Decode\n\nllama3_1b shape, bf16, random weights; scripts/bench_decode.py.\n"
    add += ("\n| date | device | jax | section | setting | value | unit | note |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |\n")
    day = datetime.date.today().isoformat()
    add += f"| {day} | {device} | {jax.__version__} | copy | 1 GiB | {bw / 1e9:.0f} | GB/s | measured |\n"
    for sec, setting, val, unit, note in ROWS:
        add += f"| {day} | {device} | {jax.__version__} | {sec} | {setting} | {val:.1f} | {unit} | {note} |\n"
    with open(path, "a") as fh:
        fh.write(add)
    print(f"appended {len(ROWS) + 1} rows to {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes and prompt lengths")
    ap.add_argument("--budget-s", type=float, default=200, help="skip later sections after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every section on CPU with the tiny model (checks the script, numbers meaningless)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0].device_kind
    if not args.cpu_smoke:
        correctness_gate(interpret=not gpu)
        if not gpu:
            sys.exit("bench_decode: correctness passed; timing needs a GPU (the numbers are for the H200)")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {device}")
    if args.cpu_smoke:
        cfg = dataclasses.replace(models.preset("tiny"), dtype="float32")
        batches, ctx, lengths, max_len, chunk, peer_b = [1, 2], 64, [32, 64], 256, 32, (1, 2)
    else:
        cfg = dataclasses.replace(models.preset("llama3_1b"), dtype="bfloat16")
        batches = [1, 64] if args.quick else [1, 8, 32, 64, 128, 256]
        lengths = [512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192]
        ctx, max_len, chunk, peer_b = 2048, 8192 + 256, 512, (1, 64)
    md, params = model_def(cfg), random_params(cfg)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    engine = {}

    def make_engine():
        engine["e"] = Engine(md, params, max_len=max_len, max_seqs=1, page_size=16, chunk=chunk, steps_per_call=16)
        bench_ttft(engine["e"], lengths, "engine")
        engine_tpot(engine["e"], "engine", ctx=min(512, ctx), n=min(256, max_len - 512) if not args.cpu_smoke else 32)
    # Most important first: a section past --budget-s is skipped, not half-run.
    sections = [("decode, xla paged", lambda: bench_decode(md, params, weight_bytes, bw, batches, ctx, "xla")),
                ("ttft + engine tpot", make_engine),
                ("http server", lambda: bench_server(engine["e"], lengths[-1] // 2 if args.cpu_smoke else 2048,
                                                     n=32 if args.cpu_smoke else 256, ctx=min(512, ctx))),
                ("decode, unrolled layers", lambda: bench_decode(md, params, weight_bytes, bw, [1], ctx, "xla",
                                                                 unroll=True)),
                ("decode, pallas paged", lambda: bench_decode(md, params, weight_bytes, bw, list(peer_b), ctx,
                                                              "pallas")),
                ("kernel peers", lambda: kernel_peers(cfg, bw, peer_b, ctx))]
    for name, run in sections:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"skipped {name}: past the {args.budget_s:.0f} s budget")
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others' rows
            print(f"section {name} failed: {type(e).__name__}: {str(e)[:300]}")
            ROWS.append((name, "FAILED", float("nan"), "", f"{type(e).__name__}: {str(e)[:100]}"))
    print(f"\n{'section':8} {'setting':32} {'value':>10} unit   note")
    for sec, setting, val, unit, note in ROWS:
        print(f"{sec:8} {setting:32} {val:10.1f} {unit:6} {note}")
    write_rows(device, bw, Path(args.out))
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
