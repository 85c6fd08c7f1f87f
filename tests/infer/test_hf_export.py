"""save_hf writes what HF's loaders and meshlab's read: the EOS (config.json, generation_config.json,
tokenizer_config.json) the run stops at, and the dtype the tensors are stored in."""
import dataclasses
import json

import jax
import numpy as np
import pytest

import models
from meshlab.infer.hf import CheckpointError, SafetensorsDir, load_hf, save_hf
from meshlab.infer.loading import load_checkpoint, run_tokenizer, stop_token_ids
from models import model_def


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), model_def(cfg).abstract)
    return cfg, params


def write_run_tokenizer(run):
    """A run dir's tokenizer as training records it: tokenizer.json + tokenizer_meta.json naming the EOD id."""
    from tokenizers import Tokenizer, models as tk_models
    run.mkdir()
    vocab = {"<unk>": 0, "<s>": 1, "hello": 2, "world": 3, "</s>": 4}
    Tokenizer(tk_models.WordLevel(vocab, unk_token="<unk>")).save(str(run / "tokenizer.json"))
    (run / "tokenizer_meta.json").write_text(json.dumps({"tokenizer": "tokenizer.json", "eod_id": 4}))


def test_export_keeps_the_runs_eos(tmp_path, tiny):
    cfg, params = tiny
    run, out = tmp_path / "run", tmp_path / "hf"
    write_run_tokenizer(run)
    save_hf(out, cfg, params, tokenizer_json=run / "tokenizer.json")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 4
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 4
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    _, _, _, tok = load_checkpoint(str(out))
    assert stop_token_ids(tok) == stop_token_ids(run_tokenizer(run, {})) == [4]


def test_explicit_ids_win_and_bad_ones_are_refused(tmp_path, tiny):
    cfg, params = tiny
    run = tmp_path / "run"
    write_run_tokenizer(run)
    save_hf(tmp_path / "hf", cfg, params, tokenizer_json=run / "tokenizer.json", eos_token_id=3, bos_token_id=1)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["eos_token_id"], hf["bos_token_id"]) == (3, 1)
    tc = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert (tc["eos_token"], tc["bos_token"]) == ("world", "<s>")
    with pytest.raises(CheckpointError, match=f"eos_token_id={cfg.vocab_size} is not a token id"):
        save_hf(tmp_path / "bad", cfg, params, eos_token_id=cfg.vocab_size)
    assert not (tmp_path / "bad").exists()


def test_byte_token_export_names_the_end_of_document_id_and_stored_dtype(tmp_path, tiny):
    cfg, params = tiny
    save_hf(tmp_path / "hf", cfg, params, dtype="bfloat16")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["eos_token_id"], hf["torch_dtype"]) == (256, "bfloat16")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"eos_token_id": 256}
    assert not (tmp_path / "hf" / "tokenizer_config.json").exists()      # no HF tokenizer to configure
    st = SafetensorsDir(tmp_path / "hf")
    assert {meta["dtype"] for _, _, meta in st.entries.values()} == {"BF16"}
    assert load_hf(tmp_path / "hf")[0].dtype == "bfloat16"


def test_a_mixture_of_experts_exports_as_mixtral_and_loads_back_equal(tmp_path):
    """A Mixtral-shaped run (softmax router, renormalised top-k, no shared expert) writes Mixtral's
    config.json and one tensor per expert, and load_hf reads back every leaf exactly; a run with a
    shared expert is refused before anything is written."""
    cfg = dataclasses.replace(models.preset("moe_tiny"), shared_mlp_dim=0, dtype="float32")
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), model_def(cfg).abstract)
    save_hf(tmp_path / "hf", cfg, params)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["model_type"], hf["num_local_experts"], hf["num_experts_per_tok"], hf["intermediate_size"]) == (
        "mixtral", cfg.n_experts, cfg.top_k, cfg.expert_mlp_dim)
    assert f"model.layers.1.block_sparse_moe.experts.{cfg.n_experts - 1}.w2.weight" in SafetensorsDir(tmp_path / "hf")
    back_cfg, _, back = load_hf(tmp_path / "hf")
    assert (back_cfg.n_experts, back_cfg.top_k, back_cfg.shared_mlp_dim) == (cfg.n_experts, cfg.top_k, 0)
    back, rest = dict(back), dict(params)       # the embedding's padded rows are not a token's: not exported
    np.testing.assert_array_equal(np.asarray(back.pop("embed")), np.pad(rest.pop("embed")[:cfg.vocab_size],
                                                                         ((0, cfg.padded_vocab - cfg.vocab_size), (0, 0))))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), back, rest)
    with pytest.raises(CheckpointError, match=r"a shared expert \(model.shared_mlp_dim=32\).*Mixtral"):
        save_hf(tmp_path / "shared", models.preset("moe_tiny"), params)
    assert not (tmp_path / "shared").exists()


@pytest.mark.parametrize("text,message", [
    ("not json", "config.json is not JSON"), ("[1]", "config.json must hold a JSON object, not list"),
    ('{"model_type": "llama", "hidden_size": 64}', "config.json has no 'num_attention_heads', which a llama config needs"),
    ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 0, "num_attention_heads": 4, '
     '"intermediate_size": 128, "vocab_size": 300}', r"config.json: model.n_layers=0 must be >= 1"),
    ('{"model_type": "llama", "hidden_size": "64", "num_hidden_layers": 2, "num_attention_heads": 4, '
     '"intermediate_size": 128, "vocab_size": 300}', r"config.json: hidden_size='64' must be an integer"),
    ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2.5, "num_attention_heads": 4, '
     '"intermediate_size": 128, "vocab_size": 300}', r"config.json: num_hidden_layers=2.5 must be an integer"),
    ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
     '"intermediate_size": 128, "vocab_size": 300, "rms_norm_eps": "1e-5"}', r"config.json: rms_norm_eps='1e-5' must be a finite"),
    ('{"model_type": "llama", "hidden_size": Infinity, "num_hidden_layers": 2, "num_attention_heads": 4, '
     '"intermediate_size": 128, "vocab_size": 300}', r"config.json: hidden_size=inf must be an integer"),
    ('{"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
     '"intermediate_size": 128, "vocab_size": 300, "num_local_experts": [4], "num_experts_per_tok": 2}',
     r"config.json: num_local_experts=\[4\] must be an integer")])
def test_a_bad_config_json_is_one_error_naming_the_file(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_hf(tmp_path)


@pytest.mark.parametrize("vocab_size", [200, 300, 5000])
def test_an_embedding_table_of_other_rows_than_the_configs_vocabulary_is_refused(tmp_path, tiny, vocab_size):
    """A table of 257 rows under vocab_size 300 or 5000 would pad to the padded vocabulary and load, every id
    past 256 embedded as zeros; under 200 it is cut. Each is the loader's one shape error."""
    cfg, params = tiny
    save_hf(tmp_path, cfg, params)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, vocab_size=vocab_size)))
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight: shape \(257, 64\) does not convert.*disagree"):
        load_hf(tmp_path)
