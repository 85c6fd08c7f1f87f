"""Paged decode-attention kernel (interpret mode) == its jnp reference == dense attention."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.infer import kv_cache
from meshlab.infer.kv_cache import dense_attention
from pallas_kernels import rope
from pallas_kernels.paged_attention import (BlockSizes, paged_attention, paged_attention_reference,
                                            paged_decode_attention, plan, rope_cos_sin)
from pallas_kernels.paged_tiles import CONFIGS, decode_block_sizes

# Compiling dominates (interpret-mode kernels and the engine's tiny programs): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen


def make_case(seed, b=3, h=4, kvh=2, d=16, page_size=4, max_pages=6, num_pages=24, lengths=(1, 9, 24)):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(num_pages, page_size, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(num_pages, page_size, kvh, d)), jnp.float32)
    table = jnp.asarray(rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)
    return q, k, v, table, jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("pages_per_split,merge", [(1, "kernel"), (2, "kernel"), (16, "kernel"), (1, "xla")])
def test_kernel_matches_reference(pages_per_split, merge):
    # lengths 1 (one token), 9 (third page holds 1 of 4), 24 (every page full), 0 (inactive row); the
    # splits merged by the merge launch or by XLA
    q, k, v, table, lengths = make_case(0, b=4, lengths=(1, 9, 24, 0))
    got = paged_attention(q, k, v, table, lengths, block_sizes=BlockSizes(pages_per_split, merge=merge),
                          interpret=True)
    want = paged_attention_reference(q, k, v, table, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(got)[3] == 0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sweep_configs_match_reference(name):
    # 10 pages of 4 per sequence: several page blocks and splits per config, a part-filled last page
    # (37 = 9 pages + 1), a block running past the table's end, empty splits, an inactive row
    q, k, v, table, lengths = make_case(4, b=4, max_pages=10, num_pages=48, lengths=(1, 37, 40, 0))
    want = paged_attention_reference(q, k, v, table, lengths)
    got = paged_attention(q, k, v, table, lengths, block_sizes=CONFIGS[name], interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(got)[3] == 0)
    if name != "dot8":                 # bf16 for the default (dots in bf16); elementwise: test_bf16_and_gqa...
        return
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))                     # bf16 cache, dots in bf16
    got = paged_attention(qb, kb, vb, table, lengths, block_sizes=CONFIGS[name], interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_serving_tiles_by_batch_match_reference():
    # decode_block_sizes for the plain kernel (larger batches, a packed step's decode rows) and the
    # fused one past batch 1: other splits and page blocks than the batch-1 tiles, the same result
    q, k, v, table, lengths = make_case(6, b=4, max_pages=10, num_pages=48, lengths=(3, 37, 40, 0))
    want = paged_attention_reference(q, k, v, table, lengths)
    for bs in (decode_block_sizes(4, fused=False), decode_block_sizes(64, fused=False)):
        got = paged_attention(q, k, v, table, lengths, block_sizes=bs, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
        assert np.all(np.asarray(got)[3] == 0)
    assert decode_block_sizes(1) != decode_block_sizes(16) != decode_block_sizes(16, fused=False)


def test_a_table_just_wider_than_the_splits_wanted():
    # 5 one-page blocks, 3 splits wanted (2 kv heads, min_programs 6): 5 splits of one block (rounded
    # up it was 2 of three); lengths that fill one, three and all five pages, and a part of one
    q, k, v, table, lengths = make_case(7, b=4, h=4, kvh=2, max_pages=5, num_pages=24, lengths=(3, 12, 20, 17))
    bs = BlockSizes(pages_per_block=1, min_programs=6)
    assert plan(bs, 1, 2, 5, 4, 2, 16)["splits"] == 5
    for row in range(4):                                  # batch 1: each length over the 5 splits
        one = (q[row:row + 1], k, v, table[row:row + 1], lengths[row:row + 1])
        got = paged_attention(*one, block_sizes=bs, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_reference(*one)), atol=2e-5, rtol=2e-5)
    got = paged_attention(q, k, v, table, lengths, block_sizes=bs, interpret=True)   # batch 4: 1 split wanted
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_reference(q, k, v, table, lengths)),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("score", ["dot", "vpu"])
def test_group_not_a_power_of_two(score):
    # 6 query heads on 2 kv heads: a group of 3, padded to 16 (dot) or 4 (vpu) rows in the kernel
    q, k, v, table, lengths = make_case(5, h=6, kvh=2, lengths=(2, 13, 24))
    got = paged_attention(q, k, v, table, lengths, block_sizes=BlockSizes(score=score, pages_per_block=4),
                          interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_reference(q, k, v, table, lengths)),
                               atol=2e-5, rtol=2e-5)


def test_plan_fills_the_gpu_at_batch_one():
    # llama3_1b at ctx 2048: 8 kv heads, 128 pages of 16, group 4, d 64
    one = plan(BlockSizes(pages_per_block=4), 1, 8, 128, 16, 4, 64)
    assert one["splits"] == 32 and one["use_dot"] and one["rows"] == 16 and one["out_rows"] == 4
    # llama3_3b: a group of 3 computes on 16 rows but keeps 4 in the partials the merge reads
    three = plan(BlockSizes(pages_per_block=4), 1, 8, 128, 16, 3, 128)
    assert three["rows"] == 16 and three["out_rows"] == 4
    assert plan(BlockSizes(), 64, 8, 128, 16, 4, 64)["splits"] == 1               # 512 programs already
    # a table a little wider than the splits wanted (36 blocks of 4 pages, 33 wanted) still gets >= 33,
    # one block each, and any width keeps batch * kv heads * splits >= min_programs while blocks allow
    assert plan(BlockSizes(pages_per_block=4), 1, 8, 144, 16, 4, 64)["splits"] == 36
    for pages in range(4, 600, 4):
        for batch in (1, 4, 16, 32):
            p = plan(BlockSizes(pages_per_block=4), batch, 8, pages, 16, 4, 64)
            assert batch * 8 * p["splits"] >= min(264, batch * 8 * (pages // 4)), (pages, batch, p)
    old = plan(CONFIGS["old"], 1, 8, 128, 16, 4, 64)
    assert (old["pages_per_block"], old["pages_per_split"], old["use_dot"]) == (1, 16, False)
    with pytest.raises(ValueError, match="power of two"):
        plan(BlockSizes(pages_per_block=3), 1, 8, 128, 16, 4, 64)


def test_reference_matches_dense_attention():
    q, k, v, table, lengths = make_case(1, lengths=(5, 13, 22))
    b, _, kvh, d = q.shape[0], None, k.shape[2], q.shape[2]
    seq_k = k[table].reshape(b, -1, kvh, d)
    seq_v = v[table].reshape(b, -1, kvh, d)
    dense = dense_attention(q[:, None], seq_k, seq_v, (lengths - 1)[:, None])[:, 0]
    np.testing.assert_allclose(np.asarray(paged_attention_reference(q, k, v, table, lengths)), np.asarray(dense),
                               atol=2e-5, rtol=2e-5)


def test_bf16_and_gqa_group_of_four():
    q, k, v, table, lengths = make_case(2, h=8, kvh=2, lengths=(3, 17, 21))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = paged_attention(q, k, v, table, lengths, block_sizes=BlockSizes(2), interpret=True)
    want = paged_attention_reference(q, k, v, table, lengths)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


# fused: RoPE + cache write inside the kernel (at one sequence, the residual stream's zero padding
# row through every layer); kernels: also every decode matmul with its norm / residual / SwiGLU
# (heads 6 on 2: a GQA group of 3, as Llama-3.2-3B's, through the prompt kernel and decode merge padded to 4)
@pytest.mark.parametrize("layers,max_seqs,heads", [("split", 2, (4, 2)), ("fused", 2, (4, 2)), ("fused", 1, (4, 2)),
                                                   ("kernels", 2, (4, 2)), ("kernels", 1, (4, 2)),
                                                   ("kernels", 2, (6, 2))])
def test_engine_with_kernel_matches_uncached(layers, max_seqs, heads):
    from flax import nnx
    import models
    from meshlab.infer.engine import Engine
    from meshlab.infer.sampler import SamplingParams
    from models import model_def
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2, n_heads=heads[0],
                              n_kv_heads=heads[1])
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    eng = Engine(md, params, max_len=32, max_seqs=max_seqs, page_size=4, chunk=8, steps_per_call=1,
                 impl="pallas", interpret=True, layers=layers)
    reqs = eng.generate([[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_tokens=6))
    for r in reqs:
        seq = r.prompt + r.output
        logits = np.asarray(md.bind(params)(jnp.asarray([seq])))[0, :, :cfg.vocab_size]
        assert r.output == logits[len(r.prompt) - 1:-1].argmax(-1).tolist()


def test_engine_with_kernels_over_an_fp8_cache():
    # The Pallas paths (prompt kernel, fused decode at batch 1 and 2, the decode matmuls) over fp8
    # pages: every greedy token is the next token of the whole sequence in one XLA prompt pass over
    # a contiguous fp8 cache
    from meshlab.infer.engine import ContiguousGenerator, Engine
    from meshlab.infer.sampler import SamplingParams
    from tests.helpers import tiny_served_model
    md, params, _ = tiny_served_model()
    eng = Engine(md, params, max_len=32, max_seqs=2, page_size=4, chunk=8, steps_per_call=2, impl="pallas",
                 interpret=True, layers="kernels", kv_cache_dtype="fp8")
    whole = ContiguousGenerator(md, params, batch=1, max_len=32, chunk=32, kv_cache_dtype="fp8")
    for r in eng.generate([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [9, 2, 6]], SamplingParams(max_tokens=6)):
        seq = r.prompt + r.output
        assert r.output == [whole.generate([seq[:n]], SamplingParams(max_tokens=1))[0][0]
                            for n in range(len(r.prompt), len(seq))]


def test_stacked_layers_read_in_place():
    q, k, v, table, lengths = make_case(3, lengths=(2, 11, 24))
    k5, v5 = jnp.stack([k * 0, k, k * 2]), jnp.stack([v * 0, v, v * 2])       # layer 1 is the real one
    want = paged_attention_reference(q, k, v, table, lengths)
    for bs in (BlockSizes(2), BlockSizes()):                                     # one page per step; gathered blocks
        got = paged_attention(q, k5, v5, table, lengths, jnp.int32(1), block_sizes=bs, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def _fused_reference(qkv, k_cache, v_cache, table, lengths, layer, n_heads, theta):
    """RoPE (the model's jnp version), the cache write, then the reference attention."""
    kvh = k_cache.shape[3]
    q, k, v = qkv[:, None, :n_heads], qkv[:, None, n_heads:n_heads + kvh], qkv[:, None, n_heads + kvh:]
    pos = jnp.maximum(lengths - 1, 0)
    q, k = rope.apply_rope_reference(q, k, pos[:, None], theta=theta)
    page_size = k_cache.shape[2]
    for i in np.flatnonzero(np.asarray(lengths) > 0):
        page, slot = table[i, pos[i] // page_size], pos[i] % page_size
        k_cache = k_cache.at[layer, page, slot].set(k[i, 0].astype(k_cache.dtype))
        v_cache = v_cache.at[layer, page, slot].set(v[i, 0].astype(v_cache.dtype))
    return paged_attention_reference(q[:, 0], k_cache[layer], v_cache[layer], table, lengths), k_cache, v_cache


@pytest.mark.parametrize("bs", [BlockSizes(1), BlockSizes(16), BlockSizes(), BlockSizes(score="vpu", pages_per_block=2),
                                decode_block_sizes(), decode_block_sizes(4),
                                BlockSizes(pages_per_block=1, min_programs=32)],   # 6 blocks, 4 wanted: 6 splits
                         ids=["split1page", "onesplit", "default", "vpu", "decode", "decode_batched", "rounded_down"])
def test_fused_decode_matches_rope_write_attend(bs):
    # GQA 4 (8 query / 2 kv heads), d 32 (dots on 16-wide halves); lengths: the first token, a new
    # page's first slot (9 = 2 pages + 1), the last slot of a full table (24), an inactive row
    rng = np.random.default_rng(7)
    b, h, kvh, d, page_size, max_pages, num_pages, layers = 4, 8, 2, 32, 4, 6, 30, 2
    qkv = jnp.asarray(rng.normal(size=(b, h + 2 * kvh, d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(layers, num_pages, page_size, kvh, d)), jnp.float32)
                        for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)
    lengths = jnp.asarray([1, 9, 24, 0], jnp.int32)
    cos_sin = rope_cos_sin(jnp.maximum(lengths - 1, 0), rope.rope_frequencies(d, 10000.0))
    want, want_k, want_v = _fused_reference(qkv, k_cache, v_cache, table, lengths, 1, h, 10000.0)
    o, k_new, v_new = paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, lengths, jnp.int32(1), n_heads=h,
                                             block_sizes=bs, interpret=True)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(o)[3] == 0)                                          # inactive row: zeros
    np.testing.assert_allclose(np.asarray(k_new), np.asarray(want_k), atol=1e-6)  # the new slots, nothing else
    np.testing.assert_array_equal(np.asarray(v_new), np.asarray(want_v))
    assert int(jnp.sum(k_new != k_cache)) == 3 * kvh * d                          # 3 active rows written


