"""eval_kv_cache's comparison on the tiny model: windows from a token file or text, and what it reports."""
import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

import models
from meshlab.bench.kv_quality import compare, windows
from meshlab.tokenizer import ByteTokenizer
from models import model_def


def test_windows_read_a_token_file_or_text(tmp_path):
    with pytest.raises(ValueError, match="val.bin not found"):
        windows(str(tmp_path / "val.bin"), None, 2, 10)
    ids = np.arange(100, dtype=np.uint16)
    ids.tofile(tmp_path / "val.bin")
    with pytest.raises(ValueError, match="needs the meta.json beside it"):
        windows(str(tmp_path / "val.bin"), None, 2, 10)
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    got = windows(str(tmp_path / "val.bin"), None, 3, 10)
    assert len(got) == 3 and all(w == list(range(w[0], w[0] + 10)) for w in got)
    (tmp_path / "t.txt").write_text("abcdefghij" * 3)
    assert all(len(w) == 8 for w in windows(str(tmp_path / "t.txt"), ByteTokenizer(), 2, 8))
    with pytest.raises(ValueError, match="fewer than one window of 64"):
        windows(str(tmp_path / "t.txt"), ByteTokenizer(), 2, 64)


def test_compare_reports_both_caches_over_the_same_windows():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    prompts = [list(range(5, 29)), list(range(40, 64))]
    out = compare(md, params, prompts, max_tokens=6, max_len=32, max_seqs=2, page_size=4, chunk=8)
    assert out["windows"] == 2 and out["tokens"] == 2 * 23          # each window's positions after its first
    assert 0 <= out["top1_agreement"] <= 1 and out["mean_abs_logprob_diff"] > 0   # fp8 K/V do change the logprobs
    assert set(out["nll"]) == {"auto", "fp8"} and len(out["first_difference"]) == 2
