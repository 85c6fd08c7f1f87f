"""Token data: the embedded corpus, a byte tokenizer, and batches by global sample index.

A batch is a function of (seed, step, row): sample `step * global_batch + row` of a seeded
permutation of the fixed-length windows of one memory-mapped token file. Every mesh, rule
file and process count therefore sees the same tokens, and a process reads only its rows.
Loading goes through grain (`MapDataset` for random access, an iterator with get/set state
for checkpoints).
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from meshlab.tokenizer import EOD, ByteTokenizer

PAD_LABEL = -1     # label of positions that carry no loss


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def prepare_stdlib(out_dir: str | os.PathLike, max_bytes: int = 8_000_000, val_fraction: float = 0.02) -> Path:
    """Tokenize this interpreter's standard library into `out_dir/{train,val}.bin` (uint16)."""
    out = Path(out_dir)
    meta_path = out / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("max_bytes") == max_bytes and (out / "train.bin").exists():
            return out
    out.mkdir(parents=True, exist_ok=True)
    docs, total = [], 0
    for path in stdlib_files():
        try:
            data = path.read_bytes()
        except OSError:
            continue
        docs.append(data)
        total += len(data) + 1
        if total >= max_bytes and len(docs) >= 2:     # one document each for train and val, however small the cap
            break
    n_val = max(1, int(len(docs) * val_fraction))
    for split, chunk in (("train", docs[:-n_val]), ("val", docs[-n_val:])):
        arrays = []
        for d in chunk:
            arrays.append(np.frombuffer(d, dtype=np.uint8).astype(np.uint16))
            arrays.append(np.array([EOD], np.uint16))
        tokens = np.concatenate(arrays)
        # this process's own temporary: two processes preparing the same folder at once (test
        # workers, several ranks) each replace the file with the same tokens, never each other's half
        tmp = out / f"{split}.bin.{os.getpid()}.tmp"
        tokens.tofile(tmp)
        os.replace(tmp, out / f"{split}.bin")  # never leave a half-written token file behind
    meta = {"tokenizer": "byte", "vocab_size": ByteTokenizer.vocab_size, "eod_id": EOD, "dtype": "uint16",
            "max_bytes": max_bytes, "documents": len(docs)}
    tmp = out / f"meta.json.{os.getpid()}.tmp"   # written last and whole: its presence means the files are there
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return out


class TokenWindows:
    """Random-access source of [seq_len + 1] windows of a memory-mapped token file."""

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: str = "uint16"):
        if os.path.getsize(path) == 0:   # np.memmap's own error names neither the file nor the cause
            raise ValueError(f"{path} is empty: it holds no tokens; prepare it again from non-empty inputs")
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        n = (len(self.tokens) - 1) // seq_len
        if n < 1:
            raise ValueError(f"{path}: {len(self.tokens)} tokens are fewer than one window of seq_len={seq_len}")
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int32)


def make_example(window: np.ndarray, segment_docs: bool, eod_id: int = EOD) -> dict:
    """One row: inputs, next-token labels, positions, segment ids (documents split at EOD)."""
    tokens, labels = window[:-1], window[1:].copy()
    s = len(tokens)
    if not segment_docs:
        return {"tokens": tokens, "labels": labels, "positions": np.arange(s, dtype=np.int32),
                "segment_ids": np.zeros(s, np.int32)}
    # A new document starts after each EOD; its first position is 0 again.
    starts = np.concatenate([[True], tokens[:-1] == eod_id])
    segment_ids = np.cumsum(starts).astype(np.int32) - 1
    start_pos = np.maximum.accumulate(np.where(starts, np.arange(s), 0))
    positions = (np.arange(s) - start_pos).astype(np.int32)
    labels = np.where(tokens == eod_id, PAD_LABEL, labels).astype(np.int32)  # no loss across a boundary
    return {"tokens": tokens, "labels": labels, "positions": positions, "segment_ids": segment_ids}


class GlobalBatches:
    """Batches by global sample index; `rows` selects this process's rows of each batch."""

    def __init__(self, source: TokenWindows, global_batch: int, seed: int, segment_docs: bool = False,
                 eod_id: int = EOD):
        self.global_batch = global_batch
        self.segment_docs = segment_docs
        self.eod_id = eod_id
        import grain  # here, not at import: the tokenizer and windows are used where grain is absent
        # A seeded permutation per epoch, repeated: sample j of the run is dataset[j].
        self.dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat()

    def batch(self, step: int, rows=None) -> dict:
        rows = range(self.global_batch) if rows is None else rows
        examples = [make_example(self.dataset[step * self.global_batch + r], self.segment_docs, self.eod_id)
                    for r in rows]
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

    def iterator(self, start_step: int, num_steps: int, rows=None, prefetch: int = 2):
        """A grain iterator over steps (checkpointable: get_state/set_state) with host prefetch."""
        import grain
        steps = grain.MapDataset.range(start_step, start_step + num_steps)
        ds = steps.map(lambda s: self.batch(int(s), rows))
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=prefetch)))