def test_fused_decode_cached_rows_read_the_cache_and_write_nothing():
    # A cached row's token already lies in its page: attended from there (the recomputed k/v in
    # qkv are ignored), its slot left as it was; the other rows are fed as usual.
    rng = np.random.default_rng(9)
    b, h, kvh, d, page_size, max_pages, num_pages = 3, 8, 2, 32, 4, 6, 30
    qkv = jnp.asarray(rng.normal(size=(b, h + 2 * kvh, d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(2, num_pages, page_size, kvh, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)
    lengths, cached = jnp.asarray([9, 24, 5], jnp.int32), jnp.asarray([True, False, True])
    cos_sin = rope_cos_sin(lengths - 1, rope.rope_frequencies(d, 10000.0))
    fed, fed_k, fed_v = _fused_reference(qkv, k_cache, v_cache, table, lengths, 1, h, 10000.0)
    q = rope.apply_rope_reference(qkv[:, None, :h], qkv[:, None, h:h + kvh], (lengths - 1)[:, None], theta=10000.0)[0]
    from_cache = paged_attention_reference(q[:, 0], k_cache[1], v_cache[1], table, lengths)
    for bs in (BlockSizes(1), BlockSizes(), decode_block_sizes()):
        o, k_new, v_new = paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, lengths, jnp.int32(1), cached,
                                                 n_heads=h, block_sizes=bs, interpret=True)
        want = jnp.where(cached[:, None, None], from_cache, fed)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want), atol=2e-5, rtol=2e-5)
        keep_k = jnp.where(jnp.arange(num_pages)[None, :, None, None, None] == table[1, 23 // page_size], fed_k, k_cache)
        np.testing.assert_allclose(np.asarray(k_new), np.asarray(keep_k), atol=1e-6)   # row 1's slot only
        assert int(jnp.sum(v_new != v_cache)) == kvh * d and int(jnp.sum(v_new != fed_v)) == 2 * kvh * d
    with pytest.raises(ValueError, match="cached"):
        paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, lengths, 1, cached[:2], n_heads=h, interpret=True)


def test_fused_decode_bf16_and_errors():
    rng = np.random.default_rng(8)
    b, h, kvh, d = 2, 8, 2, 64
    qkv = jnp.asarray(rng.normal(size=(b, h + 2 * kvh, d)), jnp.bfloat16)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(12, 16, kvh, d)), jnp.bfloat16) for _ in range(2))
    table, lengths = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32), jnp.asarray([17, 64], jnp.int32)
    cos_sin = rope_cos_sin(lengths - 1, rope.rope_frequencies(d, 500000.0))
    want, want_k, _ = _fused_reference(qkv, k_cache[None], v_cache[None], table, lengths, 0, h, 500000.0)
    o, k_new, _ = paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, lengths, n_heads=h, interpret=True)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.asarray(k_new, np.float32), np.asarray(want_k[0], np.float32))
    with pytest.raises(ValueError, match="n_heads"):
        paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, lengths, n_heads=4, interpret=True)
    with pytest.raises(ValueError, match="cos_sin"):
        paged_decode_attention(qkv, cos_sin[:, :, :4], k_cache, v_cache, table, lengths, n_heads=h, interpret=True)


