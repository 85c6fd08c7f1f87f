"""Packed documents: attention does not cross a document boundary and RoPE positions restart,
so a document's hidden states are the same packed in a row as alone; `cudnn` refuses packing."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from meshlab.train.data import make_example

# Compiling dominates (a tiny model): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen


def test_packed_document_equals_the_document_alone():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", attention="xla")
    model = models.build(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    eod = 256
    doc_a, doc_b = rng.integers(0, 256, 9), rng.integers(0, 256, 14)
    window = np.concatenate([doc_a, [eod], doc_b, [7]]).astype(np.int32)   # 25 tokens -> 24 inputs
    ex = make_example(window, segment_docs=True, eod_id=eod)
    packed = model.hidden(jnp.asarray(ex["tokens"])[None], jnp.asarray(ex["positions"])[None],
                          jnp.asarray(ex["segment_ids"])[None])[0]                       # [24, d]
    alone_b = model.hidden(jnp.asarray(doc_b, jnp.int32)[None])[0]                     # [14, d]
    np.testing.assert_allclose(packed[10:], alone_b, atol=2e-5)
    # Without the segment ids the second document would see the first: the check has teeth.
    leaky = model.hidden(jnp.asarray(ex["tokens"])[None], jnp.asarray(ex["positions"])[None])[0]
    assert float(jnp.abs(leaky[10:] - alone_b).max()) > 1e-3


def test_cudnn_refuses_packed_data_with_a_clear_error():
    from pallas_kernels.attention import dot_product_attention
    q = jnp.zeros((1, 8, 2, 16))
    if jax.default_backend() != "gpu":
        pytest.skip("cudnn needs a GPU; on CPU `cudnn` is already refused as unavailable")
    with pytest.raises(NotImplementedError, match="segment ids"):
        dot_product_attention(q, q, q, impl="cudnn", segment_ids=jnp.zeros((1, 8), jnp.int32))


def test_training_on_packed_data_runs(tmp_path):
    from meshlab.train.loop import train
    from tests.helpers import small_config
    out = train(small_config("fsdp", steps=2, extra=["data.segment_docs=true"]), progress=False, write=False)
    assert all(np.isfinite(out["losses"]))
