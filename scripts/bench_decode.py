"""Decode benchmark (llama3_1b shape, bf16, random weights), sized for one GPU call.

    PYTHONPATH=$PWD python3 scripts/bench_decode.py [--budget-s 440] [--jobs base,pallas] [--quick] [--cpu-smoke]
    PYTHONPATH=$PWD python3 scripts/bench_decode.py --preset llama3_8b --quick --jobs copy_torch,engine

The parent never touches the GPU. It runs each job below as a child process of this script
(`--job NAME`, meshlab/bench/decode_jobs.py) because XLA reads XLA_FLAGS once per process; each
child prints `ROW {json}` lines as it measures, so one killed at its time limit still hands back
its rows. Jobs run most important first; each is promised `reserve` seconds and gets the slack
earlier jobs left, so the whole call ends inside --budget-s. Children share a compilation and autotune cache.

  copy_torch    the copy bandwidth measured by torch (CUDA events; no JAX in that process)
  base          the copy bandwidth in JAX (1 GiB, 4 GiB, donated); batch-1 decode at ctx 2048
                with the layers split (per-layer buffers) / fused (split + concatenated q|k|v and
                gate|up weights), each with the HLO traffic and a kernel profile; fused over a
                contiguous cache (no page gather); batch 64 fused
  sweep         fused, paged XLA attention, batch 1..256 at ctx 2048 (TPOT vs batch 1)
  sweep_pallas  the same with the paged Pallas decode kernel (XLA's RoPE and cache scatter around it)
  sweep_fused   the same with RoPE and the cache write inside the kernel
  scan          the old stacked-weight paths (scan, unroll) at batch 1, for the record
  cmdbuf_while  XLA command buffers (CUDA graphs) that also capture while loops
  dsfusion      XLA dynamic-slice fusion (a GEMM reads a stacked weight's slice in place)
  no_cmdbuf     command buffers off: what CUDA graphs buy at batch 1
  pallas        fp32 correctness gate (contiguous, paged xla, paged Pallas) on the GPU, then
                decode with the paged Pallas kernel, and the kernel against its peers
  fusedk        the paged kernel with RoPE + cache write folded in (layers=fused) against the same
                kernel behind XLA's RoPE and scatter (impl pallas_unfused), batch 1 (profiled) and 64
  kernels       fp32 gate with layers=kernels (every decode matmul a Pallas kernel with its norm /
                residual / SwiGLU), then kernels vs fused at batch 1 (both profiled), 4 and 16
  matmul        the four decode matmuls (decode_gemv) in a BlockSizes sweep against XLA, batch 1 and 4
                (--quick: 1); a later engine_gemv job runs each op's fastest tile
  read_rate     read-only streams over 1 GiB (torch and XLA sums, cuBLAS / XLA one-row GEMVs, decode_gemv in each
                role's tiles) against the copy rate: the ceiling of a decode weight stream
  profile1      batch-1 fused pallas decode only, profiled, with its HLO (the quick look after a change)
  cublas        batch-1 fused pallas decode with XLA's Triton GEMMs off (cuBLAS for every dot)
  engine        the fp32 gate (cached greedy == uncached argmax) for the engine's programs, then
                batch-1 decode at ctx 2048 through Engine against the roofline, TTFT (call to first
                token, median of 5) of a 2k prompt with 2,032 tokens cached and of one met before
                (all cached) against uncached, then profiles: the batch-1 token (device us per
                token by kernel, wall and host time per token, decode calls chained or not) and
                the cached prompt's first token (with its program's dispatch, buffer on host or
                device; tables printed and written to bench_decode.md);
                TTFT for 512..8k prompts (--quick: 512, 2048), the first engine through HTTP
                (decode vs roofline, TTFT), then batch 1, 16, 64 through one Engine (the first freed)
  first_token   the prefix-cache TTFT alone (~1 min): a 2k prompt with 2,032 tokens cached, and one
                met before, against uncached (median of 5), then the first token's profile
                (meshlab/bench/first_token.py: the call's timeline before dispatch / dispatch /
                device wait / read-back; the packed program's dispatch and call as jit, AOT, AOT
                without command buffers, input via pinned host memory; device_put alone; dispatch
                with ~100 argument leaves against 1; device time per kernel)
                and of a prompt met before (all cached: its last token in a one-step decode call), and
                the first token's host time (first_token.host_rows)
  first_token_host  the first token's host time alone, 2k prompts on any model (--cpu-smoke: the tiny
                one, a 2k prompt still: what the host does per request does not depend on the model)
  engine_ab, engine_pdl, engine_lock, engine_concurrent, engine_va, engine_pdl_lock, engine_pdl_launch,
  engine_pdl_both, engine_ab2
                the engine's batch-1 decode and prefix-cache TTFT rows (engine_ab_job) under XLA runtime
                flags, one process each: programmatic dependent launch (a kernel's launch overlaps
                the tail of the one before; the pass that marks the dependencies, the launch
                attribute, both), the exclusive-lock executable (less per-call resource
                bookkeeping), command buffers scheduled as a DAG, command buffers that remap buffer
                addresses instead of updating the graph; as shipped first and last (the noise)
  attn_tiles    the paged decode attention alone, 16 layers in one jit, under named tilings
                (batched_decode.TILES): the plain kernel at batch 16-128, the fused one at 1-16
  sweep_ab      batch 4 / 16 / 64 through engines whose decode attention takes the shipped tiles
                (by batch) or those before (batched_decode.before_batch_tiles), alternated twice
  sweep_engine  the batch sweep 1..256 (TPOT, tokens/s, % of the roofline) through one Engine of 256 rows
  buckets_ab    batch 8 / 32 / 128 through an Engine of 256 rows with decode buckets in powers of 4 and
                with the shipped ones (powers of 2 past 16), alternated twice
  splits_ab     batch 1 (2,304- and 4,096-token engines, ctx 2k and ~4k) and 16 / 32 (2,176 tokens) through
                engines whose decode attention's page blocks per split round down (shipped: at least the
                splits wanted) or up, alternated twice
  rows_ab       batch 1 / 2 / 4 through engines whose decode steps take the kernels up to the shipped
                rows (models.serving.KERNEL_ROWS) or up to 4 (more rows: XLA GEMMs), alternated twice
  expert_rows_ab  a mixture of experts (--preset moe_1b_8e) at batch 1 / 2 / 4 with the decode rows
                past one through the expert kernels (models.serving.EXPERT_KERNEL_ROWS) or the grouped GEMM,
                alternated twice
  gmm_tiles_ab  a mixture of experts at batch 8 / 16 / 64 (and TTFT 512 / 2k) with its grouped GEMM's tiles by rows (shipped:
                the few-row tile on Hopper, grouped_matmul.nk_tiles) or the defaults, alternated twice
  engine_gemv   fp32 gate with layers=kernels (pallas_kernels/decode_gemv.py), then the same rows
                through engines with layers=fused and =kernels (the shipped tiles), then kernels with
                each op's fastest tile in the matmul job ("tuned", when that job ran earlier in the
                call) and with the attention tiles of attention_tiles(), and a profile of the fastest
                kernels variant's batch-1 token (MESHLAB_BENCH_GEMV_SHORT=1: batch-1 decode alone
                through kernels and "tuned" engines, alternated twice; for wide presets like llama3_8b)
  layers_ab     batch-1 decode through engines with each layers mode the model takes (split, fused, and
                kernels for a dense model), the shipped one first, alternated twice (a mixture of experts:
                against its routed roofline)
  gmm_rows      a mixture of experts' grouped GEMM over its [E, n, k] matrices (serving's) at a decode step's
                32 / 128 / 512 rows on the preset's expert shapes, the default and shipped tiles against narrower
                ones, then at prompt chunks' 1,024 / 4,096 rows against wider ones, and at every row count the
                same product over [E, k, n] read in place (meshlab/bench/expert_rows.py)
  first_token_ab  (MESHLAB_BENCH_PACKED_XLA=triton_any,no_triton,cublaslt: as shipped, then engines whose packed
                programs compile with those XLA options (first_token.PACKED_OPTIONS), each with its
                TTFT rows and its short tail's profile; else:)
                the same TTFT rows through an Engine as shipped, then one that feeds a prompt met before its
                last token again instead of sampling from its kept hidden state (tagged [last token fed
                again]), then one whose first-token decode calls are compiled
                without command buffers (tagged [first-token decode call no cmdbuf]), then one whose packed
                programs are (tagged [packed no cmdbuf]), then through one whose packed input
                goes through pinned host memory (tagged [pinned input]), then through one that feeds a
                prompt's one token left in a 16-wide packed row instead of a one-step decode call (tagged
                [one token left: packed row]); ~1.5 min more
  fp8           batch-1 decode and prefix-cache TTFT rows (engine_ab_job) through the kernels layers in bf16,
                then with the layers' matrices in fp8 (Engine(quantize="fp8"): float8_e4m3fn and a scale per
                output row), each against its own weights' roofline, and fp8's rate over bf16's; fp8 also
                with every step's matrices widened (W8A16: prompt chunks without FP8 GEMMs); the three
                at batch 128 / 256 (FP8 GEMMs from models.serving.FP8_GEMM_ROWS rows)
  kv_fp8        the batch sweep 1 / 16 / 64 / 128 at ctx 2k through the shipped engine over a bf16 KV cache and
                over an fp8 one (Engine(kv_cache_dtype="fp8")), alternated by batch, each against its own roofline;
                how many greedy tokens of one prompt the two share
  prefill_ab    the prefix-cache TTFT rows through engines whose prompt rows take other paged_prefill tiles
                (MESHLAB_BENCH_PREFILL: served = the shipped tiles, default = the kernel's, names of
                layer_chain.attention_variants; xla_merge: the splits merged by XLA), alternated twice (first_token.prefill_tiles_ab)

The roofline's bandwidth is the highest copy rate any copy job measured in the call.
Writes bench_decode.json / bench_decode.md, child logs and the decode HLO (gzip) to $OUT (or
/tmp/bench_decode); on a GPU also appends dated rows to docs/archive/benchmarks-diary.md and writes that block
to $OUT/benchmarks_append.md (the device machine's checkout does not come back).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from meshlab.bench import DEFAULT_PRESET, diary, preset_arg  # noqa: E402
from meshlab.bench.decode_jobs import JOBS, run_child  # noqa: E402  (no JAX import: the parent stays off the GPU)

PRESET_TAG = r"( \[[\w.-]+\])?"    # run_job's " [<preset>]" on the rows of a --preset other than the default


def _gemv_tuned(rows) -> dict:
    """{MESHLAB_BENCH_GEMV_TUNED: json {"n,k,swiglu": label}}: the matmul job's fastest decode_gemv tile
    per op at batch 1 (rows that passed its check), for decode_tiles.gemv_tuned_tiles()."""
    import re
    best: dict = {}
    for r in rows:
        m = re.fullmatch(r"\S+ ours\[(\S+)\] b=1" + PRESET_TAG, r.get("setting", ""))
        if r.get("job") == "matmul" and m and r["value"] == r["value"] and r["value"] > 0:
            if r["value"] < best.get(r["gemv_key"], (float("inf"), ""))[0]:
                best[r["gemv_key"]] = (r["value"], m.group(1))
    if not best:
        return {}
    tuned = {key: label for key, (_, label) in best.items()}
    print(f"[matmul] fastest tiles per op: {tuned}", flush=True)
    return {"MESHLAB_BENCH_GEMV_TUNED": json.dumps(tuned)}


def _engine_choice(rows) -> dict:
    """{MESHLAB_BENCH_LAYERS, MESHLAB_BENCH_GEMV}: the engine_gemv variant with the most batch-1 decode
    tokens/s (mean of its two measures): fused, or kernels under one of its variants (decode_tiles.tile_variant)."""
    import re
    rates: dict = {}
    for r in rows:
        m = re.fullmatch(r"engine b=1 ctx=\d+ \[(fused|kernels)( [^\]]+)?\]( again)?" + PRESET_TAG, r.get("setting", ""))
        if r.get("job") == "engine_gemv" and r["section"] == "decode" and m and r["value"] > 0:
            rates.setdefault((m.group(1), (m.group(2) or "").strip()), []).append(r["value"])
    if not rates:
        return {}
    (layers, tile), _ = max(rates.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    print(f"[engine] measures layers={layers} {tile or 'default tiles'} (the fastest of engine_gemv)", flush=True)
    return {"MESHLAB_BENCH_LAYERS": layers, "MESHLAB_BENCH_GEMV": tile}


def run_job(name, args, deadline, out: Path, bw):
    """Run one job as a child until it ends or `deadline`; returns its rows (those printed so far)."""
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), JOBS[name][0]) if f)
    cache = Path("/tmp/bench_decode_cache")
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))   # keep carried packages
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=path, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    cmd = [sys.executable, __file__, "--job", name, "--out-dir", str(out)] + (["--bw", str(bw)] if bw else []) \
        + (["--quick"] if args.quick else []) + (["--cpu-smoke"] if args.cpu_smoke else []) + ["--preset", args.preset]
    rows_path, log_path = out / "logs" / f"{name}.rows", out / "logs" / f"{name}.log"
    with open(rows_path, "w") as rows_fh, open(log_path, "w") as log_fh:
        proc = subprocess.Popen(cmd, env=env, stdout=rows_fh, stderr=log_fh, start_new_session=True)
        rows, done = [], 0
        while True:
            finished = proc.poll() is not None
            lines = rows_path.read_text().splitlines(keepends=True)
            for line in lines[done:]:
                if not line.endswith("\n") and not finished:
                    break                                   # a line still being written
                done += 1
                if line.startswith("ROW "):
                    row = dict(json.loads(line[4:]), job=name)
                    if args.preset != DEFAULT_PRESET and not args.cpu_smoke and row["section"] != "meta":
                        row["setting"] += f" [{args.preset}]"        # rows of another shape say so
                    rows.append(row)
                    if row["section"] != "meta":
                        print(f"[{name}] {row['section']:7} {row['setting']:36} {row['value']:10.1f} "
                              f"{row['unit']:5} {row.get('note', '')}"[:230], flush=True)
            if finished:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rows.append({"section": name, "setting": "TIMEOUT", "value": float("nan"), "unit": "", "job": name,
                             "note": "job stopped at its time limit; rows before this are complete"})
                print(f"[{name}] stopped at its time limit", flush=True)
                break
            time.sleep(0.5)
    if proc.returncode not in (0, -signal.SIGKILL):
        tail = log_path.read_text().splitlines()[-12:]
        rows.append({"section": name, "setting": "FAILED", "value": float("nan"), "unit": "", "job": name,
                     "note": f"exit {proc.returncode}: " + " | ".join(tail)[-300:]})
        print(f"[{name}] exit {proc.returncode}; log tail:\n  " + "\n  ".join(tail), flush=True)
    return rows


def markdown(rows, meta) -> str:
    day = datetime.date.today().isoformat()
    dev, jv = meta.get("device", "?"), meta.get("jax", "?")
    lines = ["| date | device | jax | section | setting | value | unit | note |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["section"] != "meta":
            lines.append(f"| {day} | {dev} | {jv} | {r['section']} | {r['setting']} | {r['value']:.1f} | {r['unit']} | "
                         f"{str(r.get('note', '')).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def profile_table(r) -> str:
    """An engine profile row (meshlab.bench.decode.engine_profile / first_token.engine_tail_profile) as a per-kernel
    table: us per decode token, or per request for the cached prompt's first token."""
    per = "token" if r["unit"] == "us/token" else "request"
    lines = [f"\n## {r['setting']}: where the time goes\n", r["note"] + "\n",
             f"| class | us/{per} |", "| --- | --- |"]
    lines += [f"| {c} | {t * 1e3:.1f} |" for c, t in r["classes"]]
    lines += ["", f"| kernel | us/{per} | launches/{per} |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {t:.1f} | {c:g} |" for k, t, c in r["kernels"]]
    return "\n".join(lines) + "\n"


