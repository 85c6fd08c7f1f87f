"""HF Mixtral -> meshlab MoE: logits match transformers in fp32 (router, top-2 of 4 experts, GQA).

Needs the `parity` extra (torch, transformers); skipped where they are absent (CI).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshlab.infer.hf import load_hf  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_mixtral_logits_match_transformers(tmp_path, tied):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, rms_norm_eps=1e-5, initializer_range=0.2,
                                     max_position_embeddings=64, tie_word_embeddings=tied)
    model = transformers.MixtralForCausalLM(cfg).eval().float()
    with torch.no_grad():                    # non-trivial norm scales, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 24))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours_cfg, md, params = load_hf(tmp_path / "hf", dtype="float32")
    assert (ours_cfg.n_experts, ours_cfg.top_k, ours_cfg.expert_mlp_dim) == (4, 2, 48)
    ours = np.asarray(jax.jit(lambda p, x: md.bind(p)(x))(params, jnp.asarray(tokens)))[..., :300]
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)