def test_fused_decode_lowers_for_cuda():
    # The GPU path without a GPU: interpret mode never builds the Triton kernel; lowering for CUDA
    # does (gathers, half-width column loads, the conditional in-place store), at llama3_1b's shape.
    import jax
    b, h, kvh, d, layers, pages = 1, 32, 8, 64, 2, 129
    args = (jax.ShapeDtypeStruct((b, h + 2 * kvh, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, 2, d // 2), jnp.float32),
            jax.ShapeDtypeStruct((layers, pages, 16, kvh, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((layers, pages, 16, kvh, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, 128), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
    for bs in (BlockSizes(), decode_block_sizes(), decode_block_sizes(16)):   # the serving step's tiles, by batch
        lowered = jax.jit(lambda *a, bs=bs: paged_decode_attention(*a, n_heads=h, block_sizes=bs)).trace(*args).lower(
            lowering_platforms=("cuda",))
        assert "paged_attention" in lowered.as_text() and "paged_attention_merge" in lowered.as_text()


def test_merge_kernel_matches_merge_splits_and_zero_pads():
    # 5 splits (not a power of two), GQA group 4 in 8 padded rows, one empty split (m = NEG, l = 0),
    # kv head 1 of row 1 inactive (every l = 0): the one-launch merge equals the jnp merge, and the
    # rows past the batch come back as zeros (the model's one-token GEMM padding). Row 2 is 2 tokens
    # long (a block of one page of one token per split): only its first 2 splits hold data, and the
    # rest (NaN here) must not be read.
    from pallas_kernels.paged_attention import NEG, merge_splits, merge_splits_kernel
    rng = np.random.default_rng(3)
    b, kvh, splits, rows, g, d = 3, 2, 5, 8, 4, 16
    acc = jnp.asarray(rng.normal(size=(b, kvh, splits, rows, d)), jnp.float32)
    m = jnp.asarray(rng.normal(size=(b, kvh, splits, rows)), jnp.float32).at[:, :, 3].set(NEG)
    l = jnp.asarray(rng.uniform(0.5, 2.0, size=(b, kvh, splits, rows)), jnp.float32).at[:, :, 3].set(0.0)
    l, acc = l.at[1, 1].set(0.0), acc.at[1, 1].set(0.0)
    want = merge_splits(acc[..., :g, :], m[..., :g], l[..., :g], jnp.float32)                 # [b, kvh*g, d]
    want2 = merge_splits(acc[2:, :, :2, :g], m[2:, :, :2, :g], l[2:, :, :2, :g], jnp.float32)
    acc, m, l = (x.at[2, :, 2:].set(jnp.nan) for x in (acc, m, l))
    lengths = jnp.asarray([splits, splits, 2], jnp.int32)
    got = merge_splits_kernel(acc, m, l, jnp.float32, lengths, g=g, rows_out=4, page_size=1, pages_per_block=1,
                              interpret=True)                                                  # [4, kvh*g, d]
    np.testing.assert_allclose(np.asarray(got[:2]), np.asarray(want[:2]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2:3]), np.asarray(want2), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(got[b:]) == 0) and np.all(np.asarray(got[1, g:]) == 0)


def test_active_splits_counts_the_splits_split_range_fills():
    from pallas_kernels.paged_tiles import active_splits, split_range
    for splits, ps, ppb in ((33, 16, 8), (5, 1, 1), (4, 4, 2)):
        for length in (0, 1, 7, 16, 100, 2048, 4000):
            filled = sum(int(split_range(length, s, splits=splits, page_size=ps, ppb=ppb)[1] > 0) for s in range(splits))
            assert int(active_splits(jnp.int32(length), splits=splits, page_size=ps, ppb=ppb)) == filled, (splits, length)


def test_fused_decode_with_padding_row():
    # b = 1 with the one-token GEMM's zero second row: row 0 as without it, row 1 zeros, same cache
    rng = np.random.default_rng(5)
    h, kvh, d, page_size = 8, 2, 32, 4
    qkv = jnp.asarray(rng.normal(size=(1, h + 2 * kvh, d)), jnp.float32)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(1, 8, page_size, kvh, d)), jnp.float32) for _ in range(2))
    table, lengths = jnp.asarray([[2, 5, 1, 7, 3, 4]], jnp.int32), jnp.asarray([19], jnp.int32)
    cos_sin = rope_cos_sin(lengths - 1, rope.rope_frequencies(d, 10000.0))
    run = lambda x: paged_decode_attention(x, cos_sin, k_cache, v_cache, table, lengths, 0, n_heads=h,  # noqa: E731
                                           block_sizes=BlockSizes(1), interpret=True)
    one, k1, v1 = run(qkv)
    two, k2, v2 = run(jnp.concatenate([qkv, jnp.zeros_like(qkv)]))
    assert two.shape == (2, h, d)
    np.testing.assert_allclose(np.asarray(two[:1]), np.asarray(one), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(two[1]) == 0)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k1))
    np.testing.assert_array_equal(np.asarray(v2), np.asarray(v1))
    with pytest.raises(ValueError, match="fewer rows"):
        paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, jnp.asarray([3, 4], jnp.int32), 0, n_heads=h,
                               interpret=True)


