"""scripts/prepare_data.py: text and JSONL in, token files out (byte and a tokenizer.json
trained here, offline), EOD separators, a train/val split, resumability, clear errors; then a
model trains on the result with data.corpus=DIR."""
import json
import sys

import numpy as np
import pytest

from meshlab.train import data as data_mod
from tests.train.test_checkpoint import ROOT, compile_cache  # noqa: F401 (autouse fixture)

sys.path.insert(0, str(ROOT / "scripts"))
import prepare_data as pd  # noqa: E402


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    files = sorted(data_mod.stdlib_files())[:12]
    texts = [p.read_text(encoding="utf-8", errors="replace")[:4000] for p in files]
    for i, t in enumerate(texts[:6]):
        (d / f"doc{i}.py").write_text(t)
    with (d / "more.jsonl").open("w") as f:
        for t in texts[6:]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    return d, [str(d / f"doc{i}.py") for i in range(6)] + [str(d / "more.jsonl")], texts


def test_byte_tokens_eod_and_split(inputs, tmp_path):
    _, paths, texts = inputs
    meta = pd.prepare(paths, "byte", tmp_path, val_fraction=0.25, progress=False)
    train = np.fromfile(tmp_path / "train.bin", np.uint16)
    val = np.fromfile(tmp_path / "val.bin", np.uint16)
    assert meta["documents"] == 12 and meta["eod_id"] == 256 and meta["dtype"] == "uint16"
    assert (train == 256).sum() + (val == 256).sum() == 12 and (val == 256).sum() == 3
    # Every 4th document (indices 3, 7, 11) is validation; the bytes round-trip.
    docs = np.split(val, np.where(val == 256)[0] + 1)[:-1]
    assert [bytes(d[:-1].astype(np.uint8)).decode() for d in docs] == [texts[3], texts[7], texts[11]]


def test_resume_skips_done_inputs(inputs, tmp_path):
    _, paths, _ = inputs
    first = pd.prepare(paths, "byte", tmp_path, val_fraction=0.25, progress=False)
    before = (tmp_path / "train.bin").read_bytes()
    part = tmp_path / "parts" / "00002.train.bin"
    stamp = part.stat().st_mtime_ns
    (tmp_path / "parts" / "00005.train.bin").unlink()      # as if the run died before input 5 finished
    (tmp_path / "train.bin").unlink()
    again = pd.prepare(paths, "byte", tmp_path, val_fraction=0.25, progress=False)
    assert again == first and (tmp_path / "train.bin").read_bytes() == before
    assert part.stat().st_mtime_ns == stamp, "a finished input is not tokenized again"
    with pytest.raises(pd.PrepareError, match="other settings"):
        pd.prepare(paths, "byte", tmp_path, val_fraction=0.5, progress=False)


def test_bad_inputs_are_named(inputs, tmp_path):
    d, paths, _ = inputs
    with pytest.raises(pd.PrepareError, match="not found: .*nope.txt"):
        pd.prepare([str(d / "nope.txt")], "byte", tmp_path / "a", progress=False)
    bad = d / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(pd.PrepareError, match=r"bad.jsonl:2: no 'text' field"):
        pd.prepare([str(bad)], "byte", tmp_path / "b", progress=False)
    with pytest.raises(pd.PrepareError, match="no such tokenizer.json"):
        pd.prepare(paths, str(d / "missing.json"), tmp_path / "c", progress=False)


@pytest.fixture(scope="module")
def tokenizer_json(inputs, tmp_path_factory):
    """A small BPE tokenizer trained here on the embedded corpus (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    _, _, texts = inputs
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokenizer_json_path_and_training_on_it(inputs, tokenizer_json, tmp_path):
    from tokenizers import Tokenizer
    from meshlab.train.loop import train
    from tests.helpers import one_device, small_config
    _, paths, texts = inputs
    out = tmp_path / "corpus"
    meta = pd.prepare(paths, str(tokenizer_json), out, val_fraction=0.25, progress=False)
    tok = Tokenizer.from_file(str(tokenizer_json))
    eod = tok.token_to_id("<|endoftext|>")
    assert meta["eod_id"] == eod and meta["vocab_size"] <= 300
    train_ids = np.fromfile(out / "train.bin", np.uint16)
    first = np.split(train_ids, np.where(train_ids == eod)[0] + 1)[0][:-1]
    assert tok.decode(first.tolist()) == texts[0]
    assert len(train_ids) < sum(len(t.encode()) for t in texts), "BPE compresses the bytes"
    with pytest.raises(ValueError, match="set model.vocab_size"):
        train(small_config("dp", mesh="data=1", steps=1, extra=[f"data.corpus={out}", "model.vocab_size=100"]),
              devices=one_device(), progress=False, write=False)
    res = train(small_config("dp", mesh="data=1", steps=2, extra=[f"data.corpus={out}",
                                                                  f"model.vocab_size={meta['vocab_size']}"]),
                devices=one_device(), progress=False, write=False)
    assert len(res["losses"]) == 2 and all(np.isfinite(res["losses"]))
    assert res["losses"][0] == pytest.approx(np.log(meta["vocab_size"]), rel=0.2)


def test_parquet_gives_the_same_tokens_as_jsonl(inputs, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    _, _, texts = inputs
    jsonl, parquet = tmp_path / "t.jsonl", tmp_path / "t.parquet"
    with jsonl.open("w") as f:
        for t in texts:
            f.write(json.dumps({"body": t}) + "\n")
    pq.write_table(pa.table({"body": texts, "n": list(range(len(texts)))}), parquet)
    a = pd.prepare([str(jsonl)], "byte", tmp_path / "a", val_fraction=0.25, progress=False, text_field="body")
    b = pd.prepare([str(parquet)], "byte", tmp_path / "b", val_fraction=0.25, progress=False, text_field="body")
    assert a["documents"] == b["documents"] == len(texts)
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.fromfile(tmp_path / "a" / f"{split}.bin", np.uint16),
                                      np.fromfile(tmp_path / "b" / f"{split}.bin", np.uint16))
    with pytest.raises(pd.PrepareError, match="no column 'text'"):
        pd.prepare([str(parquet)], "byte", tmp_path / "c", progress=False)
