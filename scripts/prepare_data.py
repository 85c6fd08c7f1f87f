"""Tokenize text into memory-mapped token files for training:
python scripts/prepare_data.py INPUTS... --tokenizer byte|PATH/tokenizer.json --out DIR

Inputs: text files (one document each), JSONL (one document per line, field --text-field),
Parquet (column --text-field; needs pyarrow). Output: DIR/train.bin and DIR/val.bin (uint16,
or uint32 for vocabularies over 65536 tokens) with an end-of-document token after every
document, and DIR/meta.json. A tokenizer.json (and its tokenizer_config.json, if any) is copied
into DIR, and meta.json names that copy, so the corpus keeps its tokenizer wherever it is moved
or trained from. Then train with `data.corpus=DIR`.

Resumable: each input becomes DIR/parts/NNNNN.{train,val}.bin, written atomically and
recorded in DIR/parts/done.json; a rerun skips inputs already done (same path, size, mtime)
and only concatenates. Documents go to validation by their global index (every
1/val_fraction-th), so the split does not depend on how the work was interrupted.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

BYTE_EOD = 256
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class PrepareError(ValueError):
    pass


class Tokenizer:
    """`byte` (ids 0..255, EOD 256) or a Hugging Face tokenizer.json via `tokenizers`."""

    def __init__(self, spec: str, eod_token: str | None = None):
        self.spec = spec
        if spec == "byte":
            self.vocab_size, self.eod_id, self._tok = 257, BYTE_EOD, None
            return
        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise PrepareError(f"--tokenizer {spec!r}: no such tokenizer.json; pass 'byte' or a path to one")
        self.path = path
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise PrepareError(f"--tokenizer {spec}: reading a tokenizer.json needs the tokenizers library "
                               "(pip install tokenizers)") from None
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:   # the Rust parser's one exception type for every malformed file
            raise PrepareError(f"{path} is not a tokenizer.json (tokenizers could not read it: {e}); pass a "
                               "Hugging Face tokenizer.json, or 'byte'") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = [eod_token] if eod_token else list(EOD_CANDIDATES)
        ids = [(n, self._tok.token_to_id(n)) for n in names]
        found = [(n, i) for n, i in ids if i is not None]
        if not found:
            raise PrepareError(f"{path}: no end-of-document token among {names}; pass --eod-token TOKEN "
                               "(a special token of this tokenizer)")
        self.eod_token, self.eod_id = found[0]

    @property
    def identity(self) -> str:
        """What the tokenizer is, not how it was named: 'byte', or its tokenizer.json's content hash."""
        return "byte" if self._tok is None else "sha256:" + hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self._tok is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) for t in texts]
        return [np.asarray(e.ids, np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    @property
    def dtype(self):
        return np.uint16 if self.vocab_size <= 2 ** 16 else np.uint32


def read_documents(path: Path, text_field: str):
    """Yield document strings of one input file."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PrepareError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                if not isinstance(rec, dict) or text_field not in rec:
                    raise PrepareError(f"{path}:{n}: no {text_field!r} field; pass --text-field NAME")
                yield str(rec[text_field])
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PrepareError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise PrepareError(f"{path}: no column {text_field!r} (columns: {pf.schema_arrow.names}); "
                               "pass --text-field NAME")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def _is_val(index: int, val_fraction: float) -> bool:
    return val_fraction > 0 and math.floor((index + 1) * val_fraction) > math.floor(index * val_fraction)


def _write_atomic(path: Path, arrays: list[np.ndarray], dtype) -> int:
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with tmp.open("wb") as f:
        for a in arrays:
            a.astype(dtype).tofile(f)
            n += len(a)
    os.replace(tmp, path)   # a killed run never leaves a half-written part under the final name
    return n


def tokenize_file(path: Path, tok: Tokenizer, first_doc: int, val_fraction: float, text_field: str,
                  out_stem: Path, bar=None) -> dict:
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    eod = np.array([tok.eod_id], np.int64)
    docs, batch = 0, []

    def flush():
        nonlocal docs
        for ids in tok.encode_batch(batch):
            splits["val" if _is_val(first_doc + docs, val_fraction) else "train"] += [ids, eod]
            docs += 1
        batch.clear()

    for text in read_documents(path, text_field):
        batch.append(text)
        if len(batch) >= 256:
            flush()
    flush()
    counts = {s: _write_atomic(out_stem.with_suffix(f".{s}.bin"), arrs, tok.dtype) for s, arrs in splits.items()}
    if bar is not None:
        bar.update(path.stat().st_size)
    return {"docs": docs, "tokens": counts}


def prepare(inputs: list[str], tokenizer: str, out: str, val_fraction: float = 0.01, text_field: str = "text",
            eod_token: str | None = None, progress: bool = True) -> dict:
    paths = [Path(p) for p in inputs]
    folders = [str(p) for p in paths if p.is_dir()]
    if folders:
        raise PrepareError(f"{', '.join(folders)}: a folder; pass its files (e.g. {folders[0]}/*.txt or .jsonl)")
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise PrepareError(f"input file(s) not found: {', '.join(missing)}")
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"--val-fraction {val_fraction} must be in [0, 1)")
    tok = Tokenizer(tokenizer, eod_token)
    out_dir, parts = Path(out), Path(out) / "parts"
    taken = next((d for d in (out_dir, *out_dir.parents) if d.exists()), None)   # the nearest path that exists
    if taken is not None and not taken.is_dir():
        raise PrepareError(f"--out {out}: {taken} is a file, not a directory; pass a directory (a missing one is created)")
    parts.mkdir(parents=True, exist_ok=True)
    done_path = parts / "done.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    # The tokenizer by what it is, not how it was named: the same file under another path resumes, an edited
    # one at the same path does not (its parts would mix two vocabularies)
    settings = {"tokenizer": tok.identity, "val_fraction": val_fraction, "text_field": text_field, "eod_id": tok.eod_id}
    if done and done.get("settings") != settings:
        raise PrepareError(f"{out_dir} was started with other settings {done.get('settings')}; "
                           "use another --out or delete it")
    done.setdefault("settings", settings)
    files = done.setdefault("files", {})
    from tqdm import tqdm
    bar = tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress)
    first_doc = 0
    for k, p in enumerate(paths):
        key = f"{k:05d}"
        ident = {"path": str(p.resolve()), "size": p.stat().st_size, "mtime": p.stat().st_mtime}
        rec = files.get(key)
        if not (rec and rec["input"] == ident and all((parts / f"{key}.{s}.bin").exists() for s in ("train", "val"))):
            rec = {"input": ident, **tokenize_file(p, tok, first_doc, val_fraction, text_field, parts / key)}
            files[key] = rec
            done_path.write_text(json.dumps(done, indent=1))   # the resume point
        elif bar is not None:
            bar.update(ident["size"])
        first_doc += rec["docs"]
    bar.close()
    return _concatenate(out_dir, parts, len(paths), tok, first_doc, done)


def _copy_tokenizer(tok: Tokenizer, out_dir: Path) -> str:
    """meta.json's "tokenizer": `byte`, or `tokenizer.json`, a copy in out_dir (read relative to it)."""
    if tok._tok is None:
        return tok.spec
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = tok.path if name == "tokenizer.json" else tok.path.with_name(name)
        dst = out_dir / name
        if src.is_file() and not (dst.exists() and dst.samefile(src)):
            tmp = dst.with_name(name + ".tmp")
            tmp.write_bytes(src.read_bytes())
            os.replace(tmp, dst)
    return "tokenizer.json"


def _concatenate(out_dir: Path, parts: Path, n_files: int, tok: Tokenizer, n_docs: int, done: dict) -> dict:
    totals = {}
    for split in ("train", "val"):
        arrays = [np.fromfile(parts / f"{k:05d}.{split}.bin", dtype=tok.dtype) for k in range(n_files)]
        totals[split] = _write_atomic(out_dir / f"{split}.bin", arrays, tok.dtype)
    if totals["train"] == 0:
        raise PrepareError("no training tokens: the inputs are empty")
    meta = {"tokenizer": _copy_tokenizer(tok, out_dir), "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
            "dtype": np.dtype(tok.dtype).name, "documents": n_docs, "tokens": totals,
            "val_fraction": done["settings"]["val_fraction"]}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="text, .jsonl or .parquet files")
    p.add_argument("--tokenizer", default="byte", help="byte, or a Hugging Face tokenizer.json (or its folder)")
    p.add_argument("--out", required=True, help="output directory (then train with data.corpus=DIR)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of the documents sent to val.bin, every "
                   "1/F-th (default 0.01; 0: none)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--eod-token", help="end-of-document special token of the tokenizer (default: a common one)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        meta = prepare(args.inputs, args.tokenizer, args.out, args.val_fraction, args.text_field, args.eod_token,
                       progress=not args.quiet)
    except PrepareError as e:
        sys.exit(f"error: {e}")
    print(f"{meta['documents']} documents -> {meta['tokens']['train']:,} train / {meta['tokens']['val']:,} val "
          f"tokens ({meta['dtype']}, vocab {meta['vocab_size']}) in {args.out}; "
          f"train with data.corpus={args.out} model.vocab_size>={meta['vocab_size']}")
    if meta["tokens"]["val"] == 0:
        print(f"note: the validation split is empty ({meta['documents']} documents at --val-fraction "
              f"{meta['val_fraction']}): train on it with val.every=0, or prepare again with a --val-fraction that "
              "sends at least one document to validation")


if __name__ == "__main__":
    main()