def test_one_token_stream_carries_the_zero_row():
    # Batch 1 through fused layers with the one-kernel attention: the zero row is added once (one
    # concatenate for the whole 2-layer stack, none per layer) and the kernel gets q|k|v with 2 rows
    import re

    import jax
    from flax import nnx
    import models
    from meshlab.infer import kv_cache
    from meshlab.infer.programs import _unfused_placeholders, serving_params
    from models import model_def, serving
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=2)
    md = model_def(cfg)
    served = serving_params(md, nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param)), "fused")
    model = md.bind(dict(served, layers=md.abstract["layers"]))
    per_layer = [(_unfused_placeholders(md, rest), fused) for rest, fused in served["layers"]]
    cache, table, pos = kv_cache.init_paged(cfg, 9, 4), jnp.arange(1, 5, dtype=jnp.int32)[None], jnp.full((1, 1), 5)
    attend = kv_cache.paged_attend(pos, jnp.ones((1, 1), bool), table, "pallas", interpret=True)
    text = str(jax.make_jaxpr(lambda t: serving.forward(model, t, pos, cache, attend, layers=per_layer)[0])(
        jnp.ones((1, 1), jnp.int32)))
    assert text.count("concatenate") == 1
    assert re.findall(r"let paged_decode_attention\w* = \{ lambda ; \w+:f32\[(\d+),", text) == ["2"]


