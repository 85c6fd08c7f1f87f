"""Speculative decoding by prompt lookup against plain decoding, on a checkpoint's held-out text.

    python scripts/bench_speculative.py --checkpoint runs/default --data data/stdlib/val.bin
    python scripts/bench_speculative.py --checkpoint random:llama3_1b --dtype bfloat16 --data FILE   # a GPU's steps

One request at a time (batch 1; greedy, or --temperature T), the same windows for each --tokens k (0:
off). Prints the table (meshlab/bench/speculative.py says what each column holds); --append-docs FILE
appends it, dated. Random weights keep drafts as no trained model would: their rows time the steps.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from meshlab.bench import diary  # noqa: E402


def main(argv=None):
    from meshlab.infer.loading import add_checkpoint_args, open_checkpoint
    from meshlab.bench.fp8_quality import windows
    from meshlab.bench.speculative import measure, table
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--data", required=True, help="a prepared token file (.bin beside its meta.json) or a text file")
    ap.add_argument("--tokens", default="0,2,4", help="comma-separated draft tokens a step (0: off)")
    ap.add_argument("--prompt-lookup-max", type=int, default=3)
    ap.add_argument("--prompt-lookup-min", type=int, default=1)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=256, help="prompt tokens a window")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated after each window")
    ap.add_argument("--max-len", type=int, default=None,
                    help="the engine's max_len (default: what a window and its tokens need); a server's is larger")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else request i samples with seed i")
    ap.add_argument("--append-docs", default=None, help="also append the table to this file")
    args = ap.parse_args(argv)
    try:
        ks = [int(k) for k in args.tokens.split(",") if k]
        _, _, _, md, params, tok = open_checkpoint(args)
        prompts = windows(args.data, tok, args.windows, args.length)
    except (ValueError, OSError) as e:
        sys.exit(f"bench_speculative: {e}")
    max_len = -(-max(args.length + args.max_tokens, args.max_len or 0) // 16) * 16
    rows = measure(md, params, prompts, ks, args.max_tokens, args.temperature, prompt_lookup_max=args.prompt_lookup_max,
                   prompt_lookup_min=args.prompt_lookup_min, max_len=max_len, page_size=16, chunk=256, steps_per_call=8)
    setting = (f"{Path(args.checkpoint).name}, {args.windows} windows of {args.length} from {Path(args.data).name}, "
               f"{args.max_tokens} tokens at temperature {args.temperature:g}, lookup "
               f"{args.prompt_lookup_min}-{args.prompt_lookup_max}, max_len {max_len}")
    text = table(rows, setting)
    print(text)
    if args.append_docs:
        diary.append(f"\n{text}\n", path=args.append_docs)


if __name__ == "__main__":
    main()
