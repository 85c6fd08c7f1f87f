"""bench_decode.py's jobs over fp8 storage (each takes the child's context, decode_jobs.Child): fp8
weights against bf16 through the engine (`job_fp8`, FP8 GEMMs against widened matrices too) and an fp8
KV cache against bf16 K/V (`job_kv_fp8`)."""
from __future__ import annotations

from meshlab.bench.decode_jobs import Child, engine_ab_job


def job_fp8(c: Child):
    """Batch-1 decode and prefix-cache TTFT (with the uncached prompt's) through the shipped kernels
    layers in bf16, then with the layers' matrices in fp8 (Engine(quantize="fp8")), each against its own
    roofline (its weights' bytes), in one process: fp8 as shipped (prompt chunks in FP8 GEMMs) and with
    every step's matrices widened to bf16 instead (W8A16); the greedy tokens of one prompt from each
    (random weights: how often fp8 keeps the bf16 argmax, not a quality measure). Then the three at
    batch 128 / 256, where fp8's decode steps reach FP8_GEMM_ROWS (below it, at batch 16: the "fp8"
    rows of docs/benchmarks.md, XLA's GEMMs over widened weights in both fp8 variants)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import serve as bs
    from models.serving import fp8_gemm_rows
    never = 1 << 30
    variants = ((" [kernels bf16]", {}, None), (" [fp8]", {"quantize": "fp8"}, None),
                (" [fp8 w8a16]", {"quantize": "fp8"}, never))
    rates = {}
    for tag, kw, rows in variants:
        with fp8_gemm_rows(rows):
            rates[tag] = engine_ab_job(c, tag, layers="kernels", **kw)
    fp8, bf16 = rates[" [fp8]"], rates[" [kernels bf16]"]
    if fp8 and bf16:
        bench.emit({"section": "decode", "setting": "engine b=1 fp8 against bf16", "value": fp8 / bf16, "unit": "x",
                    "note": f"{fp8:.1f} against {bf16:.1f} tok/s (means of each engine's two rows)"})
    batches, ctx, n = ((4,), c.sz["ctx"], 16) if c.smoke else ((128, 256), c.sz["ctx"], 128)
    for tag, kw, rows in variants:
        with fp8_gemm_rows(rows):
            try:
                eng = c.engine(layers="kernels", max_seqs=max(batches), max_len=-(-(ctx + n) // 16) * 16, **kw)
                bs.engine_sweep(eng, c.bw, batches, ctx=ctx, n=n, tag=tag)
                del eng                                         # its cache before the next engine's
            except Exception as e:  # noqa: BLE001
                bench.fail_row("sweep", "engine" + tag, e)


def job_kv_fp8(c: Child):
    """The batch sweep at ctx 2k through two shipped engines in one process, one over a bf16 KV cache and
    one over an fp8 cache (Engine(kv_cache_dtype="fp8")), alternated batch by batch, each against its own
    roofline (fp8 K/V: half the bytes a row reads); then the greedy tokens of one prompt from each
    (random weights: how long fp8 K/V keep bf16's argmax, not a quality measure)."""
    from meshlab.bench import decode as bench
    from meshlab.bench import serve as bs
    from meshlab.infer.sampler import SamplingParams
    batches, ctx, n = ((1, 4), c.sz["ctx"], 16) if c.smoke else ((1, 16, 64, 128), c.sz["ctx"], 128)
    engines = {kv: c.engine(max_seqs=max(batches), max_len=-(-(ctx + n) // 16) * 16, kv_cache_dtype=kv)
               for kv in ("auto", "fp8")}
    for b in batches:
        for kv, eng in engines.items():
            try:
                bs.engine_sweep(eng, c.bw, (b,), ctx=ctx, n=n, tag=f" [kv {kv}]")
            except Exception as e:  # noqa: BLE001
                bench.fail_row("sweep", f"engine b={b} [kv {kv}]", e)
    prompt = list(range(7, 7 + ctx // 2))
    toks = {kv: eng.generate([prompt], SamplingParams(max_tokens=32))[0].output for kv, eng in engines.items()}
    same = next((i for i, (a, b) in enumerate(zip(toks["auto"], toks["fp8"])) if a != b), len(toks["auto"]))
    bench.emit({"section": "tokens", "setting": "greedy [kv fp8] against [kv auto]", "value": float(same), "unit": "tokens",
                "note": f"first {same} of 32 greedy tokens equal; auto {toks['auto']}; fp8 {toks['fp8']}"})
