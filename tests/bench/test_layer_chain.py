"""The decode layer chain (meshlab/bench/layer_chain.py) on CPU in interpret mode: every attention
tiling computes the same layer output, and leaving attention out changes it (so a timing variant
that silently skipped work would show)."""
import dataclasses

import numpy as np

import models
from meshlab.bench import layer_chain as lc


def test_chain_variants_agree_and_skips_differ():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32")
    state = lc.chain_state(cfg, n_layers=2, ctx=40, max_len=128)
    tiles = lc.attention_variants(state.table.shape[1])
    outs = {}
    for name in ("shipped", "s1", "st1_ppb4_vfirst", "w2"):
        x, k, v = lc.chain_fn(cfg, tiles[name], interpret=True)(state.x, state.weights, state.k, state.v, state.table,
                                                                 state.lengths, state.cos_sin)
        outs[name] = np.asarray(x)
        state = dataclasses.replace(state, k=k, v=v)       # the same token rewritten: the same cache
    for name, x in outs.items():
        np.testing.assert_allclose(x, outs["shipped"], rtol=1e-5, atol=1e-5, err_msg=name)
    x, _, _ = lc.chain_fn(cfg, skip=frozenset({"attention"}), interpret=True)(
        state.x, state.weights, state.k, state.v, state.table, state.lengths, state.cos_sin)
    assert not np.allclose(np.asarray(x), outs["shipped"], atol=1e-3)


def test_chained_launches_compute_the_same_layers():
    # wo, gate|up and down in one launch (and the next layer's q|k|v with them) against the chain of
    # separate launches, over 3 layers (the first q|k|v apart, the last layer's chain without one)
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32")
    state = lc.chain_state(cfg, n_layers=3, ctx=40, max_len=128)
    args = lambda s: (s.x, s.weights, s.k, s.v, s.table, s.lengths, s.cos_sin)   # noqa: E731
    want, k, v = lc.chain_fn(cfg, interpret=True)(*args(state))
    state = dataclasses.replace(state, k=k, v=v)
    for name in ("chain_w1", "chain_qkv_w2"):
        x, k, v = lc.chain_fn(cfg, interpret=True, chained=lc.chained_variants()[name])(*args(state))
        state = dataclasses.replace(state, k=k, v=v)
        np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=name)
