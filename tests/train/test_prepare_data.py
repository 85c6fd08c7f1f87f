"""scripts/prepare_data.py: text and JSONL in, token files out (byte and a tokenizer.json
trained here, offline, and kept in the corpus), EOD separators, a train/val split, resumability,
clear errors; then a model trains on the result with data.corpus=DIR, samples and serves in its
tokenizer, and an empty validation split or a missing tokenizer is refused at start."""
import json
import shutil
import sys
import time

import numpy as np
import pytest

from meshlab.train import data as data_mod
from tests.helpers import script_module
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
    with pytest.raises(pd.PrepareError, match="a folder; pass its files"):
        pd.prepare([str(d)], "byte", tmp_path / "a", progress=False)
    bad = d / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(pd.PrepareError, match=r"bad.jsonl:2: no 'text' field"):
        pd.prepare([str(bad)], "byte", tmp_path / "b", progress=False)
    with pytest.raises(pd.PrepareError, match="no such tokenizer.json"):
        pd.prepare(paths, str(d / "missing.json"), tmp_path / "c", progress=False)
    (d / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(SystemExit) as e:   # valid JSON, but no tokenizer: one line, no traceback
        pd.main([paths[0], "--tokenizer", str(d / "bad.json"), "--out", str(tmp_path / "d"), "--quiet"])
    assert str(e.value.code).startswith(f"error: {d / 'bad.json'} is not a tokenizer.json (tokenizers could not "
                                        "read it: ") and "\n" not in str(e.value.code)


def test_an_out_dir_that_is_a_file_is_one_line(inputs, tmp_path):
    _, paths, _ = inputs
    afile = tmp_path / "afile"
    afile.write_text("kept")
    for out in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as e:
            pd.main([paths[0], "--out", str(out), "--quiet"])
        assert str(e.value.code) == (f"error: --out {out}: {afile} is a file, not a directory; pass a directory "
                                     "(a missing one is created)")
    assert afile.read_text() == "kept"

def test_an_empty_val_split_is_noted_and_refused_by_validation(inputs, tmp_path, capsys):
    from meshlab.train.loop import load_batches
    from tests.helpers import small_config
    _, paths, _ = inputs
    out = tmp_path / "corpus"
    pd.main([*paths, "--out", str(out), "--val-fraction", "0", "--quiet"])
    printed = capsys.readouterr().out
    assert "0 val tokens" in printed and "note: the validation split is empty" in printed and "val.every=0" in printed
    cfg = small_config(extra=[f"data.corpus={out}", "val.every=2"])
    load_batches(cfg, "train")
    with pytest.raises(ValueError, match=rf"val.bin of {out} is empty.*--val-fraction > 0.*or set val.every=0"):
        load_batches(cfg, "val")


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


def test_resume_knows_the_tokenizer_by_its_contents(inputs, tokenizer_json, tmp_path, monkeypatch):
    """The same tokenizer.json named another way (its directory, a relative path) resumes without
    tokenizing again; the file edited in place is other settings, whatever its path."""
    _, paths, _ = inputs
    out = tmp_path / "corpus"
    first = pd.prepare(paths, str(tokenizer_json), out, val_fraction=0.25, progress=False)
    part = out / "parts" / "00000.train.bin"
    stamp = part.stat().st_mtime_ns
    monkeypatch.chdir(tokenizer_json.parent)
    assert pd.prepare(paths, ".", out, val_fraction=0.25, progress=False) == first
    assert part.stat().st_mtime_ns == stamp, "a finished input is not tokenized again"
    edited = tmp_path / "edited" / "tokenizer.json"
    edited.parent.mkdir()
    spec = json.loads(tokenizer_json.read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    edited.write_text(json.dumps(spec))
    with pytest.raises(pd.PrepareError, match="other settings"):
        pd.prepare(paths, str(edited), out, val_fraction=0.25, progress=False)


def test_tokenizer_json_path_and_training_on_it(inputs, tokenizer_json, tmp_path, monkeypatch, capsys):
    from tokenizers import Tokenizer
    import models.sample
    from meshlab.train import loop
    from meshlab.train.loop import train
    from tests.helpers import one_device, small_config
    _, paths, texts = inputs
    out = tmp_path / "corpus"
    # a --tokenizer relative to the cwd of preparing, then training from another one: the corpus holds a copy
    monkeypatch.chdir(tokenizer_json.parent)
    meta = pd.prepare(paths, tokenizer_json.name, out, val_fraction=0.25, progress=False)
    monkeypatch.chdir(tmp_path)
    assert meta["tokenizer"] == "tokenizer.json" and (out / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
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
    # sample.txt in the corpus's tokenizer: the prompt it encodes and the ids it decodes (the sampler is
    # stubbed: the decoding is under test, not the model); validation is slowed down by two known seconds,
    # which the step's clock must not count: counted, the step's interval would hold the whole validation
    # pass (step_ms > val_ms whatever the machine's load; a fixed bound on step_ms would depend on that load)
    sampled = tok.encode("return x", add_special_tokens=False).ids
    seen = {}
    monkeypatch.setattr(models.sample, "sample_tokens", lambda md, params, prompt, *a, **k: seen.setdefault("p", prompt)
                        and sampled)
    validate = loop.Validator.__call__
    monkeypatch.setattr(loop.Validator, "__call__", lambda self, params: time.sleep(2.0) or validate(self, params))
    run_dir = tmp_path / "run"
    res = train(small_config("dp", mesh="data=1", steps=2, tmp_path=run_dir, extra=[
        f"data.corpus={out}", f"model.vocab_size={meta['vocab_size']}", "sample_tokens=8", "sample_prompt=def f",
        "val.every=2", "val.batches=1"]), devices=one_device(), progress=False)
    assert len(res["losses"]) == 2 and all(np.isfinite(res["losses"]))
    assert res["losses"][0] == pytest.approx(np.log(meta["vocab_size"]), rel=0.2)
    assert seen["p"] == tok.encode("def f", add_special_tokens=False).ids
    assert (run_dir / "sample.txt").read_text() == "def f" + tok.decode(sampled) and "return x" in res["sample"]
    assert (run_dir / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    val_row = res["rows"][-1]
    assert val_row["step"] == 2 and np.isfinite(val_row["val_loss"]) and val_row["val_ms"] >= 2000
    assert val_row["step_ms"] < val_row["val_ms"], "the validation pass is not the step's time"
    assert val_row["tokens_per_s"] == pytest.approx(16 * 32 / (val_row["step_ms"] / 1e3))
    # generate.py serves the run past its trained context (data.seq_len=32) with one warning line
    _generate_script().main(["--checkpoint", str(run_dir), "--prompt", "def f", "--max-new-tokens", "40"])
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "warning" in line] == [
        f"generate: warning: the prompt ({len(seen['p'])} tokens) and --max-new-tokens 40 reach {len(seen['p']) + 40} "
        "tokens, past the run's trained context of 32 (data.seq_len); the text beyond it is likely to degrade"]


def test_a_corpus_tokenizer_is_found_beside_the_corpus_or_refused_at_start(tokenizer_json, tmp_path, monkeypatch):
    """An older meta.json's relative path is read against the corpus directory; one found nowhere stops the
    run before anything is written (a run on it could not be sampled or served)."""
    from meshlab.checkpoint import corpus_tokenizer
    from meshlab.train.loop import train
    from tests.helpers import small_config
    corpus = tmp_path / "corpus"
    (corpus / "tok").mkdir(parents=True)
    shutil.copy(tokenizer_json, corpus / "tok" / "tokenizer.json")
    np.zeros(4096, np.uint16).tofile(corpus / "train.bin")
    (corpus / "meta.json").write_text(json.dumps({"tokenizer": "tok/tokenizer.json", "vocab_size": 300, "eod_id": 0}))
    monkeypatch.chdir(tmp_path)   # not the corpus: the path is read against the corpus
    assert corpus_tokenizer(str(corpus)) == corpus / "tok" / "tokenizer.json"
    (corpus / "meta.json").write_text(json.dumps({"tokenizer": "gone/tokenizer.json", "vocab_size": 300, "eod_id": 0}))
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"the corpus {corpus} was tokenized with gone/tokenizer.json, which is not "
                                         rf"there now .*Copy that tokenizer.json to {corpus}/gone/tokenizer.json"):
        train(small_config(tmp_path=run, extra=[f"data.corpus={corpus}", "model.vocab_size=300"]), progress=False)
    assert not run.exists()


def _generate_script():
    return script_module("generate")


def test_generate_checks_chunk_and_warns_past_the_trained_context(tmp_path, capsys):
    generate = _generate_script()
    for chunk in ("0", "-4"):
        with pytest.raises(SystemExit) as e:
            generate.main(["--checkpoint", "random:tiny", "--prompt", "x", "--chunk", chunk])
        assert e.value.code == 2
        assert f"--chunk must be >= 1 (prompt tokens per prefill call), got {chunk}" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("data:\n  seq_len: 128\n")
    assert generate.trained_seq_len(str(tmp_path)) == 128
    assert generate.trained_seq_len("random:tiny") is None


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