# -- an fp8 KV cache (float8_e4m3fn pages, widened after each load) ------------------------------
FP8 = jnp.float8_e4m3fn


def test_to_cache_saturates_fp8_and_rounds_like_a_cast():
    from pallas_kernels.paged_tiles import to_cache, widened
    x = jnp.asarray([1000.0, -1e6, 3.3, -0.01, 448.0], jnp.float32)
    got = np.asarray(to_cache(x, FP8).astype(jnp.float32))
    np.testing.assert_array_equal(got, [448.0, -448.0, 3.25, -0.009765625, 448.0])   # no NaN past 448
    assert np.isnan(np.asarray(x.astype(FP8).astype(jnp.float32))[0])               # what a bare cast does
    assert to_cache(x, jnp.bfloat16).dtype == jnp.bfloat16
    assert widened(jnp.bfloat16, FP8) == jnp.bfloat16 and widened(jnp.float32, FP8) == jnp.float32
    assert widened(jnp.bfloat16, jnp.float32) == jnp.float32


@pytest.mark.parametrize("q_dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_fp8_pages_through_decode_and_prompt_kernels(q_dtype, tol):
    # fp8 pages against the references over the same fp8 values (read in fp32): exact math with an
    # fp32 q (the dots run in fp32), bf16 dots' rounding with a bf16 q
    from pallas_kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
    q, k, v, table, lengths = make_case(4, b=4, h=8, kvh=2, lengths=(1, 9, 24, 0))
    q, k, v = q.astype(q_dtype), (k * 3).astype(FP8), (v * 3).astype(FP8)
    want = paged_attention_reference(q, k, v, table, lengths)
    for bs in (BlockSizes(1), BlockSizes(), BlockSizes(score="vpu", pages_per_block=2)):
        got = paged_attention(q, k, v, table, lengths, block_sizes=bs, interpret=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    rng = np.random.default_rng(12)
    qp = jnp.asarray(rng.normal(size=(2, 8, 8, 16)), q_dtype)
    starts, ends = jnp.asarray([0, 13], jnp.int32), jnp.asarray([8, 17], jnp.int32)
    got = paged_prefill_attention(qp, k, v, table[:2], starts, ends, block_sizes=BlockSizes(), interpret=True)
    want = paged_prefill_reference(qp, k, v, table[:2], starts, ends)
    real = np.asarray(starts[:, None] + jnp.arange(8)[None] < ends[:, None])
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], atol=tol, rtol=tol)


