"""Serving under load (llama3_1b unless --preset names another; bf16, random weights): offline, HTTP, peers.

    PYTHONPATH=$PWD python3 scripts/bench_serve.py [--jobs offline,peer_cb,peer_b1,http] [--n 512]
    PYTHONPATH=$PWD python3 scripts/bench_serve.py --quick          # tiny model on CPU: the mechanics
    PYTHONPATH=$PWD python3 scripts/bench_serve.py --preset llama3_8b --jobs offline,peer_cb

Workload (meshlab/bench/serve.py): n requests, prompts uniform in [128, 1024] tokens,
outputs uniform in [64, 256] (`--prompts 128,2048 --outputs 64,512`: other ranges; the engines'
max_len grows to hold the longest request, and the rows carry the ranges; `--max-step-tokens N`: the
engines' step budget, also in the rows; `--kv-cache-dtype fp8`: their KV cache in fp8, also in the
rows), greedy, no stop tokens. Jobs, each a child process (torch and JAX
never share one), printing `ROW {json}` lines:

  offline  Engine(max_len=1536, max_seqs=128, page_size=16, chunk=512, steps_per_call=8).generate
           on all n at once, after Engine.warmup (compiles every bucket); then --match requests
           again one at a time: the share whose greedy tokens equal the concurrent run's
  overlap_ab  (not by default) the offline engine with its steps overlapped (Engine.overlap_steps, the
           default) and read back one by one, alternated twice in one process, then whether both
           give the same greedy tokens
  peer_cb  transformers' continuous batching (default configuration) on the first --peer-n requests
  peer_b1  HF generate, static cache, torch.compile, batch 1 at ctx 2048 (and the same generate eager)
  peer_loop  (not by default) the strongest torch recipe at batch 1: the HF model's one-token forward and
           argmax compiled with CUDA graphs over a StaticCache, in a loop without read-backs (gpt-fast's)
  http     scripts/serve.py with the offline engine settings (every bucket compiled before it
           listens); the workload with Poisson arrivals at each --rates (requests/s; 0 = all at
           once), streamed, tokens timed by the usage in each chunk (`continuous_usage_stats`);
           --http-logprobs asks for logprobs too
  score    (not by default) the workload's prompts as an evaluation harness's loglikelihood requests
           (greedy, one token, prompt logprobs: scored in the packed steps) against the same prompts as
           plain one-token requests, in the offline engine: prompt tokens/s of each
  guided   (not by default) the offline workload free, then with 1 request in 8 held to a JSON schema
           of its length (response_format's path: meshlab/infer/guided.py), to allowed_token_ids, and
           away from a bad word of 2 tokens, in the offline engine: output tokens/s of each
  sampled  (not by default) the offline workload greedy, at temperature 1, at temperature 0.7 with
           top_p 0.9, and with top_k 50 too, in the offline engine: output tokens/s of each
  shared   (not by default) the offline workload behind one 1,024-token system prompt, all sent at once,
           with requests waiting for the prefix pages another computes (the default) and without, in the
           offline engine: output tokens/s, TTFT p50, prompt tokens computed
  restart  (not by default) serve.py started twice over one fresh compile cache: seconds to listening
  sim      (not by default; CPU) the same load's shape on the tiny model with a simulated device
           (meshlab/bench/serve.py SimulatedDevice): offline and all at once through the server in
           one process, the ratio of the two (the server's host cost, with the engine's host work real)
Writes bench_serve.json / .md under $OUT (or /tmp/bench_serve); on a GPU appends dated rows to
docs/archive/benchmarks-diary.md and to $OUT/benchmarks_append.md.
"""
from __future__ import annotations

import argparse
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
from meshlab.bench import DEFAULT_PRESET, diary, preset_arg  # noqa: E402
from meshlab.xla_flags import on_gpu  # noqa: E402

DEFAULT_PROMPTS, DEFAULT_OUTPUTS = (128, 1024), (64, 256)
# jobs of meshlab/bench/serve_kinds.py over the offline engine: job -> its function there
KIND_JOBS = {"score": "scoring", "guided": "guided", "shared": "shared_prefix", "sampled": "sampled"}


