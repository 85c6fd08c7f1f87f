"""Where the first token of a prompt with a cached prefix goes (the prefix-cache TTFT's profile).

`engine_tail_profile` sends prompts of n tokens whose first n - tail are in the prefix cache through
`Engine.generate` (programs compiled, one request at a time) and splits each call's time:

  before dispatch  generate called .. the packed program's dispatch begins: add_request (ids
                   checked), admission (prefix lookup, pages), plan, the input buffer filled
  dispatch         the jitted call returns (argument handling, the input's host-to-device copy,
                   the launch of the program's kernels or CUDA graphs)
  device wait      .. the sampled tokens are on the host (the program's remaining device time)
  to first token   .. the request's first token is stamped (Request.t_first)
  after            .. generate returns (release: pages back to the pool)

`dispatch_variants` then calls that packed program alone (padding only: nothing is written) in
variants, each timed for its dispatch (input as numpy, as the engine passes it; already on the
device, a new buffer each call while the last is alive (a new address); a new one with the last
freed first (its address likely reused); the same device buffer each call) and for the whole call
to the tokens on the host:
  jit           the engine's jitted program (what a request runs)
  aot           the same lowered and compiled ahead of time, its executable called directly (no
                static-argument hashing or jit cache lookup)
  aot_nocmdbuf  compiled with compiler_options {"xla_gpu_enable_command_buffer": ""}: no CUDA
                graphs, every kernel launched by the host (what a command buffer's record or
                update costs against plain launches)
plus "pinned": the input put into pinned host memory and moved to the device inside the program;
and measures device_put of the input alone, and the dispatch of a trivial program that takes the
engine's weights, cache and seen-mask as arguments against one that takes only the input (what the
~100 argument leaves cost a dispatch).
"""
from __future__ import annotations

import time

import jax
import numpy as np

from meshlab.infer.sampler import SamplingParams

NO_CMDBUF = {"xla_gpu_enable_command_buffer": ""}
# XLA options for the packed programs, by name (bench_decode.py's MESHLAB_BENCH_PACKED_XLA): whether
# Triton GEMM fusions (which can take the elementwise ops around a GEMM in) or cuBLAS (Lt) GEMMs
# run the short prompt rows' matmuls; a 16-token row's program is ~270 kernels, a third of its
# device time in small fusions between the GEMMs.
PACKED_OPTIONS = {"triton_any": {"xla_gpu_triton_gemm_any": True},
                  "no_triton": {"xla_gpu_enable_triton_gemm": False},
                  "cublaslt": {"xla_gpu_enable_cublaslt": True}}


def _median_us(times) -> float:
    return round(float(np.median(times)) * 1e6, 1)


def _timed(fn, reps: int, before=None) -> float:
    """Median us of fn()'s return (its outputs waited for after the clock stops); before() untimed."""
    times = []
    for _ in range(reps):
        arg = before() if before else None
        t = time.perf_counter()
        res = fn(arg)
        times.append(time.perf_counter() - t)
        jax.block_until_ready(res)
        del res            # the outputs freed before the next call, as the engine's are (the input
        #                    stays alive while `before` makes the next: the "device" variant's new address)
    return _median_us(times)