def test_fused_decode_writes_fp8_and_attends_to_what_it_wrote():
    # The new token's k (after RoPE) and v are stored rounded to fp8 (saturated: one v entry of 1000
    # becomes 448), and its own score uses those stored values, as every later step reads them
    from pallas_kernels.paged_tiles import to_cache
    rng = np.random.default_rng(13)
    b, h, kvh, d, page_size, max_pages, num_pages = 3, 8, 2, 32, 4, 6, 30
    qkv = jnp.asarray(rng.normal(size=(b, h + 2 * kvh, d)), jnp.float32).at[0, h + kvh, 0].set(1000.0)
    k_cache, v_cache = (jnp.asarray(rng.normal(size=(2, num_pages, page_size, kvh, d)), FP8) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages), jnp.int32)
    lengths = jnp.asarray([1, 9, 24], jnp.int32)
    cos_sin = rope_cos_sin(lengths - 1, rope.rope_frequencies(d, 10000.0))
    q, k = rope.apply_rope_reference(qkv[:, None, :h], qkv[:, None, h:h + kvh], (lengths - 1)[:, None], theta=10000.0)
    want_k, want_v = k_cache, v_cache
    for i in range(b):
        page, slot = table[i, (lengths[i] - 1) // page_size], (lengths[i] - 1) % page_size
        want_k = want_k.at[1, page, slot].set(to_cache(k[i, 0], FP8))
        want_v = want_v.at[1, page, slot].set(to_cache(qkv[i, h + kvh:], FP8))
    want = paged_attention_reference(q[:, 0], want_k[1], want_v[1], table, lengths)
    for bs in (BlockSizes(1), decode_block_sizes()):
        o, k_new, v_new = paged_decode_attention(qkv, cos_sin, k_cache, v_cache, table, lengths, jnp.int32(1),
                                                 n_heads=h, block_sizes=bs, interpret=True)
        assert k_new.dtype == FP8 and float(jnp.max(v_new.astype(jnp.float32))) == 448.0
        np.testing.assert_array_equal(np.asarray(k_new, np.float32), np.asarray(want_k, np.float32))
        np.testing.assert_array_equal(np.asarray(v_new, np.float32), np.asarray(want_v, np.float32))
        np.testing.assert_allclose(np.asarray(o), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_fp8_cache_kernels_lower_for_cuda():
    # llama3_1b's heads over fp8 pages: the Triton kernels build (fp8 loads widened, the fused
    # kernel's saturating fp8 store), decode fused at the serving tiles, unfused, and a prompt row
    import jax
    from pallas_kernels.paged_prefill import paged_prefill_attention
    h, kvh, d = 32, 8, 64
    pages = jax.ShapeDtypeStruct((2, 129, 16, kvh, d), FP8)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)   # noqa: E731
    fused = (jax.ShapeDtypeStruct((1, h + 2 * kvh, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, 2, d // 2), jnp.float32),
             pages, pages, i32(1, 128), i32(1), i32())
    for bs in (decode_block_sizes(), decode_block_sizes(16)):
        text = jax.jit(lambda *a, bs=bs: paged_decode_attention(*a, n_heads=h, block_sizes=bs)).trace(*fused).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "paged_attention" in text
    plain = (jax.ShapeDtypeStruct((4, h, d), jnp.bfloat16), pages, pages, i32(4, 128), i32(4), i32())
    text = jax.jit(lambda *a: paged_attention(*a, block_sizes=decode_block_sizes(4, fused=False))).trace(*plain).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "paged_attention" in text
    pre = (jax.ShapeDtypeStruct((1, 64, h, d), jnp.bfloat16), pages, pages, i32(1, 128), i32(1), i32(1), i32())
    assert "paged_prefill_attention" in jax.jit(paged_prefill_attention).trace(*pre).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
def test_gpu_fp8_pages_match_references():
    # Compiled Triton over fp8 pages at llama3_1b's heads, ~2k tokens cached: a prompt row (a cached
    # prefix's 16-token tail in a 64-wide row), plain decode rows, and the fused step at batch 1
    from pallas_kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
    from pallas_kernels.paged_tiles import to_cache
    rng = np.random.default_rng(1)
    h, kvh, d, ps, max_pages, num_pages = 32, 8, 64, 16, 528, 1200
    k, v = (to_cache(jnp.asarray(rng.normal(size=(2, num_pages, ps, kvh, d)) * 4, jnp.float32), FP8) for _ in range(2))
    tables = jnp.asarray(np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(2)]), jnp.int32)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),  # noqa: E731
                                                   atol=3e-2, rtol=3e-2)
    q = jnp.asarray(rng.normal(size=(1, 64, h, d)), jnp.bfloat16)
    s, e = jnp.asarray([2032], jnp.int32), jnp.asarray([2048], jnp.int32)
    close(paged_prefill_attention(q, k, v, tables[:1], s, e, jnp.int32(1))[:, :16],
          paged_prefill_reference(q, k[1], v[1], tables[:1], s, e)[:, :16])
    q = jnp.asarray(rng.normal(size=(2, h, d)), jnp.bfloat16)
    lengths = jnp.asarray([2048, 17], jnp.int32)
    close(paged_attention(q, k, v, tables, lengths, jnp.int32(1), block_sizes=decode_block_sizes(2, fused=False)),
          paged_attention_reference(q, k[1], v[1], tables, lengths))
    qkv = jnp.asarray(rng.normal(size=(1, h + 2 * kvh, d)), jnp.bfloat16)
    cos_sin = rope_cos_sin(lengths[:1] - 1, rope.rope_frequencies(d, 500000.0))
    want, want_k, want_v = _fused_reference(qkv, k, v, tables[:1], lengths[:1], 1, h, 500000.0)
    o, k_new, v_new = paged_decode_attention(qkv, cos_sin, k, v, tables[:1], lengths[:1], jnp.int32(1), n_heads=h,
                                             block_sizes=decode_block_sizes(1))
    close(o, want)
    np.testing.assert_array_equal(np.asarray(k_new, np.float32), np.asarray(want_k, np.float32))
    np.testing.assert_array_equal(np.asarray(v_new, np.float32), np.asarray(want_v, np.float32))


