"""Request kinds beyond plain generation under the offline workload (scripts/bench_serve.py's score,
guided and shared jobs): an evaluation harness's scoring requests, requests held to a JSON schema,
and requests that share a system prompt, each against its alternative in the same engine.
"""
from __future__ import annotations

import json
import time

from meshlab.bench.decode import emit


def scoring(engine, work, label: str = "engine") -> list[dict]:
    """An evaluation harness's loglikelihood load: every prompt of `work` sent at once as a greedy
    one-token request with prompt logprobs (what lm-evaluation-harness's local-completions sends with
    echo), and with each token's rank too (vLLM's prompt_logprobs), against the same prompts as plain
    one-token requests (prefill through the packed steps) in the same engine: prompt tokens/s of each,
    and the scored requests' tokens against the plain ones'."""
    from meshlab.infer.sampler import SamplingParams
    prompts, rows, outputs, tokens = [p for p, _ in work], [], [], sum(len(p) for p, _ in work)
    vocab = engine.md.cfg.vocab_size
    warm = [[(t + 1) % vocab for t in p] for p in prompts]   # the same lengths (every program), none cached
    for name, sp in (("plain one-token", SamplingParams(max_tokens=1)),
                     ("scored (prompt logprobs 1)", SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)),
                     ("scored with ranks", SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1, prompt_ranks=True))):
        engine.generate(warm, sp)
        t = time.perf_counter()
        outputs.append([r.output for r in engine.generate(prompts, sp)])
        wall = time.perf_counter() - t
        rows.append({"section": "score", "setting": f"{label} {name} n={len(prompts)}", "value": tokens / wall,
                     "unit": "prompt tok/s", "requests_per_s": len(prompts) / wall,
                     "note": f"{len(prompts)} requests, {tokens} prompt tokens in {wall:.2f} s"})
    for row, got in zip(rows[1:], outputs[1:]):
        same = sum(a == b for a, b in zip(outputs[0], got))
        row["note"] += f"; its tokens equal the plain requests' in {same} of {len(prompts)}"
    return [emit(r) for r in rows] + multiple_choice(engine, work, label=label)