def dispatch_variants(engine, key, reps: int = 10) -> dict:
    """The packed program of `key` ("packed", n_dec, k, width, greedy, logprobs, score, ranks, cut) called alone in the
    variants of the module doc; us (medians of reps) keyed "{variant}_dispatch_{numpy|device|reuse|same}_us"
    and "{variant}_call_us" (numpy input, to the tokens on the host), plus "put_us", "args_*_us" and
    the compile seconds of the ahead-of-time variants."""
    _, nd, k, c, greedy, logprobs, _, _, cut = key     # a tail never scores
    slots = engine._packed_slots(nd, k, c)
    slots.fill()                                          # padding only: no cache write, no request
    static = dict(layout=slots.layout, greedy=greedy, logprobs=logprobs, score=None, cut=cut, ranks=False)
    programs, out = {"jit": lambda w, cache, seen, buf: engine.packed_call(w, cache, seen, buf, **static)}, {}
    lowered = engine.packed_call.lower(engine.weights, engine.cache, engine.seen, slots.take(), **static)
    for name, opts in (("aot", None), ("aot_nocmdbuf", NO_CMDBUF)):
        t = time.perf_counter()
        try:
            programs[name] = lowered.compile(opts)
            out[f"{name}_compile_s"] = round(time.perf_counter() - t, 1)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            out[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    same = jax.block_until_ready(jax.device_put(slots.take()))
    fresh = lambda: jax.block_until_ready(jax.device_put(slots.take()))   # noqa: E731
    held = []

    def reuse():
        """A new device array whose predecessor was freed first (its memory, likely its address, reused):
        against `fresh` (the old one alive: a new address), it tells a new address from a new array."""
        while held:
            held.pop().delete()
        held.append(fresh())
        return held[0]

    def call(fn, buf):
        engine.cache, engine.seen, res = fn(engine.weights, engine.cache, engine.seen, buf)
        return res
    for name, fn in programs.items():
        jax.block_until_ready(call(fn, slots.take()))     # warm (a new executable's first call)
        for label, before in (("numpy", slots.take), ("device", fresh), ("reuse", reuse), ("same", lambda: same)):
            out[f"{name}_dispatch_{label}_us"] = _timed(lambda buf, fn=fn: call(fn, buf), reps, before)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            np.asarray(call(fn, slots.take())["tokens"])
            times.append(time.perf_counter() - t)
        out[f"{name}_call_us"] = _median_us(times)
    out["put_us"] = _timed(lambda _: jax.block_until_ready(jax.device_put(slots.take())), reps)
    out.update(_pinned_variant(engine, slots, static, call, reps))
    many = jax.jit(lambda w, cache, seen, buf: buf + 1, keep_unused=True)
    one = jax.jit(lambda buf: buf + 1)
    leaves = len(engine.weights) + len(jax.tree.leaves(engine.cache)) + 1
    jax.block_until_ready((many(engine.weights, engine.cache, engine.seen, same), one(same)))
    out[f"args_{leaves + 1}_us"] = _timed(lambda _: many(engine.weights, engine.cache, engine.seen, same), reps)
    out["args_1_us"] = _timed(lambda _: one(same), reps)
    out["arg_leaves"] = leaves + 1
    # the engine's own names for the jit variant (earlier rows of the archive)
    out.update({f"dispatch_{label}_us": out[f"jit_dispatch_{label}_us"] for label in ("numpy", "device", "same")})
    return out


def _pinned_variant(engine, slots, static, call, reps: int) -> dict:
    """The input put into pinned host memory (a host copy) and moved to the device inside the program
    (XLA's own copy on the program's stream), instead of the runtime's host-to-device transfer before
    it: "pinned_dispatch_numpy_us" (the put and the dispatch), "pinned_dispatch_same_us" (the same
    pinned buffer each call) and "pinned_call_us" (put to tokens on the host)."""
    from jax.sharding import SingleDeviceSharding
    try:
        dev = next(iter(engine.cache["k"].devices()))
        host, on_dev = (SingleDeviceSharding(dev, memory_kind=k) for k in ("pinned_host", "device"))
        fn = jax.jit(lambda w, cache, seen, buf: engine.packed_call(w, cache, seen, jax.device_put(buf, on_dev), **static),
                     donate_argnums=(1, 2))
        put = lambda: jax.device_put(slots.take(), host)   # noqa: E731
        same = jax.block_until_ready(put())
        jax.block_until_ready(call(fn, same))
        out = {"pinned_dispatch_numpy_us": _timed(lambda _: call(fn, put()), reps),
               "pinned_dispatch_same_us": _timed(lambda _: call(fn, same), reps)}
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            np.asarray(call(fn, put())["tokens"])
            times.append(time.perf_counter() - t)
        out["pinned_call_us"] = _median_us(times)
        return out
    except Exception as e:  # noqa: BLE001 - a variant this backend cannot run is reported, not fatal
        return {"pinned_error": f"{type(e).__name__}: {str(e)[:160]}"}


def variants_note(row: dict) -> str:
    """One line per variant: dispatch numpy / device / same, and the whole call."""
    parts = []
    for name in ("jit", "aot", "aot_nocmdbuf"):
        if f"{name}_call_us" in row:
            parts.append(f"{name}: dispatch {row[f'{name}_dispatch_numpy_us']:.0f} us numpy / "
                         f"{row[f'{name}_dispatch_device_us']:.0f} new device buffer / "
                         f"{row[f'{name}_dispatch_reuse_us']:.0f} new one, old freed first / "
                         f"{row[f'{name}_dispatch_same_us']:.0f} same buffer, call to tokens {row[f'{name}_call_us']:.0f}")
        elif f"{name}_error" in row:
            parts.append(f"{name}: {row[f'{name}_error']}")
    if "pinned_call_us" in row:
        parts.append(f"pinned: put + dispatch {row['pinned_dispatch_numpy_us']:.0f} us / same pinned buffer "
                     f"{row['pinned_dispatch_same_us']:.0f}, call to tokens {row['pinned_call_us']:.0f}")
    elif "pinned_error" in row:
        parts.append(f"pinned: {row['pinned_error']}")
    if "put_us" in row:
        many = row["args_{}_us".format(row["arg_leaves"])]
        parts.append(f"device_put alone {row['put_us']:.0f} us; a trivial program's dispatch with "
                     f"{row['arg_leaves']} argument leaves {many:.0f} us, with 1 {row['args_1_us']:.0f} us")
    return "; ".join(parts)


def _timeline(engine, prompts, leaves: list | None = None) -> tuple[list, list, dict]:
    """Each prompt through engine.generate (max_tokens=1) with the call's time split (module doc);
    returns ([per-call {piece: seconds}], the programs launched, the engine's counters over all).
    leaves: gets each call's argument leaves (weights, cache, seen-mask and the call's own inputs)."""
    marks, launch, fetch = {}, engine._launch, engine._fetch
    keys = []

    def timed_launch(key, *a, **kw):
        keys.append(key)
        if leaves is not None:
            weights = kw.get("weights") or engine.weights          # a head call takes a few
            leaves.append(len(jax.tree.leaves((weights, engine.cache, engine.seen, a[1:]))))
        marks.setdefault("l0", time.perf_counter())
        out = launch(key, *a, **kw)
        marks["l1"] = time.perf_counter()
        return out

    def timed_fetch(out):
        res = fetch(out)
        marks["f1"] = time.perf_counter()
        return res
    engine._launch, engine._fetch = timed_launch, timed_fetch
    one, rows, before = SamplingParams(max_tokens=1), [], dict(engine.stats)
    try:
        for p in prompts:
            marks.clear()
            t = time.perf_counter()
            req = engine.generate([p], one)[0]
            end = time.perf_counter()
            rows.append({"before_dispatch": marks["l0"] - t, "dispatch": marks["l1"] - marks["l0"],
                         "device_wait": marks["f1"] - marks["l1"], "to_first_token": req.t_first - marks["f1"],
                         "after": end - req.t_first, "ttft": req.t_first - t, "call": end - t})
    finally:
        del engine._launch, engine._fetch
    return rows, keys, {k: engine.stats[k] - before[k] for k in before}


def engine_tail_profile(engine, trace_dir, n: int = 2048, tail: int = 16, reps: int = 5) -> dict:
    """The first token of prompts of n tokens whose first n - tail are cached (the module doc): the
    call's timeline (medians of reps), the packed program's dispatch variants, and the device time
    per kernel of a traced repeat (meshlab.bench.decode._kernel_table). tail=0: one prompt met
    again, all cached (the LM head over its kept hidden state, or with the engine's reuse_hidden off
    its last token fed in a one-step decode call: no dispatch variants)."""
    from meshlab.bench.decode import _kernel_table
    rng = np.random.default_rng(5)
    shared = rng.integers(0, engine.md.cfg.vocab_size, n - tail).tolist()
    new_tail = lambda: rng.integers(0, engine.md.cfg.vocab_size, tail).tolist()  # noqa: E731
    one = SamplingParams(max_tokens=1)
    engine.generate([shared + new_tail()], one)                                  # caches the prefix
    engine.generate([shared + new_tail()], one)                                  # compiles the tail's program
    leaves = []
    rows, keys, st = _timeline(engine, [shared + new_tail() for _ in range(reps)], leaves)
    us = {k: _median_us([r[k] for r in rows]) for k in rows[0]}
    cached = f"{n - tail} cached" if tail else "all cached"
    row = {"section": "profile", "setting": f"engine prompt={n}, {cached}: first token", "unit": "us",
           "value": us["call"], "ttft_ms": us["ttft"] / 1e3, "timeline_us": us,
           "host_ms": st["host_s"] / reps * 1e3, "dispatch_ms": st.get("dispatch_s", 0.0) / reps * 1e3,
           "prefill_tokens": st["prefill_tokens"] // reps, "programs": sorted({tuple(k[:4]) for k in keys}),
           "arg_leaves": sorted(set(leaves))}
    packed = [k for k in keys if k[0] == "packed"]
    if packed:
        row.update(dispatch_variants(engine, packed[0]))

    def traced_repeat():
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            engine.generate([shared + new_tail()], one)
        return 1
    s = _kernel_table(row, trace_dir, traced_repeat)
    if s:           # every kernel's launches: what the host launches one by one without CUDA graphs
        from meshlab.profile_summary import summarize
        row["kernel_launches"] = round(sum(k[2] for k in summarize(trace_dir, steps=1, top=1 << 20)["kernels"]))
    busy = f"device busy {s['busy_ms_per_step'] * 1e3:.0f} us in {row['kernel_launches']} kernels" if s else "no profile"
    line = ", ".join(f"{k} {us[k]:.0f}" for k in ("before_dispatch", "dispatch", "device_wait", "to_first_token", "after"))
    row["note"] = (f"call {us['call'] / 1e3:.2f} ms (first token at {us['ttft'] / 1e3:.2f}; us: {line}), host "
                   f"{row['host_ms']:.2f} ms per call, {row['prefill_tokens']} prompt tokens computed in "
                   f"{[list(k) for k in row['programs']]} ({row['arg_leaves']} argument leaves); {busy}; "
                   f"{variants_note(row)}")
    return row


def host_rows(engine, n: int = 2048, reps: int = 30) -> list[dict]:
    """Host time of the first token of n-token prompts met before up to their last 16 tokens (a packed
    row) and up to their last token (a one-step decode call), one request at a time, medians of reps:
    the timeline's host pieces (before dispatch, dispatch, to the first token, after), the engine's
    host_s per call (its step time less the device waits), the program and its argument leaves."""
    rng, one, out = np.random.default_rng(9), SamplingParams(max_tokens=1), []
    for tail, label in ((16, f"{n - 16} cached"), (0, "all cached")):
        shared = rng.integers(0, engine.md.cfg.vocab_size, n - tail).tolist()
        prompt = lambda: shared + rng.integers(0, engine.md.cfg.vocab_size, tail).tolist()  # noqa: E731
        engine.generate([prompt()], one)
        engine.generate([prompt()], one)                  # compiles the program of the cached call
        leaves = []
        rows, keys, st = _timeline(engine, [prompt() for _ in range(reps)], leaves)
        us = {k: _median_us([r[k] for r in rows]) for k in rows[0]}
        host = us["before_dispatch"] + us["dispatch"] + us["to_first_token"]
        out.append({"section": "host", "setting": f"engine prompt={n}, {label}: first token's host time", "unit": "us",
                     "value": host, "timeline_us": us, "host_us_per_call": round(st["host_s"] / reps * 1e6, 1),
                     "prefill_tokens": st["prefill_tokens"] // reps, "programs": sorted({tuple(k[:4]) for k in keys}),
                     "arg_leaves": sorted(set(leaves)),
                     "note": f"host to the first token {host:.0f} us (before dispatch {us['before_dispatch']:.0f}, "
                             f"dispatch {us['dispatch']:.0f}, after the read-back {us['to_first_token']:.0f}), after it "
                             f"{us['after']:.0f}; device wait {us['device_wait']:.0f}; host_s {st['host_s'] / reps * 1e6:.0f} "
                             f"us per call; {st['prefill_tokens'] // reps} tokens fed in {[list(k[:4]) for k in keys[:1]]}, "
                             f"{sorted(set(leaves))} argument leaves; median of {reps}"})
    return out


def prefill_tiles_ab(make_engine, n: int, names, rounds: int = 2) -> None:
    """prefix_ttft's rows (a 16-token tail after n - 16 cached tokens, all cached, and uncached n-token
    prompts in chunks) through engines whose prompt rows take other paged_prefill tiles: names of
    layer_chain.attention_variants ("default": the kernel's defaults), "served" (prefill_block_sizes
    as shipped, by width) or "xla_merge" (the shipped tiles of each width, the splits merged by XLA
    instead of one launch). Engines are alternated over `rounds`, each call under its own tiles
    (read when a program traces); rows tagged [prefill <name>]."""
    import dataclasses
    from meshlab.bench import serve as bs
    from meshlab.bench.layer_chain import attention_variants
    from pallas_kernels import paged_tiles as pt
    shipped = pt.prefill_block_sizes
    engines = {}
    try:
        for r in range(rounds):
            for name in names:
                if name not in engines:
                    eng = make_engine()
                    # each variant as prefill_block_sizes(chunk) would answer it
                    variants = {k: (lambda chunk=16, tiles=v: tiles) for k, v in
                                attention_variants(eng.sched.max_pages).items()}
                    variants.update(served=shipped,
                                    xla_merge=lambda chunk=16: dataclasses.replace(shipped(chunk), merge="xla"))
                    if name not in variants:
                        raise ValueError(f"prefill tiles {name!r} unknown; known: {', '.join(variants)}")
                    engines[name] = (eng, variants[name])
                eng, pt.prefill_block_sizes = engines[name]
                bs.prefix_ttft(eng, n=n, tag=f" [prefill {name}{', again' if r else ''}]")
    finally:
        pt.prefill_block_sizes = shipped