def test_fp8_cache_of_two_to_four_gib_is_refused_and_the_engine_pages_past_it():
    # Pallas Triton's 32-bit offsets wrap for a 1-byte buffer of 2-4 GiB (measured on an H100: an fp8
    # cache of 2.28 GB read and wrote outside itself): the kernels refuse it, the engine adds pages
    import jax
    import models
    from meshlab.infer.kv_cache import pages_past_wrap
    h, kvh, d = 32, 8, 64
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)   # noqa: E731

    def lower(pages, dtype):
        cache = jax.ShapeDtypeStruct((16, pages, 16, kvh, d), dtype)
        args = (jax.ShapeDtypeStruct((1, h, d), jnp.bfloat16), cache, cache, i32(1, 128), i32(1), i32())
        return jax.jit(lambda *a: paged_attention(*a, block_sizes=decode_block_sizes(1, fused=False))).trace(
            *args).lower(lowering_platforms=("cuda",))
    with pytest.raises(ValueError, match=r"lies in \(2 GiB, 4 GiB\]"):
        lower(17409, FP8)                                  # 2.28e9 bytes
    for pages, dtype in ((16383, FP8), (32769, FP8), (17409, jnp.bfloat16)):   # 2.15e9 B, 4.29e9 B, 4.56e9 B
        assert "paged_attention" in lower(pages, dtype).as_text()
    cfg = models.preset("llama3_1b")                       # 131,072 fp8 bytes a page over 16 layers
    assert pages_past_wrap(cfg, 17409, 16, FP8) == 32769 and pages_past_wrap(cfg, 17409, 16, jnp.bfloat16) == 17409
    assert pages_past_wrap(cfg, 16384, 16, FP8) == 16384 and pages_past_wrap(cfg, 40000, 16, FP8) == 40000