def details(rows) -> str:
    """The batch sweep's TPOT against batch 1, then HLO traffic and kernel profiles per decode
    variant (the evidence behind the numbers), and whether its greedy tokens equal the paged fused
    XLA path's (bf16: a different fusion may round differently)."""
    out = []
    for job in ("sweep", "sweep_pallas", "sweep_fused"):
        sweep = {r["batch"]: r for r in rows if r["job"] == job and r["section"] == "decode" and "tpot_ms" in r}
        if sweep:
            one = sweep.get(1, {}).get("tpot_ms")
            out += [f"\n## {job}: TPOT against batch 1 (ctx 2048)\n", "| batch | tok/s | TPOT ms | x b=1 | % copy bw |",
                    "| --- | --- | --- | --- | --- |"]
            out += [f"| {b} | {r['value']:.0f} | {r['tpot_ms']:.2f} | {r['tpot_ms'] / one if one else float('nan'):.2f} | "
                    f"{r['frac_copy_bw']:.0%} |" for b, r in sorted(sweep.items())]
    for r in rows:
        if r["section"] == "profile" and "kernels" in r:
            out.append(profile_table(r))
    out.append("\n## HLO traffic and profiles per decode variant\n")
    ref = {r["batch"]: r["tokens"] for r in rows if r["section"] == "decode" and r.get("layers") == "fused"
           and r.get("impl") == "xla" and r.get("layout") == "paged" and r["job"] == "base" and "tokens" in r}
    for r in rows:
        if r["section"] == "decode" and ("hlo" in r or "profile" in r):
            same = {True: "same greedy tokens as paged fused xla", False: "greedy tokens differ from paged fused xla"}.get(
                r["tokens"] == ref[r["batch"]] if r["batch"] in ref else None, "")
            out.append(f"### {r['setting']}: {r['value']:.0f} tok/s, compile {r.get('compile_s')} s; {same}\n")
            out.append("```\n" + json.dumps(r["hlo"], indent=1) + "\n```")
            if "profile" in r:
                out.append("profile: ```" + json.dumps(r["profile"]) + "```\n")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=440, help="the whole call ends within this")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, in order; of {','.join(JOBS)}")
    ap.add_argument("--quick", action="store_true", help="fewer prompt lengths")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the mechanics only")
    ap.add_argument("--preset", default=DEFAULT_PRESET, type=preset_arg,
                    help="the model shape measured (random weights, bf16); rows of another than "
                         f"{DEFAULT_PRESET} carry its name")
    ap.add_argument("--docs", default=str(diary.DIARY))
    ap.add_argument("--job", choices=list(JOBS), help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--bw", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return run_child(args)
    t0 = time.perf_counter()
    out = Path(os.environ.get("OUT") or "/tmp/bench_decode")
    for sub in ("logs", "hlo"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    jobs = [j for j in args.jobs.split(",") if j]
    rows, bw = [], 0.0
    for i, name in enumerate(jobs):
        later = sum(JOBS[j][1] for j in jobs[i + 1:])
        deadline = t0 + args.budget_s - 5 - later            # later jobs keep their reserve; slack goes here
        if name == "copy_torch":                             # every roofline of the call stands on it
            deadline = max(deadline, time.perf_counter() + JOBS[name][1])
        if deadline - time.perf_counter() < 20:
            rows.append({"section": name, "setting": "SKIPPED", "value": float("nan"), "unit": "", "job": name,
                         "note": "no time left in the budget"})
            print(f"[{name}] skipped: no time left", flush=True)
            continue
        rows += run_job(name, args, deadline, out, bw)
        if name == "matmul":
            os.environ.update(_gemv_tuned(rows))       # engine_gemv then also runs each op's fastest tile
        if name == "engine_gemv":
            os.environ.update(_engine_choice(rows))    # the engine job then measures the faster layers
        bw = max([bw] + [r["value"] * 1e9 for r in rows if r["section"] == "copy" and r["value"] == r["value"]])
    meta = next((r for r in rows if r["section"] == "meta"), {})
    table = markdown(rows, meta)
    (out / "bench_decode.json").write_text(json.dumps(rows, indent=1, default=float))
    (out / "bench_decode.md").write_text(table + details(rows))
    print("\n" + table)
    for r in rows:
        if r["section"] == "profile" and "kernels" in r:
            print(profile_table(r))
    if diary.records(meta.get("backend", "unknown"), args.docs):   # the jobs' backend; this process starts no JAX
        block = ("\n### bench_decode.py, one call (" + f"{time.perf_counter() - t0:.0f} s; jobs {','.join(jobs)})\n\n"
                 + table)
        (out / "benchmarks_append.md").write_text(block)
        diary.append(block, backend=meta["backend"], path=args.docs)
        print(f"appended {table.count(chr(10)) - 2} rows to {args.docs} and {out / 'benchmarks_append.md'}")
    print(f"total {time.perf_counter() - t0:.0f} s; files in {out}")


if __name__ == "__main__":
    main()
