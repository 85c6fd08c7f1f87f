"""Speculative decoding by prompt lookup on a checkpoint's own held-out text: for each number of draft
tokens k, one request at a time (batch 1, greedy) over the same windows, the tokens each step kept,
the share of drafts kept, tokens/s, and whether the tokens equal k = 0's (scripts/bench_speculative.py).
"""
from __future__ import annotations

import datetime
import time

import jax


def measure(md, params, prompts, ks=(0, 2, 4), max_tokens: int = 128, temperature: float = 0.0,
            **engine_kw) -> list[dict]:
    """One row per k: tokens/s over the prompts (each alone, after one untimed request compiled the
    programs), tokens a step (engine steps: a call of n steps counts n, so a call's steps past its
    rows' ends count too), drafts checked and kept, and (greedy) outputs equal to the first k's.
    temperature > 0: request i samples with seed i."""
    from meshlab.infer.engine import Engine
    from meshlab.infer.sampler import SamplingParams
    sp = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i) for i in range(len(prompts))]
    rows, reference = [], None
    for k in ks:
        engine = Engine(md, params, speculative_tokens=k, max_seqs=1, **engine_kw)
        engine.generate(prompts[:1], sp[:1])
        before, t0 = dict(engine.stats), time.perf_counter()
        outputs = [engine.generate([p], s)[0].output for p, s in zip(prompts, sp)]
        seconds = time.perf_counter() - t0
        grew = {key: engine.stats[key] - before[key] for key in ("generated_tokens", "steps", "spec_drafted",
                                                                  "spec_accepted")}
        reference = outputs if reference is None else reference
        rows.append({"k": k, "tokens_per_s": grew["generated_tokens"] / seconds,
                     "tokens_per_step": grew["generated_tokens"] / max(grew["steps"], 1),
                     "drafted": grew["spec_drafted"], "kept": grew["spec_accepted"],
                     "kept_share": grew["spec_accepted"] / max(grew["spec_drafted"], 1),
                     "equal": None if temperature else sum(a == b for a, b in zip(outputs, reference)),
                     "requests": len(prompts)})
    return rows


def table(rows: list[dict], setting: str) -> str:
    """Dated markdown rows (docs/archive/benchmarks-diary.md's form) of measure's rows."""
    day, device = datetime.date.today().isoformat(), jax.devices()[0].device_kind
    lines = ["| date | device | setting | k | tokens/s | tokens a step | drafts kept | equal to k=0 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {day} | {device} | {setting} | {r['k']} | {r['tokens_per_s']:.1f} | {r['tokens_per_step']:.2f} | "
                     f"{r['kept']} / {r['drafted']} ({r['kept_share']:.0%}) | "
                     f"{'-' if r['equal'] is None else r['equal']} / {r['requests']} |")
    return "\n".join(lines)