def shape(args):
    """(preset, dtype, workload kwargs, engine kwargs) of the run: --prompts / --outputs override the
    workload's ranges, and max_len grows (in whole pages) to hold the longest request they allow."""
    if args.quick:
        preset, dtype, wl = "tiny", "float32", dict(prompt=(8, 40), output=(4, 16), vocab=257)
        ek = dict(max_len=64, max_seqs=4, page_size=4, chunk=16, steps_per_call=4)
    else:
        import models
        preset, dtype = args.preset, "bfloat16"
        wl = dict(prompt=DEFAULT_PROMPTS, output=DEFAULT_OUTPUTS, vocab=models.preset(args.preset).vocab_size)
        ek = dict(max_len=1536, max_seqs=128, page_size=16, chunk=512, steps_per_call=8)
    wl.update({k: v for k, v in (("prompt", args.prompts), ("output", args.outputs)) if v})
    if args.max_step_tokens:
        ek["max_step_tokens"] = args.max_step_tokens
    if args.kv_cache_dtype != "auto":
        ek["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantize != "none":
        ek["quantize"] = args.quantize
    longest = wl["prompt"][1] + wl["output"][1]
    ek["max_len"] = max(ek["max_len"], -(-longest // ek["page_size"]) * ek["page_size"])
    return preset, dtype, wl, ek


def length_range(text: str) -> tuple[int, int]:
    """'LO,HI' -> (LO, HI), token counts with 1 <= LO <= HI (an argparse type)."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be two token counts LO,HI, e.g. 128,2048") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return lo, hi


def run_parts(args) -> list[str]:
    """What of the run is not the default load test's: the model shape, the length ranges, the engines'
    step budget (none on --quick); each row's setting and the diary's heading name them."""
    if args.quick:
        return []
    parts = [args.preset] if args.preset != DEFAULT_PRESET else []
    if (args.prompts or DEFAULT_PROMPTS) != DEFAULT_PROMPTS or (args.outputs or DEFAULT_OUTPUTS) != DEFAULT_OUTPUTS:
        (p0, p1), (o0, o1) = args.prompts or DEFAULT_PROMPTS, args.outputs or DEFAULT_OUTPUTS
        parts.append(f"prompts {p0}-{p1}, outputs {o0}-{o1}")
    if args.max_step_tokens:
        parts.append(f"max_step_tokens {args.max_step_tokens}")
    if args.kv_cache_dtype != "auto":
        parts.append(f"kv cache {args.kv_cache_dtype}")
    if args.quantize != "none":
        parts.append(f"weights {args.quantize}")
    return parts


def run_tag(args) -> str:
    """' [part, ...]' of run_parts, appended to each row's setting, or ''."""
    parts = run_parts(args)
    return f" [{', '.join(parts)}]" if parts else ""


def child(args):
    from meshlab.bench import serve as bs
    from meshlab.bench import serve_peers as peers
    preset, dtype, wl, ek = shape(args)
    work = bs.workload(args.n, seed=0, **wl)
    if args.job == "peer_cb":
        return peers.peer_continuous_batching(work[:args.peer_n], preset=preset)
    if args.job == "peer_b1":
        return peers.peer_static_b1(preset=preset)
    if args.job == "peer_loop":
        return peers.peer_compiled_loop_b1(preset=preset)
    if args.job in ("offline", "overlap_ab", *KIND_JOBS):
        import dataclasses
        import models
        from meshlab.infer.engine import Engine
        from meshlab.infer.loading import random_params
        from models import model_def
        cfg = dataclasses.replace(models.preset(preset), dtype=dtype)
        md, params = model_def(cfg), random_params(cfg)
        report = lambda key, sec: bs.emit({"section": "compile", "setting": str(key), "value": sec, "unit": "s",
                                           "note": "first call (compile + one run on padding)"})
        t = time.perf_counter()
        try:
            eng = Engine(md, params, prefill=args.prefill, **ek)
            k = eng.warmup(report=report)
        except Exception as e:  # noqa: BLE001 - the flash chunk-row path failing must not lose the run
            if args.prefill == "xla":
                raise
            bs.emit({"section": "compile", "setting": f"prefill={args.prefill} FAILED", "value": float("nan"),
                     "unit": "", "note": f"{type(e).__name__}: {str(e)[:200]}; falling back to prefill=xla"})
            eng = Engine(md, params, prefill="xla", **ek)
            k = eng.warmup(report=report)
        bs.emit({"section": "compile", "setting": "Engine.warmup: every bucket", "value": time.perf_counter() - t,
                 "unit": "s", "note": f"{k} programs: decode b in {eng.DECODE}, packed n_dec in {eng.MIXED_DECODE} "
                                      f"x chunk rows in {eng.PREFILL_ROWS} x widths {eng.WIDTHS}"})
        if args.job == "overlap_ab":
            return bs.overlap_ab(eng, work, cfg.vocab_size)
        if args.job in KIND_JOBS:
            from meshlab.bench import serve_kinds
            return getattr(serve_kinds, KIND_JOBS[args.job])(eng, work)
        row, reqs = bs.offline(eng, work, "engine")
        bs.match_rate(eng, work[:args.match], reqs[:args.match])
        return row
    if args.job == "http":
        return http(args, preset, dtype, wl, ek, bs, work)
    if args.job == "restart":
        return restart(preset, dtype, bs)
    if args.job == "sim":
        return bs.simulated(args.n, args.http_logprobs)


def http(args, preset, dtype, wl, ek, bs, work):
    cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--checkpoint", f"random:{preset}", "--port", "0",
           "--dtype", dtype, "--max-len", str(ek["max_len"]), "--max-seqs", str(ek["max_seqs"]), "--page-size",
           str(ek["page_size"]), "--chunk", str(ek["chunk"]), "--steps-per-call", str(ek["steps_per_call"]),
           "--max-concurrent", str(4 * args.n), "--max-waiting", str(4 * args.n), "--warmup", "on",
           "--warmup-idle-kinds="] \
        + ([f"--max-step-tokens={ek['max_step_tokens']}"] if "max_step_tokens" in ek else []) \
        + [f"--kv-cache-dtype={ek.get('kv_cache_dtype', 'auto')}", f"--quantize={ek.get('quantize', 'none')}"]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=dict(os.environ))
    try:
        line = srv.stdout.readline()
        m = re.search(r"http://([\d.]+):(\d+)", line)
        if not m:
            raise RuntimeError(f"serve.py did not start: {line!r}")
        host, port = m.group(1), int(m.group(2))
        # the server compiled every greedy bucket before listening (and nothing while idle: no compile
        # between the rates' loads); this warms the rest (and logprobs' programs)
        bs.http_load(host, port, bs.workload(max(args.n // 4, 1), seed=1, **wl), 1e6, args.http_logprobs, seed=1)
        for rate in args.rates:
            bs.http_load(host, port, work, rate if rate > 0 else 1e6, args.http_logprobs)
    finally:
        srv.terminate()
        srv.wait(30)


def restart(preset, dtype, bs) -> list:
    """serve.py started as a user starts it (its default engine), twice over one fresh compile cache:
    seconds from the command to its listening line, when every bucket is compiled, then loaded."""
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "scripts" / "serve.py"), "--checkpoint", f"random:{preset}", "--dtype", dtype,
               "--port", "0", "--warmup", "on", f"--compile-cache={tmp}/jax"]
        for label in ("compile cache empty", "again, the cache filled by the first"):
            with open(Path(tmp) / "stderr", "w+") as err:
                t = time.perf_counter()
                srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ))
                try:
                    line = srv.stdout.readline()
                    took = time.perf_counter() - t
                finally:
                    srv.terminate()
                    srv.wait(30)
                err.seek(0)
                log = err.read()
            if "http://" not in line:
                raise RuntimeError(f"serve.py did not start: {log[-500:]}")
            compiled = re.search(r"compiled \d+ programs (\([a-z, ]+\) )?in \d+ s", log)
            rows.append(bs.emit({"section": "start", "setting": f"serve.py to listening, {label}", "value": took,
                                 "unit": "s", "note": f"{compiled.group(0) if compiled else 'no compile line'}; "
                                                      f"--checkpoint random:{preset} --dtype {dtype}, defaults"}))
    return rows


