"""What an fp8 KV cache costs a trained model: the same engine over its own cache and over an fp8 one,
teacher-forced over held-out text (each window's prompt logprobs) and greedy after it.

scripts/eval_kv_cache.py runs it on a checkpoint; random weights cannot answer this (their near-uniform
logits flip at any rounding), so the GPU benchmarks report speed and this reports the answers."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def windows(path: str, tok, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n windows of `length` tokens at random offsets of `path`: a prepared token file (.bin, its dtype
    in the meta.json beside it, as meshlab's data preparation writes) or text, encoded with `tok`."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path} not found: give a token file (.bin) or a text file")
    if p.suffix == ".bin":
        meta = p.with_name("meta.json")
        if not meta.is_file():
            raise ValueError(f"{path}: a .bin token file needs the meta.json beside it (its dtype)")
        ids = np.fromfile(p, json.loads(meta.read_text())["dtype"])
    else:
        ids = np.asarray(tok.encode(p.read_text(errors="replace")))
    if len(ids) < length + 1:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than one window of {length}; lower --length")
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, n)
    return [ids[s:s + length].tolist() for s in starts]


def compare(md, params, prompts, max_tokens: int = 64, **engine_kw) -> dict:
    """The two caches over `prompts`: the top-1 agreement of each position's next-token prediction, the
    mean |difference| of the text's own token logprobs, each cache's mean NLL of the text, and how many
    of the greedy continuations (max_tokens each) are identical, with where the others first differ."""
    from meshlab.infer.engine import Engine
    from meshlab.infer.sampler import SamplingParams
    runs = {kv: Engine(md, params, kv_cache_dtype=kv, **engine_kw).generate(
        prompts, SamplingParams(max_tokens=max_tokens, prompt_logprobs=1)) for kv in ("auto", "fp8")}
    own = {kv: [np.array([e[0] for e in r.prompt_logprobs[1:]]) for r in rs] for kv, rs in runs.items()}
    top = {kv: [np.array([max(e[1], key=e[1].get) for e in r.prompt_logprobs[1:]]) for r in rs]
           for kv, rs in runs.items()}
    first = [next((i for i, (x, y) in enumerate(zip(a.output, b.output)) if x != y), max_tokens)
             for a, b in zip(runs["auto"], runs["fp8"])]
    return {"windows": len(prompts), "tokens": int(sum(len(x) for x in own["auto"])),
            "top1_agreement": float(np.mean(np.concatenate(top["auto"]) == np.concatenate(top["fp8"]))),
            "mean_abs_logprob_diff": float(np.mean(np.abs(np.concatenate(own["auto"]) - np.concatenate(own["fp8"])))),
            "nll": {kv: float(-np.mean(np.concatenate(x))) for kv, x in own.items()},
            "greedy_identical": sum(f == max_tokens for f in first), "first_difference": sorted(first)}


def main(argv=None, description: str = "") -> None:
    """scripts/eval_kv_cache.py's command line: load the checkpoint, cut the windows, print compare's JSON."""
    from meshlab.infer.loading import add_checkpoint_args, open_checkpoint
    ap = argparse.ArgumentParser(description=description)
    add_checkpoint_args(ap)
    ap.add_argument("--data", required=True, help="a prepared token file (.bin beside its meta.json) or a text file")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=384, help="tokens a window")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens after each window")
    args = ap.parse_args(argv)
    try:
        _, _, _, md, params, tok = open_checkpoint(args)
        prompts = windows(args.data, tok, args.windows, args.length)
    except (ValueError, OSError) as e:
        sys.exit(f"eval_kv_cache: {e}")
    max_len = -(-(args.length + args.max_tokens) // 16) * 16
    print(json.dumps(compare(md, params, prompts, args.max_tokens, max_len=max_len, max_seqs=4, page_size=16,
                             chunk=128)))
