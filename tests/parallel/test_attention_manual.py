"""Attention inside the step's data-parallel shard_map runs fully manual (per device).

cuDNN attention is a `custom_partitioning` op; in a partially manual region (batch axes manual,
`tensor` & co. auto) XLA calls its partitioner and that failed on 2 H200s under dp/fsdp. Here a
custom_partitioning attention whose partitioner callbacks fail the test stands in for cuDNN on
CPU: the step must never call them, and must give the same losses as the plain jnp attention.
"""
import jax
import numpy as np
import pytest
from jax.experimental.custom_partitioning import custom_partitioning

import meshlab.parallel as parallel
from meshlab.train.loop import train
from pallas_kernels.attention import dot_product_attention
from tests.helpers import small_config

# Compiling dominates (four tiny 2-step runs): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen


def _never(*args, **kwargs):
    raise AssertionError("partitioner called: attention ran in a partially manual region")


@custom_partitioning
def _cp_attention(q, k, v):
    return _plain(q, k, v)


_cp_attention.def_partition(infer_sharding_from_operands=_never, partition=_never, propagate_user_sharding=_never,
                            sharding_rule="b s h d, b t k d, b t k d -> b s h d")


def _plain(q, k, v):
    return dot_product_attention(q, k, v, impl="xla", causal=True)


@jax.custom_vjp
def _attention(q, k, v):   # differentiable as cuDNN's is: custom-partitioned forward, own backward
    return _cp_attention(q, k, v)


_attention.defvjp(lambda q, k, v: (_cp_attention(q, k, v), (q, k, v)),
                  lambda res, g: jax.vjp(_plain, *res)[1](g))


@pytest.mark.parametrize("rules,mesh", [("dp", None), ("fsdp_tp", None)])
def test_custom_partitioned_attention_runs_per_device(monkeypatch, rules, mesh):
    ref = train(small_config(rules, mesh=mesh, steps=2), progress=False, write=False)["losses"]
    monkeypatch.setattr(parallel, "dot_product_attention",
                        lambda q, k, v, impl, causal, segment_ids: _attention(q, k, v))
    out = train(small_config(rules, mesh=mesh, steps=2), progress=False, write=False)["losses"]
    np.testing.assert_allclose(out, ref, rtol=1e-6)