def test_engine_pages_an_fp8_cache_past_the_wrap_for_the_compiled_kernels(monkeypatch):
    # The engine's use of pages_past_wrap, with the wrapping range scaled down to the tiny model (256 fp8
    # bytes a page): 17 pages lie in it and become 41 (40 usable) for the Pallas kernels compiled; a bf16
    # cache, XLA attention and interpret mode (no Triton offsets) keep the pages asked for
    from flax import nnx
    import models
    from meshlab.infer.engine import Engine
    from models import model_def
    from pallas_kernels import paged_tiles
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", n_layers=2)
    md = model_def(cfg)
    params = nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))
    per_page = cfg.n_layers * 4 * cfg.n_kv_heads * cfg.head_dim
    monkeypatch.setattr(paged_tiles, "WRAPPING_BYTES", (10 * per_page, 40 * per_page))   # the one binding
    for kw, pages in ((dict(impl="pallas", kv_cache_dtype="fp8"), 41), (dict(impl="pallas"), 17),
                      (dict(impl="xla", kv_cache_dtype="fp8"), 17),
                      (dict(impl="pallas", interpret=True, kv_cache_dtype="fp8"), 17)):
        eng = Engine(md, params, max_len=32, max_seqs=2, page_size=4, **kw)          # 2 rows of 8 pages + page 0
        assert (eng.cache["k"].shape[1], eng.sched.pool.total) == (pages, pages - 1), kw


@pytest.mark.parametrize("name", ["llama3_1b", "llama3_3b", "llama3_8b", "moe_1b_8e"])
def test_every_shipped_preset_serves_through_the_paged_kernels(name):
    # No shipped shape may fall back off the paged kernels on a GPU: a prompt row of any width the
    # engine packs (a 16-token tail, the narrow bucket, a chunk 32 does not divide, full chunks of
    # 512) takes the paged prompt kernel, not the flash kernel over the table's whole window (2.8 ms
    # a cached tail at llama3_3b's shape on an H100), and the decode partials keep only the group's
    # padded rows (the merge of 16 rows of d = 128 spills).
    import models
    from pallas_kernels.paged_tiles import pow2_at_least
    cfg = models.preset(name)
    group, max_pages = cfg.n_heads // cfg.n_kv_heads, 8448 // 16
    cache_shape = (cfg.n_layers, 1200, 16, cfg.n_kv_heads, cfg.head_dim)
    for rows, chunk in ((1, 16), (1, 48), (1, 64), (1, 512), (4, 512)):
        assert kv_cache.prefill_path("auto", "pallas", rows, chunk, cfg.n_heads, cache_shape, max_pages) == "paged"
    for batch in (1, 16, 64):
        p = plan(decode_block_sizes(batch, fused=batch <= 16), batch, cfg.n_kv_heads, max_pages, 16, group, cfg.head_dim)
        assert p["out_rows"] == pow2_at_least(group)
