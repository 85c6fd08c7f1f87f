"""Serving under load, as scripts/bench_serve.py runs it: the offline workload through `Engine` and
Poisson arrivals through the HTTP server (the torch peers, each in its own process:
`meshlab.bench.serve_peers`).

The workload (`workload`): n requests, prompt lengths uniform in [p_lo, p_hi], output lengths
uniform in [o_lo, o_hi], token ids uniform over the vocabulary, greedy, no stop tokens (every
request runs to its max_tokens), seeded. Rows are dicts printed as `ROW {json}` by the script.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np

from meshlab.bench.decode import emit, weights_read_per_step


def workload(n: int, prompt=(128, 1024), output=(64, 256), vocab: int = 128256, seed: int = 0):
    """[(prompt token ids, max_tokens)] (see the module doc)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt[0], prompt[1] + 1, n)
    outs = rng.integers(output[0], output[1] + 1, n)
    return [(rng.integers(0, vocab, int(p)).tolist(), int(o)) for p, o in zip(lens, outs)]


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def latency_summary(ttft, tpot) -> dict:
    return {"ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "tpot_p50_ms": pct(tpot, 50) * 1e3, "tpot_p99_ms": pct(tpot, 99) * 1e3}


def offline(engine, work, label: str):
    """Every request submitted at once through Engine.generate; (row, requests): throughput, latency
    and the engine's own counters (host time per device call and its dispatching share, device wait per call,
    decode steps per dispatch, compiles)."""
    from meshlab.infer.sampler import SamplingParams
    before = dict(engine.stats)
    t = time.perf_counter()
    reqs = engine.generate([p for p, _ in work], [SamplingParams(max_tokens=m) for _, m in work])
    wall = time.perf_counter() - t
    st = {k: engine.stats[k] - before[k] for k in before}
    out_tok = sum(len(r.output) for r in reqs)
    assert out_tok == sum(m for _, m in work), "a request stopped early (the workload has no stop tokens)"
    m = [r.metrics for r in reqs]
    calls = max(st["device_calls"], 1)
    decode_steps = st["steps"] - st["packed_calls"]
    row = {"section": "offline", "setting": f"{label} n={len(work)}", "value": out_tok / wall, "unit": "tok/s",
           "wall_s": wall, "output_tokens": out_tok, "prompt_tok_s": sum(len(p) for p, _ in work) / wall,
           **latency_summary([x["ttft_s"] for x in m], [x["tpot_s"] for x in m if x["tpot_s"] is not None]),
           "preemptions": st["preemptions"], "device_calls": st["device_calls"], "packed_calls": st["packed_calls"],
           "decode_calls": st["decode_calls"], "decode_steps_per_dispatch": decode_steps / max(st["decode_calls"], 1),
           "host_ms_per_call": st["host_s"] / calls * 1e3, "dispatch_ms_per_call": st["dispatch_s"] / calls * 1e3,
           "device_wait_ms_per_call": st["device_wait_s"] / calls * 1e3,
           "compiles": st["compiles"], "compile_s": st["compile_s"], "prefill_tokens": st["prefill_tokens"],
           "prefix_hit_tokens": st["prefix_hit_tokens"]}
    row["note"] = (f"{out_tok} tokens in {wall:.1f} s; TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 "
                   f"{row['ttft_p99_ms']:.0f}; TPOT p50 {row['tpot_p50_ms']:.1f} ms p99 {row['tpot_p99_ms']:.1f}; "
                   + counters_note(st))
    return emit(row), reqs


def counters_note(st: dict) -> str:
    """The engine's counters over a run (the difference of Engine.stats before and after) in words."""
    calls = max(st["device_calls"], 1)
    return (f"{st['host_s'] / calls * 1e3:.2f} ms host per call ({st['dispatch_s'] / calls * 1e3:.2f} of it "
            f"dispatching), {st['device_wait_s'] / calls * 1e3:.2f} waiting on the device; "
            f"{(st['steps'] - st['packed_calls']) / max(st['decode_calls'], 1):.1f} decode steps per dispatch, "
            f"{st['device_calls']} calls, {st['compiles']} compiles, {st['preemptions']} preemptions")


def overlap_ab(engine, work, vocab: int, rounds: int = 2, seed: int = 7) -> list[dict]:
    """The offline load with Engine.overlap_steps off and on, alternated `rounds` times in one process
    (programs compiled once; each run on fresh prompt ids of the workload's lengths, so that no run
    finds another's prefixes in the cache), then both on the same prompts with the prefix cache off:
    whether their greedy tokens are equal (they are when the two modes run the same steps)."""
    import hashlib
    import json
    from meshlab.infer.sampler import SamplingParams
    rng = np.random.default_rng(seed)
    fresh = lambda: [(rng.integers(0, vocab, len(p)).tolist(), m) for p, m in work]   # noqa: E731
    rows, keep = [], (engine.overlap_steps, engine.sched.pool.prefix_cache)
    try:
        for on in (False, True):           # each mode's host paths warm before any is timed
            engine.overlap_steps, warm = on, fresh()[:max(len(work) // 8, 1)]
            engine.generate([p for p, _ in warm], [SamplingParams(max_tokens=m) for _, m in warm])
        for r in range(rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                engine.overlap_steps, before = on, engine.stats["overlapped_calls"]
                row, _ = offline(engine, fresh(), f"engine [overlap_steps={on}]")
                row["overlapped_calls"] = engine.stats["overlapped_calls"] - before
                rows.append(row)
        engine.sched.pool.prefix_cache, same, digests = False, fresh(), {}
        for on in (False, True):
            engine.overlap_steps = on
            reqs = engine.generate([p for p, _ in same], [SamplingParams(max_tokens=m) for _, m in same])
            digests[on] = hashlib.sha256(json.dumps([q.output for q in reqs]).encode()).hexdigest()[:16]
    finally:
        engine.overlap_steps, engine.sched.pool.prefix_cache = keep
    rows.append(emit({"section": "offline", "setting": f"greedy tokens, overlap_steps off == on, {len(same)} requests",
                      "value": float(digests[False] == digests[True]), "unit": "equal",
                      "note": f"sha256 of the outputs {digests[False]} / {digests[True]} (prefix cache off)"}))
    return rows


def match_rate(engine, work, concurrent) -> dict:
    """Rerun requests one at a time: the share whose greedy tokens equal those of the concurrent run
    (exact in float32; bf16 kernels are not batch-invariant, so a different batch may round a
    near-tie differently and the two continuations part from there)."""
    from meshlab.infer.sampler import SamplingParams
    same, first_diff = 0, []
    for (prompt, m), req in zip(work, concurrent):
        alone = engine.generate([prompt], SamplingParams(max_tokens=m))[0].output
        same += alone == req.output
        if alone != req.output:
            first_diff.append(next(i for i, (a, b) in enumerate(zip(alone, req.output)) if a != b))
    return emit({"section": "offline", "setting": f"greedy alone == concurrent, {len(work)} requests",
                 "value": same / max(len(work), 1), "unit": "share", "first_difference_at": first_diff,
                 "note": f"{same}/{len(work)} equal; differing ones part at token {first_diff}"})


# -- HTTP -------------------------------------------------------------------------------------
def completion_body(prompt, max_tokens: int, logprobs: bool) -> bytes:
    """A streamed greedy completion's body. Tokens per chunk are counted from the usage each chunk
    carries (`continuous_usage_stats`: the byte tokenizer of a random model shows most ids as no text,
    so text alone would not say when tokens came). logprobs: also ask for the chosen tokens' logprobs
    (the engine's offline run does not)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if logprobs:
        body["logprobs"] = 0
    return json.dumps(body).encode()


def stream_one(host: str, port: int, body: bytes, timeout: float = 600) -> dict:
    """One streaming completion (completion_body); the time of every chunk that carries tokens, the
    total from the final usage."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    times, counts, usage, status, seen = [], [], None, 0, 0
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status = resp.status
        if status != 200:
            return {"status": status, "error": resp.read()[:200].decode(errors="replace"), "t0": t0}
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            k = usage["completion_tokens"] - seen if usage and obj.get("choices") else 0
            if k > 0:
                times.append(time.perf_counter())
                counts.append(k)
                seen += k
    except (OSError, http.client.HTTPException) as e:
        return {"status": status or -1, "error": f"{type(e).__name__}: {e}", "t0": t0}
    finally:
        conn.close()
    n = usage["completion_tokens"] if usage else sum(counts)
    return {"status": status, "t0": t0, "t_end": time.perf_counter(), "tokens": n,
            "ttft": times[0] - t0 if times else None,
            "tpot": (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1 else None}


def http_load(host: str, port: int, work, rate: float, logprobs: bool = False, seed: int = 0) -> dict:
    """The workload with Poisson arrivals at `rate` requests/s (one thread per request). Bodies are
    encoded and threads started before the clock starts, so the clients' own start-up (~1 ms of this
    process's interpreter per request) does not hold back the arrivals."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(work))
    starts = np.cumsum(gaps) - gaps[0]
    bodies = [completion_body(p, m, logprobs) for p, m in work]
    results, go, t0 = [None] * len(work), threading.Event(), [0.0]

    def client(i):
        go.wait()
        delay = t0[0] + starts[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        results[i] = stream_one(host, port, bodies[i])

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(work))]
    for t in threads:
        t.start()
    t0[0] = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    t0 = t0[0]
    ok = [r for r in results if r and r["status"] == 200 and "error" not in r]
    wall = max(r["t_end"] for r in ok) - t0 if ok else float("nan")
    out_tok = sum(r["tokens"] for r in ok)
    setting = f"poisson rate={rate:g}/s n={len(work)}" + (" logprobs" if logprobs else "")
    row = {"section": "http", "setting": setting, "value": out_tok / wall, "unit": "tok/s", "rate": rate,
           "req_s": len(ok) / wall, "ok": len(ok), "failed": len(work) - len(ok),
           "errors": sorted({str(r.get("error", r["status"]))[:80] for r in results if r not in ok})[:3],
           **latency_summary([r["ttft"] for r in ok if r["ttft"] is not None],
                             [r["tpot"] for r in ok if r["tpot"] is not None])}
    row["note"] = (f"{row['req_s']:.1f} req/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f}, "
                   f"TPOT p50 {row['tpot_p50_ms']:.1f} ms p99 {row['tpot_p99_ms']:.1f}, {row['failed']} failed")
    return emit(row)


# -- a simulated device: the host path on a CPU ---------------------------------------------------
class _Pending:
    """A device output that is ready at `end` (perf_counter seconds): reading it sleeps until then, the
    interpreter lock let go, as reading a device array does."""

    def __init__(self, value: np.ndarray, end: float):
        self.value, self.end = value, end

    def _wait(self):
        if self.end > time.perf_counter():
            time.sleep(self.end - time.perf_counter())

    def __array__(self, dtype=None, copy=None):
        self._wait()
        return self.value

    def block_until_ready(self):
        self._wait()
        return self

    def copy_to_host_async(self):
        pass


class SimulatedDevice:
    """An Engine whose device calls sample uniform random tokens at once and take a modeled time on one
    device timeline (a call starts when the previous one ends; each returns (cache, seen, outputs), as
    the engine's calls do): decode calls n * (step_s + row_s * b), packed steps packed_s + row_s *
    n_dec + token_s * chunk tokens; each dispatch holds the host for dispatch_s. The engine's and the
    server's host work are real, so the server's cost against the offline engine shows on a CPU in the
    regime of a GPU (the defaults: llama3_1b's on the H200, about)."""

    def __init__(self, engine, step_s=1.5e-3, row_s=4e-5, packed_s=2e-3, token_s=4e-6, dispatch_s=3e-4,
                 vocab=128256, seed=0):
        self.free, self.rng, self.vocab = 0.0, np.random.default_rng(seed), vocab
        self.step_s, self.row_s, self.packed_s, self.token_s, self.dispatch_s = step_s, row_s, packed_s, token_s, \
            dispatch_s
        engine.decode_call, engine.packed_call = self.decode, self.packed

    def _outputs(self, shape, cost, logprobs):
        t = time.perf_counter()
        while time.perf_counter() - t < self.dispatch_s:          # the host's part of a dispatch
            pass
        self.free = max(self.free, time.perf_counter()) + cost
        out = {"tokens": self.rng.integers(0, self.vocab, shape).astype(np.int32)}
        if logprobs is not None:
            k = 20 if logprobs else 0
            out.update(logprob=-self.rng.random(shape).astype(np.float32), top_id=np.zeros(shape + (k,), np.int32),
                       top_logprob=np.zeros(shape + (k,), np.float32))
        return {key: _Pending(v, self.free) for key, v in out.items()}, out["tokens"]

    def decode(self, weights, cache, seen, buf, layout, n, greedy, logprobs, cut=None):
        b = dict((name, shape) for name, shape, _ in layout)["pos"][0]
        return cache, seen, self._outputs((n, b), n * (self.step_s + self.row_s * b), logprobs)[0]

    def packed(self, weights, cache, seen, buf, layout, greedy, logprobs, score=None, cut=None, ranks=False):
        shapes = dict((name, shape) for name, shape, _ in layout)
        nd, t = shapes["p.dec_len"][0], shapes["p.tokens"][0]
        cost = self.packed_s + self.row_s * nd + self.token_s * (t - nd)
        return cache, seen, self._outputs((shapes["p.out_idx"][0],), cost, logprobs)[0]


def simulated(n: int, logprobs: bool, seed: int = 0) -> list[dict]:
    """The load's shape (128 rows, 8 steps per call, outputs U[64, 256]) on the tiny model with a
    SimulatedDevice (prompts U[16, 128], chunk 128): offline, then all at once through the HTTP server
    in this process (the clients in another)."""
    import dataclasses
    import os
    import subprocess
    import sys
    import models
    from meshlab.infer.engine import Engine
    from meshlab.infer.loading import random_params
    from meshlab.infer.server import Server
    from meshlab.tokenizer import ByteTokenizer
    from models import model_def
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=1)
    eng = Engine(model_def(cfg), random_params(cfg), max_len=512, max_seqs=128, page_size=16, chunk=128,
                 steps_per_call=8)
    SimulatedDevice(eng, seed=seed)
    eng.warmup()                              # each bucket's first call, so none counts as a compile
    wl = dict(prompt=(16, 128), output=(64, 256), vocab=cfg.vocab_size)
    row, _ = offline(eng, workload(n, seed=seed, **wl), "simulated device")
    srv = Server(eng, ByteTokenizer(), "sim", "127.0.0.1", 0, max_concurrent=4 * n, max_waiting=4 * n).start()
    code = ("import json, sys; from meshlab.bench import serve as bs; "
            f"w = bs.workload({n}, seed={seed}, **{wl!r}); bs.http_load('127.0.0.1', {srv.port}, w, 1e6, {logprobs})")
    rows = [row]
    try:
        for _ in range(2):                    # the first warms the server's Python paths
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
            got = [json.loads(x[4:]) for x in out.stdout.splitlines() if x.startswith("ROW ")]
            if not got:
                raise RuntimeError(f"the load's client failed: {out.stderr[-500:]}")
        http_row = dict(got[0], setting="simulated device " + got[0]["setting"], ratio=got[0]["value"] / row["value"])
        http_row["note"] += f"; {http_row['ratio']:.0%} of offline"
        rows.append(emit(http_row))
    finally:
        srv.stop()
    return rows


# -- one engine, one request at a time (scripts/bench_decode.py's engine job) -----------------
def roofline(engine, bw: float, ctx: int, batch: int = 1) -> float:
    """Decode tokens/s if every step read the weights once and each row its ctx tokens' K/V at `bw`."""
    from meshlab.infer import kv_cache
    kv_bytes = kv_cache.cache_bytes(engine.md.cfg, 1, engine.cache["k"].dtype)   # an fp8 cache: half
    return bw / (weights_read_per_step(engine.params, engine.md.cfg, batch) + batch * ctx * kv_bytes) * batch


def _prompt(rng, engine, n):
    return rng.integers(0, engine.md.cfg.vocab_size, size=n).tolist()


def _time(engine, prompts, max_tokens) -> float:
    from meshlab.infer.sampler import SamplingParams
    t = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return time.perf_counter() - t


def ttft(engine, lengths, tag: str = "", reps: int = 1) -> list[dict]:
    """Time to first token of fresh prompts per length (prefill in chunks + the first sample), the
    median of reps; a warm call on another prompt first, so neither compiles nor the prefix cache count."""
    rng = np.random.default_rng(0)
    out = []
    for n in lengths:
        _time(engine, [_prompt(rng, engine, n)], 1)
        times = [_time(engine, [_prompt(rng, engine, n)], 1) for _ in range(reps)]
        spread = f", {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms over {reps}" if reps > 1 else ""
        out.append(emit({"section": "ttft", "setting": f"engine prompt={n}{tag}", "value": float(np.median(times)) * 1e3,
                         "unit": "ms", "note": f"chunk {engine.chunk}, uncached{spread}"}))
    return out


def _first_token(engine, prompt) -> tuple[float, float]:
    """(seconds from the call to its first token on the host, seconds of the whole call) of one
    greedy one-token request (the whole call also frees the request's pages after that token)."""
    from meshlab.infer.sampler import SamplingParams
    t = time.perf_counter()
    req = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
    return req.t_first - t, time.perf_counter() - t


def prefix_ttft(engine, n: int = 2048, tail: int = 16, reps: int = 5, tag: str = "") -> list[dict]:
    """TTFT (from the call to the first token, medians of `reps`, all warm) of n-token prompts whose
    first n - tail tokens are in the prefix cache, and of an n-token prompt met before (all cached:
    the LM head over its last page's kept hidden state, or with the engine's reuse_hidden off its last
    token fed again), against n-token prompts uncached. tag: appended to each
    row's setting (the engine variant measured)."""
    rng = np.random.default_rng(1)
    med = lambda xs, i: float(np.median([x[i] for x in xs]))   # noqa: E731
    _first_token(engine, _prompt(rng, engine, n))
    cold = [_first_token(engine, _prompt(rng, engine, n)) for _ in range(reps)]
    shared = _prompt(rng, engine, n - tail)
    again = shared + _prompt(rng, engine, tail)
    _first_token(engine, again)                                             # caches the prefix, warms the programs
    rows = []
    for label, prompts in ((f"{n - tail} cached", [shared + _prompt(rng, engine, tail) for _ in range(reps)]),
                           ("all cached", [again] * reps)):
        before = dict(engine.stats)
        warm = [_first_token(engine, p) for p in prompts]
        hit, fed = ((engine.stats[k] - before[k]) // reps for k in ("prefix_hit_tokens", "prefill_tokens"))
        ratio = med(warm, 0) / med(cold, 0)
        rows.append(emit({"section": "ttft", "setting": f"engine prompt={n}, {label}{tag}", "value": med(warm, 0) * 1e3,
                          "unit": "ms", "uncached_ms": med(cold, 0) * 1e3, "ratio": ratio,
                          "wall_ms": med(warm, 1) * 1e3, "uncached_wall_ms": med(cold, 1) * 1e3,
                          "note": f"{hit} tokens from the prefix cache, {fed} fed; uncached {med(cold, 0) * 1e3:.1f} ms; "
                                  f"{ratio:.1%} of uncached (call to first token, median of {reps}; whole calls "
                                  f"{med(warm, 1) * 1e3:.2f} vs {med(cold, 1) * 1e3:.1f} ms)"}))
    return rows


def tpot_between(t_short: float, t_long: float, tokens: int) -> float:
    """Seconds per token from two timed runs that differ by `tokens` decode steps; NaN when the longer
    run took no longer (timer noise over tiny work, as on a CPU): the difference measures nothing."""
    dt = t_long - t_short
    return dt / tokens if dt > 0 and tokens > 0 else float("nan")


def sweep_row(b: int, ctx: int, tag: str, t_short: float, t_long: float, tokens: int, roof: float) -> dict:
    """engine_sweep's row for batch b: tokens/s and TPOT from the two timings, or NaN with a note."""
    tpot = tpot_between(t_short, t_long, tokens)
    row = {"section": "sweep", "setting": f"engine b={b} ctx={ctx}{tag}", "value": b / tpot, "unit": "tok/s",
           "batch": b, "tpot_ms": tpot * 1e3, "frac_roofline": b / tpot / roof}
    if tpot != tpot:
        row["note"] = (f"not measurable: {tokens} more tokens took {(t_long - t_short) * 1e3:+.2f} ms "
                       f"({t_short * 1e3:.2f} vs {t_long * 1e3:.2f} ms), within timer noise")
    else:
        row["note"] = f"TPOT {tpot * 1e3:.2f} ms; {b / tpot / roof:.0%} of the roofline {roof:.0f} tok/s"
    return row


def _tpot(run, n: int, reps: int) -> tuple[float, list]:
    """(median, all) of `reps` TPOTs: (time of n tokens - time of 1) / (n - 1), each pair run back to back."""
    tpots = []
    for _ in range(reps):
        t1 = run(1)
        tpots.append(tpot_between(t1, run(n), n - 1))
    return float(np.median(tpots)), tpots


def engine_tpot(engine, bw: float, ctx: int = 2048, n: int = 256, tag: str = "", reps: int = 3) -> dict:
    """Decode tokens/s of one request at context ~ctx through the engine (host loop included), the
    median of `reps` measures, against the HBM roofline at `bw` (weights + ctx tokens' K/V per
    token); tag: appended to the setting (the engine variant measured)."""
    prompt = list(range(1, ctx - n // 2))                                   # contexts average ctx
    _time(engine, [prompt], n)                                              # warm; caches the prompt
    _time(engine, [prompt], n)                                              # the cached prompt's programs
    tpot, tpots = _tpot(lambda m: _time(engine, [prompt], m), n, reps)
    roof = roofline(engine, bw, ctx) if bw else float("nan")
    return emit({"section": "decode", "setting": f"engine b=1 ctx={ctx}{tag}", "value": 1 / tpot, "unit": "tok/s",
                 "tpot_ms": tpot * 1e3, "frac_roofline": 1 / tpot / roof, "all_tok_s": [1 / t for t in tpots],
                 "note": f"TPOT {tpot * 1e3:.2f} ms incl. host, {engine.steps_per_call} steps per call, median of "
                         f"{reps} ({min(1 / t for t in tpots):.0f}-{max(1 / t for t in tpots):.0f} tok/s); "
                         f"{1 / tpot / roof:.0%} of the roofline {roof:.0f} tok/s at {bw / 1e9:.0f} GB/s"})


def engine_sweep(engine, bw: float, batches, ctx: int = 2048, n: int = 128, tag: str = "") -> list[dict]:
    """b requests of distinct ~ctx-token prompts decoding together: TPOT and tokens/s per batch.
    TPOT = (time of n tokens - time of n/4 tokens) / (3n/4), both with the prompts already cached
    and every program they use compiled by three untimed runs (the third as the timed one: cached
    prompts admitted while others decode take first-token steps of the full batch's bucket). The
    short run is n/4 tokens, not 1: requests are admitted in waves as pages allow, and a 1-token
    run ends each wave at its first token (a prompt met again: a head call) where the long run
    feeds later waves beside decoding rows (a decode step): the difference would count those
    steps as decode time."""
    rng = np.random.default_rng(2)
    out = []
    for b in batches:
        prompts = [_prompt(rng, engine, ctx - n // 2) for _ in range(b)]   # contexts average ctx
        _time(engine, prompts, n)                                           # prefill (now cached), compiles
        m = max(1, n // 4)
        _time(engine, prompts, m)                                           # compiles the cached-tail step
        _time(engine, prompts, n)                                           # and the timed run's mixed steps
        t_m = _time(engine, prompts, m)
        t_n = _time(engine, prompts, n)
        roof = roofline(engine, bw, ctx, b) if bw else float("nan")
        out.append(emit(sweep_row(b, ctx, tag, t_m, t_n, n - m, roof)))
    return out


def _post(port, body):
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    return time.perf_counter() - t, out


def server_rows(engine, bw: float, ttft_len=2048, n=256, ctx=2048, reps: int = 3) -> list[dict]:
    """The same engine behind the HTTP server: b=1 decode tokens/s (vs the roofline) and one TTFT."""
    from meshlab.infer.server import Server
    from meshlab.tokenizer import ByteTokenizer
    srv = Server(engine, ByteTokenizer(), "bench", "127.0.0.1", 0).start()
    out = []
    try:
        prompt = list(range(1, ctx - n // 2))
        _post(srv.port, {"prompt": prompt, "max_tokens": n, "temperature": 0})                  # warm

        def run(m):
            t, body = _post(srv.port, {"prompt": prompt, "max_tokens": m, "temperature": 0})
            assert body["usage"]["completion_tokens"] == m, body["usage"]   # greedy, no stop: all m tokens
            return t
        tpot, tpots = _tpot(run, n, reps)
        roof = roofline(engine, bw, ctx) if bw else float("nan")
        out.append(emit({"section": "decode", "setting": f"http b=1 ctx={ctx}", "value": 1 / tpot, "unit": "tok/s",
                         "frac_roofline": 1 / tpot / roof, "all_tok_s": [1 / t for t in tpots],
                         "note": f"TPOT {tpot * 1e3:.2f} ms, {n} tokens, median of {reps} "
                                 f"({min(1 / t for t in tpots):.0f}-{max(1 / t for t in tpots):.0f} tok/s); "
                                 f"{1 / tpot / roof:.0%} of the roofline"}))
        rng = np.random.default_rng(3)
        ts = [_post(srv.port, {"prompt": _prompt(rng, engine, ttft_len), "max_tokens": 1, "temperature": 0})[0] for _ in range(reps)]
        out.append(emit({"section": "ttft", "setting": f"http prompt={ttft_len}", "value": float(np.median(ts)) * 1e3,
                         "unit": "ms", "note": f"uncached, median of {reps} fresh prompts (whole request)"}))
    finally:
        srv.stop()
    return out
