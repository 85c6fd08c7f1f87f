"""The embedding lookup's gradient adds a frequent token's rows in fp32 (models.llama.embed_lookup)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import embed_lookup


class _Param:
    """Just enough of an nnx.Param for embed_lookup: the value and its logical axis names."""
    def __init__(self, value):
        self.value = value

    def __getitem__(self, _):
        return self.value

    def get_metadata(self):
        return {"logical": ("vocab", "embed")}


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

    ours = grad_of(lambda w, t: embed_lookup(_Param(w), t, jnp.bfloat16))
    bf16_autodiff = grad_of(lambda w, t: jnp.take(w.astype(jnp.bfloat16), t, axis=0))
    ref = grad_of(lambda w, t: jnp.take(w, t, axis=0))                       # fp32 throughout
    used = np.asarray(jnp.bincount(tokens.ravel(), length=300)) > 0
    rel = lambda g: np.linalg.norm(np.asarray(g - ref)[used], axis=1) / np.linalg.norm(np.asarray(ref)[used], axis=1)  # noqa: E731
    print(f"\nrelative error, worst used row: ours {rel(ours).max():.2e}, bf16 autodiff {rel(bf16_autodiff).max():.2e}")
    assert rel(ours).max() < 4e-3, rel(ours).max()                 # one bf16 rounding: <= 2^-8 relative
    assert rel(bf16_autodiff).max() > 1e-2, rel(bf16_autodiff).max()
    assert not np.asarray(ours)[~used].any()                        # unused rows get no gradient
    np.testing.assert_array_equal(embed_lookup(_Param(w), tokens, jnp.bfloat16),
                                  jnp.take(w.astype(jnp.bfloat16), tokens, axis=0))
