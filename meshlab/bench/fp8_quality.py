"""What fp8 storage costs a trained model's answers: the engine as loaded against the same engine over
an fp8 KV cache, or over fp8 weights (FP8 GEMMs on prompt chunks, or every GEMM widened), teacher-forced
over held-out text (each window's prompt logprobs) and greedy after it.

scripts/eval_fp8.py runs it on a checkpoint; random weights cannot answer this (their near-uniform
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


# What each comparison changes in the engine: (Engine arguments, models.serving.FP8_GEMM_ROWS or None).
VARIANTS = {
    "kv": ({"kv_cache_dtype": "fp8"}, None),              # K and V stored fp8, the weights as loaded
    "weights": ({"quantize": "fp8"}, None),               # the layers' matrices fp8: FP8 GEMMs on prompt chunks
    "weights_w8a16": ({"quantize": "fp8"}, 1 << 30),      # the same matrices, every GEMM over them widened
}


def compare(md, params, prompts, max_tokens: int = 64, against=("kv",), **engine_kw) -> dict:
    """The engine as loaded (the reference) and each variant of `against` (VARIANTS) over `prompts`.
    Per variant: the top-1 agreement of each position's next-token prediction with the reference's,
    the mean |difference| of the text's own token logprobs, its mean NLL of the text, and how many of
    the greedy continuations (max_tokens each) are identical, with where the others first differ.
    The reference's NLL beside them; the weights variants serve on kernels layers, so all do."""
    from meshlab.infer.engine import Engine
    from meshlab.infer.sampler import SamplingParams
    from models import serving
    unknown = [name for name in against if name not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown comparison {unknown}: choose from {sorted(VARIANTS)}")
    engine_kw = {"layers": "kernels", **engine_kw}

    def run(kw, rows):
        with serving.fp8_gemm_rows(rows):
            return Engine(md, params, **engine_kw, **kw).generate(
                prompts, SamplingParams(max_tokens=max_tokens, prompt_logprobs=1))

    def own(rs):                                          # the text's own token logprobs and the argmaxes
        return (np.concatenate([[e[0] for e in r.prompt_logprobs[1:]] for r in rs]),
                np.concatenate([[max(e[1], key=e[1].get) for e in r.prompt_logprobs[1:]] for r in rs]))
    ref = run({}, None)
    ref_lp, ref_top = own(ref)
    out = {"windows": len(prompts), "tokens": int(ref_lp.size), "reference": {"nll": float(-ref_lp.mean())}}
    for name in against:
        rs = run(*VARIANTS[name])
        lp, top = own(rs)
        first = [next((i for i, (x, y) in enumerate(zip(a.output, b.output)) if x != y), max_tokens)
                 for a, b in zip(ref, rs)]
        out[name] = {"nll": float(-lp.mean()), "top1_agreement": float(np.mean(top == ref_top)),
                     "mean_abs_logprob_diff": float(np.mean(np.abs(lp - ref_lp))),
                     "greedy_identical": sum(f == max_tokens for f in first), "first_difference": sorted(first)}
    return out


def main(argv=None, description: str = "") -> None:
    """scripts/eval_fp8.py's command line: load the checkpoint, cut the windows, print compare's JSON."""
    from meshlab.infer.loading import add_checkpoint_args, open_checkpoint
    ap = argparse.ArgumentParser(description=description)
    add_checkpoint_args(ap)
    ap.add_argument("--data", required=True, help="a prepared token file (.bin beside its meta.json) or a text file")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--length", type=int, default=384, help="tokens a window")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens after each window")
    ap.add_argument("--against", default="kv,weights", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    against = [name for name in args.against.split(",") if name]
    unknown = [name for name in against if name not in VARIANTS]
    if unknown:
        sys.exit(f"eval_fp8: --against {','.join(unknown)}: choose from {', '.join(VARIANTS)}")
    try:
        _, _, _, md, params, tok = open_checkpoint(args)
        prompts = windows(args.data, tok, args.windows, args.length)
    except (ValueError, OSError) as e:
        sys.exit(f"eval_fp8: {e}")
    max_len = -(-(args.length + args.max_tokens) // 16) * 16
    # chunks of 512: a window's prompt in one step of FP8_GEMM_ROWS tokens or more
    print(json.dumps(compare(md, params, prompts, args.max_tokens, against, max_len=max_len, max_seqs=4, page_size=16,
                             chunk=512)))