def run_job(name, args, out: Path, timeout: float) -> list:
    cmd = [sys.executable, __file__, "--job", name, "--n", str(args.n), "--peer-n", str(args.peer_n),
           "--match", str(args.match), "--rates", ",".join(map(str, args.rates)), "--prefill", args.prefill] \
        + (["--quick"] if args.quick else []) + (["--http-logprobs"] if args.http_logprobs else []) \
        + ["--preset", args.preset] \
        + [f"--{k}={v[0]},{v[1]}" for k, v in (("prompts", args.prompts), ("outputs", args.outputs)) if v] \
        + ([f"--max-step-tokens={args.max_step_tokens}"] if args.max_step_tokens else []) \
        + [f"--kv-cache-dtype={args.kv_cache_dtype}", f"--quantize={args.quantize}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = out / f"{name}.log"
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=fh, text=True, timeout=timeout)
            text, note = proc.stdout, f"exit {proc.returncode}" if proc.returncode else ""
        except subprocess.TimeoutExpired as e:
            text, note = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "TIMEOUT"
    rows = [dict(json.loads(x[4:]), job=name) for x in text.splitlines() if x.startswith("ROW ")]
    for r in rows:
        r["setting"] += run_tag(args)                             # rows of another shape or load say so
    if note:
        tail = " | ".join(log.read_text().splitlines()[-6:])[-300:]
        rows.append({"section": name, "setting": note, "value": float("nan"), "unit": "", "job": name, "note": tail})
    for r in rows:
        line = f"[{name}] {r['section']:8} {r['setting'][:48]:48} {r['value']:10.1f} {r['unit']:6} {r.get('note', '')}"
        print(line[:260], flush=True)
    return rows


