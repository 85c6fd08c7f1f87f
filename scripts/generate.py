"""Stream a completion to the terminal: python scripts/generate.py --checkpoint PATH --prompt TEXT.

--checkpoint: a Hugging Face directory, a meshlab run directory, or random:<preset>.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# SamplingParams' fields, as this script's flags
FLAGS = {"max_tokens": "--max-new-tokens ", "temperature": "--temperature ", "top_k": "--top-k ", "top_p": "--top-p ",
         "min_p": "--min-p ", "repetition_penalty": "--repetition-penalty ", "seed": "--seed "}


def trained_seq_len(checkpoint: str) -> int | None:
    """data.seq_len of a meshlab run directory's config.yaml: the context the model was trained at
    (None for other checkpoints, or a config without it)."""
    config = Path(checkpoint) / "config.yaml"
    if not config.is_file():
        return None
    import yaml
    try:
        seq_len = (yaml.safe_load(config.read_text()) or {}).get("data", {}).get("seq_len")
    except (yaml.YAMLError, AttributeError):
        return None   # loading the checkpoint reads config.yaml too, and names what is wrong with it
    return seq_len if isinstance(seq_len, int) else None


def main(argv=None):
    from meshlab.infer.loading import (HelpFormatter, add_checkpoint_args, add_speculative_args, add_storage_args,
                                      check_speculative_args, open_checkpoint, speculative_kwargs, stop_token_ids,
                                      storage_kwargs)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=0, help="draw among the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="draw among the most likely tokens holding this probability")
    ap.add_argument("--min-p", type=float, default=0.0, help="keep tokens within this fraction of the best's probability")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="divides the logits of tokens already seen (1: off)")
    ap.add_argument("--seed", type=int, default=0, help="the draws' seed (sampling only)")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk, tokens")
    add_speculative_args(ap, batch=False)
    add_storage_args(ap)
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.chunk < 1:
        ap.error(f"--chunk must be >= 1 (prompt tokens per prefill call), got {args.chunk}")
    if not args.prompt:
        ap.error("--prompt is empty; give some text to continue")
    from meshlab.infer.engine import ContiguousGenerator, Engine
    from meshlab.infer.sampler import SamplingParams
    try:
        rules, mesh, cfg, md, params, tok = open_checkpoint(args)
        ids = tok.encode(args.prompt)
        if not ids:
            raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; give some text to continue")
        stop = stop_token_ids(tok)
        try:
            sp = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                seed=args.seed, stop_token_ids=stop).validate(cfg.vocab_size)
        except ValueError as e:       # its words name SamplingParams' fields: name the flags instead
            raise ValueError(re.sub(r"^(\w+)=", lambda m: FLAGS.get(m[1], m[0]), str(e))) from None
        need = len(ids) + args.max_new_tokens
        trained = trained_seq_len(args.checkpoint)
        if trained is not None and need > trained:
            print(f"generate: warning: the prompt ({len(ids)} tokens) and --max-new-tokens {args.max_new_tokens} "
                  f"reach {need} tokens, past the run's trained context of {trained} (data.seq_len); the text "
                  "beyond it is likely to degrade", file=sys.stderr, flush=True)
        chunk = min(args.chunk, 1 << max(need - 1, 1).bit_length())
        row = -(-need // 16) * 16      # the speculative engine's row: prompt and output in whole pages of 16
        check_speculative_args(args, row, f"{row}, the row's tokens (the prompt's {len(ids)} and --max-new-tokens "
                                          f"{args.max_new_tokens}, in pages of 16)")
        if args.speculative_tokens:    # the serving engine's speculative calls, over one row
            gen = Engine(md, params, max_len=row, max_seqs=1, chunk=chunk, rules=rules, mesh=mesh,
                         **speculative_kwargs(args), **storage_kwargs(args))
        else:
            gen = ContiguousGenerator(md, params, batch=1, max_len=-(-need // chunk) * chunk, chunk=chunk,
                                      rules=rules, mesh=mesh, **storage_kwargs(args))
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"generate: {e}")
    out: list[int] = []
    shown = 0

    def on_token(_row, t):          # print the text as it grows (whole UTF-8 characters only)
        nonlocal shown
        out.append(t)
        text = tok.decode(out).rstrip("\ufffd")
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)

    sys.stdout.write(args.prompt)
    try:
        if isinstance(gen, Engine):
            gen.add_request(ids, sp, on_event=lambda _req, new, _done: [on_token(0, t) for t in new])
            gen.run()
        else:
            gen.generate([ids], sp, on_token=on_token)
    except ValueError as e:           # the generators' checks of the request (each flag is checked above)
        sys.exit(f"\ngenerate: {e}")
    sys.stdout.write(tok.decode(out)[shown:] + "\n")


if __name__ == "__main__":
    main()
