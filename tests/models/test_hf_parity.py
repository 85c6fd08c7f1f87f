"""HF Llama -> meshlab: logits match transformers in fp32; save-then-load round-trips exactly.

Needs the `parity` extra (torch, transformers); skipped where they are absent (CI).
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshlab.infer.hf import SafetensorsDir, load_hf, save_hf  # noqa: E402
from tests.helpers import save_hf_with_perturbed_norms  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CASES = {
    "gqa_tied_llama3_rope": dict(num_key_value_heads=2, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE),
    "untied_mha": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_untied_llama3_rope": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE),
}


def hf_model(tmp_path, **kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   head_dim=16, intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                                   initializer_range=0.2, max_position_embeddings=64, **kw)
    model = save_hf_with_perturbed_norms(transformers.LlamaForCausalLM(cfg), tmp_path / "hf")
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model = hf_model(tmp_path, **CASES[case])
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 40))       # 40 > 16: rope scaling matters
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    cfg, md, params = load_hf(tmp_path / "hf", dtype="float32")
    ours = np.asarray(jax.jit(lambda p, x: md.bind(p)(x))(params, jnp.asarray(tokens)))[..., :300]
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)
    assert cfg.tie_embeddings == CASES[case]["tie_word_embeddings"]


def test_save_then_load_round_trips_exactly(tmp_path):
    hf_model(tmp_path, **CASES["gqa_untied_llama3_rope"])
    cfg, md, params = load_hf(tmp_path / "hf", dtype="float32")
    save_hf(tmp_path / "out", cfg, params)
    a, b = SafetensorsDir(tmp_path / "hf"), SafetensorsDir(tmp_path / "out")
    assert set(a.entries) == set(b.entries)
    for name in a.entries:
        np.testing.assert_array_equal(np.asarray(a.get(name)), np.asarray(b.get(name)), err_msg=name)
    cfg2, _, params2 = load_hf(tmp_path / "out", dtype="float32")
    assert cfg2 == cfg
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, params2)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 1
    assert reloaded.config.rope_parameters["rope_type"] == "llama3" if hasattr(reloaded.config, "rope_parameters") \
        else reloaded.config.rope_scaling["rope_type"] == "llama3"


def test_sharded_load(tmp_path):
    from meshlab.mesh import make_mesh
    from meshlab.rules import load_rules
    hf_model(tmp_path, **CASES["gqa_tied_llama3_rope"])
    mesh = make_mesh("data=1,fsdp=4,tensor=2")
    cfg, md, params = load_hf(tmp_path / "hf", rules=load_rules("fsdp_tp"), mesh=mesh, dtype="float32")
    wq = params["layers"]["attn"]["wq"]                                   # [L, d, h, hd]: embed/fsdp, heads/tensor
    assert wq.sharding.spec[1:3] == ("fsdp", "tensor")
    assert wq.addressable_shards[0].data.shape == (2, 16, 2, 16)
    _, _, full = load_hf(tmp_path / "hf", dtype="float32")
    np.testing.assert_array_equal(np.asarray(wq), np.asarray(full["layers"]["attn"]["wq"]))