def ratio_row(rows, n) -> list:
    """The best HTTP rate's output tokens/s against the offline run's (the serving issue's load Must)."""
    off = [r for r in rows if r["job"] == "offline" and r["section"] == "offline" and r["unit"] == "tok/s"]
    http = [r for r in rows if r["job"] == "http" and r["section"] == "http" and f" n={n}" in r["setting"]]
    if not off or not http:
        return []
    best = max(http, key=lambda r: r["value"])
    row = {"job": "http", "section": "http", "setting": f"best HTTP ({best['setting']}) / offline",
           "value": 100 * best["value"] / off[0]["value"], "unit": "%",
           "note": f"{best['value']:.0f} / {off[0]['value']:.0f} tok/s; TTFT p99 {best['ttft_p99_ms']:.0f} ms"}
    print(f"[http] {row['setting']}: {row['value']:.1f}% ({row['note']})", flush=True)
    return [row]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="offline,peer_cb,peer_b1,http")
    ap.add_argument("--n", type=int, default=512, help="requests in the workload")
    ap.add_argument("--peer-n", type=int, default=512, help="requests the transformers peer runs (its first n)")
    ap.add_argument("--match", type=int, default=16, help="requests rerun alone for the greedy match rate")
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[8, 16, 32, 64, 0])
    ap.add_argument("--timeout-s", type=float, default=600, help="per job")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU, a few requests")
    ap.add_argument("--preset", default=DEFAULT_PRESET, type=preset_arg,
                    help=f"the model shape served and given to the peers (random weights, bf16); rows of another "
                         f"than {DEFAULT_PRESET} carry its name")
    ap.add_argument("--prompts", type=length_range, default=None,
                    help=f"prompt lengths LO,HI (uniform; default {DEFAULT_PROMPTS[0]},{DEFAULT_PROMPTS[1]})")
    ap.add_argument("--outputs", type=length_range, default=None,
                    help=f"output lengths LO,HI (uniform; default {DEFAULT_OUTPUTS[0]},{DEFAULT_OUTPUTS[1]})")
    ap.add_argument("--max-step-tokens", type=int, default=None,
                    help="the engines' tokens per step (Engine max_step_tokens; default max_seqs + 4 chunks)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                    help="the engines' KV cache (Engine kv_cache_dtype; fp8: float8_e4m3fn, in the rows)")
    ap.add_argument("--quantize", default="none", choices=("none", "fp8"),
                    help="the engines' weights (Engine quantize; fp8: the layers' matrices float8_e4m3fn, in the rows)")
    ap.add_argument("--prefill", default="auto", choices=("auto", "flash", "xla"),
                    help="prompt-chunk attention of the offline engine (auto: flash on GPU)")
    ap.add_argument("--http-logprobs", action="store_true",
                    help="HTTP clients also ask for the chosen tokens' logprobs (the offline run does not)")
    ap.add_argument("--docs", default=str(diary.DIARY))
    ap.add_argument("--job", help=argparse.SUPPRESS)
    return ap


def main():
    ap = parser()
    args = ap.parse_args()
    if args.job:
        return child(args)
    if args.quick:
        args.n, args.peer_n, args.match, args.rates = min(args.n, 16), min(args.peer_n, 16), min(args.match, 4), [50, 0]
    out = Path(os.environ.get("OUT") or "/tmp/bench_serve")
    out.mkdir(parents=True, exist_ok=True)
    t0, rows = time.perf_counter(), []
    for name in [j for j in args.jobs.split(",") if j]:
        if args.quick and name.startswith("peer"):
            continue                                                  # torch peers need the GPU
        rows += run_job(name, args, out, args.timeout_s)
    rows += ratio_row(rows, args.n)
    day = datetime.date.today().isoformat()
    table = "| date | job | section | setting | value | unit | note |\n| --- | --- | --- | --- | --- | --- | --- |\n"
    table += "".join(f"| {day} | {r['job']} | {r['section']} | {r['setting']} | {r['value']:.1f} | {r['unit']} | "
                     f"{str(r.get('note', '')).replace('|', '/')} |\n" for r in rows)
    (out / "bench_serve.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "bench_serve.md").write_text(table)
    print("\n" + table)
    if not args.quick and any(r["job"] != "sim" for r in rows):     # the simulated device's rows stay out
        block = (f"\n### bench_serve.py, one call ({time.perf_counter() - t0:.0f} s; jobs {args.jobs}, n={args.n}"
                 f"{''.join('; ' + part for part in run_parts(args))})\n\n")
        block += "".join(line for line in table.splitlines(keepends=True) if "| sim |" not in line)
        (out / "benchmarks_append.md").write_text(block)
        diary.append(block, backend="gpu" if on_gpu() else "cpu", path=args.docs)   # the jobs ran in children
    print(f"total {time.perf_counter() - t0:.0f} s; files in {out}")


if __name__ == "__main__":
    main()
