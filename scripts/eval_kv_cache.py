"""An fp8 KV cache against the model's own on held-out text: python scripts/eval_kv_cache.py --checkpoint PATH --data FILE.

--data: a prepared token file (.bin beside its meta.json; after `make train`: data/stdlib/val.bin, held
out from training) or a text file. Prints one JSON line (meshlab/bench/kv_quality.py says what it holds).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    from meshlab.bench.kv_quality import compare, windows
    from meshlab.infer.loading import add_checkpoint_args, open_checkpoint
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_args(ap)
    ap.add_argument("--data", required=True)
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
    print(json.dumps(compare(md, params, prompts, args.max_tokens, max_len=max_len, max_seqs=4, page_size=16, chunk=128)))


if __name__ == "__main__":
    main()
