"""The embedding lookup's gradient adds a frequent token's rows in fp32 (models.llama.embed_lookup)."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from models.llama import embed_lookup


def _param(w):
    return nnx.Param(w, logical=("vocab", "embed"))


def test_lookup_gradient_sums_in_fp32():
    """Byte-like skew (Zipf over 257 ids, 8192 tokens: the top id ~1,700 times): the bf16 lookup's
    gradient within bf16's one rounding of the fp32 sums; autodiff of a bf16 take, which adds in bf16,
    is off by percents on the frequent rows (the failure this guards against)."""
    rng = np.random.default_rng(0)
    p = 1 / np.arange(1, 258) ** 1.1
    tokens = jnp.asarray(rng.choice(257, size=(4, 2048), p=p / p.sum()).astype(np.int32))
    w = jnp.asarray(rng.standard_normal((300, 16)).astype(np.float32))
    dx = jnp.asarray(rng.standard_normal((4, 2048, 16)).astype(np.float32)).astype(jnp.bfloat16)

    def grad_of(lookup):
        return jax.jit(jax.grad(lambda w, t, dx: jnp.sum(lookup(w, t).astype(jnp.float32) * dx)))(w, tokens, dx)

    ours = grad_of(lambda w, t: embed_lookup(_param(w), t, jnp.bfloat16))
    bf16_autodiff = grad_of(lambda w, t: jnp.take(w.astype(jnp.bfloat16), t, axis=0))
    ref = grad_of(lambda w, t: jnp.take(w, t, axis=0))                       # fp32 throughout
    used = np.asarray(jnp.bincount(tokens.ravel(), length=300)) > 0
    rel = lambda g: np.linalg.norm(np.asarray(g - ref)[used], axis=1) / np.linalg.norm(np.asarray(ref)[used], axis=1)  # noqa: E731
    print(f"\nrelative error, worst used row: ours {rel(ours).max():.2e}, bf16 autodiff {rel(bf16_autodiff).max():.2e}")
    assert rel(ours).max() < 4e-3, rel(ours).max()                 # one bf16 rounding: <= 2^-8 relative
    assert rel(bf16_autodiff).max() > 1e-2, rel(bf16_autodiff).max()
    assert not np.asarray(ours)[~used].any()                        # unused rows get no gradient
    np.testing.assert_array_equal(embed_lookup(_param(w), tokens, jnp.bfloat16),
                                  jnp.take(w.astype(jnp.bfloat16), tokens, axis=0))


def test_models_scatter_their_embedding_gradient_in_fp32():
    """The bf16 model's gradient program (tied embedding, and the MoE model) scatters the lookup's rows in
    fp32, never in bf16: the models call embed_lookup, not a bf16 take."""
    tokens = jnp.zeros((2, 8), jnp.int32)
    for name in ("tiny", "moe_tiny"):
        cfg = dataclasses.replace(models.preset(name), dtype="bfloat16", n_layers=1)
        graph, params = nnx.split(models.build(cfg, nnx.Rngs(0)), nnx.Param)

        def loss(p):
            out = nnx.merge(graph, p).hidden(tokens)
            return jnp.sum((out[0] if isinstance(out, tuple) else out).astype(jnp.float32))
        hlo = jax.jit(jax.grad(loss)).lower(params).as_text(dialect="hlo")
        table = f"{cfg.padded_vocab},{cfg.d_model}"                 # the scatter into the [V, d] table
        scatters = re.findall(rf"= (\w+)\[{table}\]\S* scatter\(", hlo)
        assert scatters == ["f32"], (name, scatters)
