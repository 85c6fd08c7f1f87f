"""HF Mixtral -> meshlab MoE: logits match transformers in fp32 (router, top-2 of 4 experts, GQA), and
meshlab's Mixtral export loads back into transformers with the same logits.

Needs the `parity` extra (torch, transformers); skipped where they are absent (CI).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshlab.infer.hf import load_hf, save_hf  # noqa: E402
from tests.helpers import save_hf_with_perturbed_norms  # noqa: E402


@pytest.mark.parametrize("tied", [False, True])
def test_mixtral_logits_match_transformers(tmp_path, tied):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, rms_norm_eps=1e-5, initializer_range=0.2,
                                     max_position_embeddings=64, tie_word_embeddings=tied)
    model = save_hf_with_perturbed_norms(transformers.MixtralForCausalLM(cfg), tmp_path / "hf")
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 24))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    ours_cfg, md, params = load_hf(tmp_path / "hf", dtype="float32")
    assert (ours_cfg.n_experts, ours_cfg.top_k, ours_cfg.expert_mlp_dim) == (4, 2, 48)
    ours = np.asarray(jax.jit(lambda p, x: md.bind(p)(x))(params, jnp.asarray(tokens)))[..., :300]
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)
    save_hf(tmp_path / "out", ours_cfg, params)
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        np.testing.assert_allclose(again(torch.tensor(tokens)).logits.numpy(), ref, atol=1e-5, rtol=1e-5)


def _bench_moe_torch():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[2] / "scripts" / "bench_moe_torch.py"
    spec = importlib.util.spec_from_file_location("bench_moe_torch", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mixtral_peer_has_the_preset_shape_and_trains_tiny():
    """scripts/bench_moe_torch.py: its Mixtral at moe_1b_8e, read back through the HF import, is the
    preset (same active and total counts, so the same FLOPs per token); the tiny shape trains on CPU
    (eager) and reports tokens/s and MFU by our formula."""
    import models
    peer = _bench_moe_torch()
    want = models.preset("moe_1b_8e")
    got = peer.ours(peer.mixtral_config(False, "moe_1b_8e"))
    assert (got.n_experts, got.top_k, got.expert_mlp_dim, got.d_model, got.n_layers) == (8, 2, 4096, 2048, 16)
    assert got.param_count() == want.param_count()
    assert got.train_flops_per_token(4096) == want.train_flops_per_token(4096)
    row = peer.run(peer.argparse.Namespace(model="moe_1b_8e", tiny=True, device="cpu", compile="none", batch=2,
                                           seq=16, steps=1, warmup=1))
    assert row["tokens_per_s"] > 0 and np.isfinite(row["loss"]) and row["model"] == "tiny"
    tiny = peer.ours(peer.mixtral_config(True, "moe_1b_8e"))
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * tiny.train_flops_per_token(16) / 989e12)
    assert "Mixtral" in row["peer"] and "eager" in row["peer"]