def multiple_choice(engine, work, choices: int = 4, label: str = "engine") -> list[dict]:
    """A multiple-choice evaluation's load: a quarter of `work`'s prompts as contexts, each followed by
    `choices` continuations of 1-8 tokens, every request sent at once and scored (prompt logprobs 1,
    one greedy token), with the engine's score store (a context computed once, the others served its
    stored pages) and without it (every choice computes its context), in the same engine: prompt
    tokens/s of each, the prompt tokens computed, and the two runs' largest logprob difference."""
    import numpy as np

    from meshlab.infer.sampler import SamplingParams
    rng, vocab = np.random.default_rng(7), engine.md.cfg.vocab_size
    contexts = [p for p, _ in work[:max(len(work) // 4, 1)]]
    prompts = [c + rng.integers(0, vocab, int(rng.integers(1, 9))).tolist() for c in contexts for _ in range(choices)]
    warm = [[(t + 1) % vocab for t in p] for p in prompts[:8 * choices]]     # other ids: nothing stored for `prompts`
    sp, store, rows, got = SamplingParams(max_tokens=1, prompt_logprobs=1), engine.sched.scores, [], []
    for name, kept in (("without the score store", None), ("with the score store", store)):
        engine.sched.scores = kept       # without: no page's scores kept, so every choice computes its context
        engine.generate(warm, sp)
        fed, t = engine.stats["prefill_tokens"], time.perf_counter()
        reqs = engine.generate(prompts, sp)
        wall, tokens = time.perf_counter() - t, sum(map(len, prompts))
        got.append([np.asarray([x[0] for x in r.prompt_logprobs[1:]]) for r in reqs])
        rows.append({"section": "score", "setting": f"{label} multiple choice {len(contexts)} x {choices}, {name}",
                     "value": tokens / wall, "unit": "prompt tok/s",
                     "note": f"{len(prompts)} requests, {tokens} prompt tokens in {wall:.2f} s, "
                             f"{engine.stats['prefill_tokens'] - fed} computed"})
    engine.sched.scores = store
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(*got))
    rows[-1]["note"] += (f"; {rows[-1]['value'] / rows[0]['value']:.2f}x without; the logprobs differ from the run "
                         f"without by at most {diff:.1e}")
    return [emit(r) for r in rows]


def _runs(engine, work, settings, section: str, label: str) -> list[tuple[dict, list]]:
    """The offline workload once per (name, params) of `settings` (params: one SamplingParams per
    request), after one untimed run of the first, each after a warm run of an eighth of it, each on
    its own prompt ids of the workload's lengths (none finds another's pages cached): (row, requests)
    with output tokens/s and the engine's counters over the run."""
    from meshlab.bench.serve import counters_note
    vocab = engine.md.cfg.vocab_size
    prompts = lambda k: [[(t + k) % vocab for t in p] for p, _ in work]      # noqa: E731
    warm, out = max(len(work) // 8, 1), []
    # the whole workload once, untimed: without it the first timed run paid more host time (on an H100,
    # 5.5 ms of dispatch a call against 1.3-3.3 in the runs after it, the programs all warmed up before)
    engine.generate(prompts(2 * len(settings) + 1), settings[0][1])
    for k, (name, params) in enumerate(settings):
        engine.generate(prompts(2 * k + 1)[:warm], params[:warm])
        before = dict(engine.stats)
        t = time.perf_counter()
        reqs = engine.generate(prompts(2 * k), params)
        wall = time.perf_counter() - t
        st = {key: engine.stats[key] - before[key] for key in before}
        out_tok = sum(len(r.output) for r in reqs)
        out.append(({"section": section, "setting": f"{label} {name} n={len(work)}", "value": out_tok / wall,
                     "unit": "tok/s", "note": f"{out_tok} output tokens in {wall:.2f} s; " + counters_note(st)}, reqs))
    return out


def sampled(engine, work, label: str = "engine", warm: bool = True) -> list[dict]:
    """The offline workload greedy, then sampled at temperature 1 (no cut), at temperature 0.7 with
    top_p 0.9 (an OpenAI client's settings), and with top_k 50 too, in the same engine: output
    tokens/s of each. Sampled rows run the programs without the greedy promise, and those with top_p
    or top_k the programs that find those cuts (meshlab.infer.sampler). warm: compile every bucket of
    those programs first (a timing's compiles would otherwise land in the first run that meets one)."""
    from meshlab.infer.sampler import SamplingParams
    from meshlab.infer.warmup import WARMUP_KINDS
    for kind in ("sampled", "top_p", "top_k") if warm else ():
        engine.warmup(**WARMUP_KINDS[kind])
    settings = [("greedy", {}), ("temperature 1", {"temperature": 1.0}),
                ("temperature 0.7, top_p 0.9", {"temperature": 0.7, "top_p": 0.9}),
                ("temperature 0.7, top_p 0.9, top_k 50", {"temperature": 0.7, "top_p": 0.9, "top_k": 50})]
    runs = _runs(engine, work, [(name, [SamplingParams(max_tokens=m, seed=i, **kw) for i, (_, m) in enumerate(work)])
                                for name, kw in settings], "sampled", label)
    for row, _ in runs[1:]:
        row["note"] += f"; {row['value'] / runs[0][0]['value']:.2f}x greedy"
    return [emit(row) for row, _ in runs]


def guided(engine, work, share: int = 8, label: str = "engine") -> list[dict]:
    """The offline workload free, then with every `share`-th request held to a JSON schema that fixes
    its length (a string of max_tokens - 2 lowercase letters: as many tokens as the free request, one
    byte token each), then with those requests kept to the lowercase letters by allowed_token_ids (a
    fixed mask), then with a two-letter bad word each (a mask that follows each token), in the same
    engine over the model's vocabulary read as bytes: output tokens/s of each, and whether the held
    outputs keep their form. What it costs the other rows: rows whose mask follows their tokens sit
    out the steps planned while their last token is on the device, and decode calls run one step
    while one runs; a fixed mask only takes the row off the greedy programs (meshlab.infer.guided)."""
    from meshlab.infer.guided import Grammars, json_grammar
    from meshlab.infer.sampler import SamplingParams
    from meshlab.tokenizer import ByteTokenizer
    engine.grammars = Grammars(ByteTokenizer(), engine.md.cfg.vocab_size)
    engine.warmup(greedy=False)        # held rows sample through the programs without the greedy promise
    letters, word = list(range(ord("a"), ord("z") + 1)), [ord("e"), ord("e")]
    # name: (a held request's SamplingParams fields given its max_tokens, whether its output kept that form)
    held_by = {"a JSON schema": (lambda m: {"grammar": json_grammar({"type": "string", "pattern": f"^[a-z]{{{m - 2}}}$"})},
                                 lambda r: len(json.loads(bytes(r.output).decode())) == r.params.max_tokens - 2),
               "allowed_token_ids (26 letters)": (lambda m: {"allowed_token_ids": letters},
                                                  lambda r: set(r.output) <= set(letters)),
               "a bad word of 2 tokens": (lambda m: {"bad_words_ids": [word]},
                                          lambda r: all(r.output[i:i + 2] != word for i in range(len(r.output) - 1)))}

    def params(fields=None):
        return [SamplingParams(max_tokens=m, **(fields(m) if fields and i % share == 0 else {}))
                for i, (_, m) in enumerate(work)]
    runs = _runs(engine, work, [("free", params())] + [(f"1 in {share} held to {how}", params(fields))
                                                        for how, (fields, _) in held_by.items()], "guided", label)
    free = runs[0][0]
    for (row, reqs), (_, keeps) in zip(runs[1:], held_by.values()):
        held = reqs[::share]
        row["note"] += f"; {sum(map(keeps, held))} of {len(held)} held outputs keep their form; " \
                       f"{row['value'] / free['value']:.2f}x the free run"
    return [emit(row) for row, _ in runs]


def shared_prefix(engine, work, system: int = 1024, label: str = "engine") -> list[dict]:
    """The offline workload with one `system`-token prompt before every request's own (a chat
    service's system prompt), all sent at once: with requests waiting for the prefix pages another is
    computing (Scheduler.wait_in_flight, the default) and without (each admitted request computes
    what is not cached yet), each run on its own system prompt, in the same engine: output tokens/s,
    TTFT p50 and the prompt tokens computed."""
    import numpy as np

    from meshlab.bench.serve import latency_summary
    from meshlab.infer.sampler import SamplingParams
    vocab, rows = engine.md.cfg.vocab_size, []
    system = min(system, engine.sched.max_len // 2)          # the tiny engine's short context
    limit = engine.sched.max_len - system
    fit = [(p[:max(1, limit - m - 1)], m) for p, m in work]          # each request within max_len
    for k, (name, wait) in enumerate((("each computing it", False), ("waiting for it", True))):
        engine.sched.wait_in_flight = wait
        head = np.random.default_rng(100 + k).integers(0, vocab, system).tolist()
        warm_head = [(t + 1) % vocab for t in head]
        engine.generate([warm_head + p for p, _ in fit[:16]], [SamplingParams(max_tokens=m) for _, m in fit[:16]])
        fed, t = engine.stats["prefill_tokens"], time.perf_counter()
        reqs = engine.generate([head + p for p, _ in fit], [SamplingParams(max_tokens=m) for _, m in fit])
        wall = time.perf_counter() - t
        out_tok = sum(len(r.output) for r in reqs)
        lat = latency_summary([r.t_first - t for r in reqs], [])
        rows.append({"section": "shared", "setting": f"{label} {system}-token system prompt, {name} n={len(fit)}",
                     "value": out_tok / wall, "unit": "tok/s",
                     "note": f"{out_tok} output tokens in {wall:.2f} s; TTFT p50 {lat['ttft_p50_ms']:.0f} ms; "
                             f"{engine.stats['prefill_tokens'] - fed} of {sum(len(r.prompt) for r in reqs)} prompt "
                             f"tokens computed"})
    engine.sched.wait_in_flight = True
    rows[-1]["note"] += f"; {rows[-1]['value'] / rows[0]['value']:.2f}x each computing it"
    return [emit(r) for r in rows]
