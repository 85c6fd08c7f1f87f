"""eval_fp8's comparison on the tiny model: windows from a token file or text, and what it reports."""
import json

import numpy as np
import pytest

from meshlab.bench.fp8_quality import compare, main, windows
from meshlab.tokenizer import ByteTokenizer
from tests.helpers import tiny_served_model


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


def test_compare_reports_each_variant_against_the_engine_as_loaded(monkeypatch):
    from models import serving
    md, params, _ = tiny_served_model()
    prompts = [list(range(5, 29)), list(range(40, 64))]
    monkeypatch.setattr(serving, "FP8_GEMM_ROWS", 8)             # the tiny chunks reach it
    out = compare(md, params, prompts, max_tokens=6, against=("kv", "weights", "weights_w8a16"), max_len=32,
                  max_seqs=2, page_size=4, chunk=8)
    assert out["windows"] == 2 and out["tokens"] == 2 * 23          # each window's positions after its first
    for name in ("kv", "weights", "weights_w8a16"):
        got = out[name]
        assert 0 <= got["top1_agreement"] <= 1 and got["mean_abs_logprob_diff"] > 0   # fp8 does change the logprobs
        assert len(got["first_difference"]) == 2
    # the two weight variants differ only in the prompt GEMMs' activations, and they do differ
    assert out["weights"]["nll"] != out["weights_w8a16"]["nll"]
    with pytest.raises(ValueError, match="unknown comparison"):
        compare(md, params, prompts, against=("int4",), max_len=32, max_seqs=2, page_size=4, chunk=8)
    with pytest.raises(SystemExit, match="choose from kv, weights, weights_w8a16"):
        main(["--checkpoint", "random:tiny", "--data", "x", "--against", "kv,int4"])
