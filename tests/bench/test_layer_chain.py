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
