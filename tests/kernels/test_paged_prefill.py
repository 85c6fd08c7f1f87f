"""Paged prompt-chunk attention kernel (interpret mode) == its jnp reference == the gather and dense
causal attention; the windowed flash path; the prompt and decode kernels compiled on a GPU."""
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.infer import kv_cache
from pallas_kernels.paged_attention import BlockSizes, paged_attention, paged_attention_reference
from pallas_kernels.paged_tiles import CONFIGS, decode_block_sizes

# Compiling dominates (interpret-mode kernels): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen


def test_windowed_flash_equals_gathered_dense():
    """Prompt-chunk rows through the flash kernel over a window ending at each chunk (starts 0, not
    page-aligned, and at the end of the table) equal the gather + dense causal attention."""
    rng = np.random.default_rng(0)
    cache = {n: jnp.asarray(rng.normal(size=(2, 20, 4, 2, 16)), jnp.float32) for n in "kv"}
    table = jnp.asarray(np.stack([rng.permutation(np.arange(1, 20))[:8] for _ in range(3)]), jnp.int32)
    start = jnp.asarray([0, 5, 24], jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, 8, 4, 16)), jnp.float32)
    want = kv_cache.gathered_attention(q, cache, 1, table, start[:, None] + jnp.arange(8)[None])
    got = kv_cache.windowed_flash_attention(q, cache, 1, table, start, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bs", [BlockSizes(1), BlockSizes(), BlockSizes(score="vpu", pages_per_block=2),
                                BlockSizes(1, merge="xla"), BlockSizes(1, mask_tail=True)],
                         ids=["split1page", "default", "vpu", "xla_merge", "split1page_mask_tail"])
def test_prefill_kernel_matches_reference(bs):
    # Prompt-chunk rows of 16 queries, GQA 4 (8 query / 2 kv heads): a chunk from position 0, a
    # cached prefix's tail starting mid-page (5 real queries then padding), a chunk ending at the
    # table's last slot, and an empty row (padding only: zeros)
    _check_prefill_kernel(bs, h=8)


@pytest.mark.parametrize("bs", [BlockSizes(1), BlockSizes(), BlockSizes(1, merge="xla"), BlockSizes(pages_per_split=16)],
                         ids=["split1page", "default", "xla_merge", "one_split"])
def test_prefill_kernel_group_of_three(bs):
    # GQA 3 (Llama-3.2-3B's 24 / 8): the group runs padded to 4 heads, the copies dropped, through
    # one split, several with the merge launch, and XLA's merge
    _check_prefill_kernel(bs, h=6)


@pytest.mark.parametrize("bs", [BlockSizes(block_q=32), BlockSizes(block_q=64, pages_per_block=4, num_warps=8),
                                BlockSizes(block_q=32, pages_per_block=2, mask_tail=True),
                                BlockSizes(pages_per_split=16, pages_per_block=2, mask_tail=True)],
                         ids=["block_q32", "block_q64", "block_q32_mask_tail", "one_split_mask_tail"])
def test_prefill_kernel_wide_query_blocks(bs):
    # 64-token chunk rows in query blocks of 16-64 tokens (64-256 tile rows at GQA 4): a row from
    # position 0, one starting mid-page whose real queries end inside its second block, one ending at
    # the table's last slot, and an empty row. mask_tail: the blocks before a query block run unmasked
    # (several splits, and one split that finishes in the kernel), the padding rows cleared
    _check_prefill_kernel(bs, h=8, c=64, max_pages=40, starts=[0, 21, 96, 3], ends=[64, 61, 160, 3])


def _check_prefill_kernel(bs, h, c=16, max_pages=10, starts=(0, 21, 24, 3), ends=(16, 26, 40, 3)):
    from pallas_kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
    rng = np.random.default_rng(11)
    rows, kvh, d, page_size = 4, 2, 16, 4
    num_pages = rows * max_pages + 8
    q = jnp.asarray(rng.normal(size=(rows, c, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, num_pages, page_size, kvh, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:rows * max_pages].reshape(rows, max_pages), jnp.int32)
    starts, ends = jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32)
    want = paged_prefill_reference(q, k[1], v[1], table, starts, ends)
    got = paged_prefill_attention(q, k, v, table, starts, ends, jnp.int32(1), block_sizes=bs, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(got)[1, int(ends[1] - starts[1]):] == 0) and np.all(np.asarray(got)[3] == 0)
    # the reference is the gather + dense causal attention the XLA path runs
    dense = kv_cache.gathered_attention(q, {"k": k, "v": v}, 1, table, starts[:, None] + jnp.arange(c)[None])
    real = np.asarray(starts[:, None] + jnp.arange(c)[None] < ends[:, None])
    np.testing.assert_allclose(np.asarray(want)[real], np.asarray(dense)[real], atol=2e-5, rtol=2e-5)


def test_prefill_kernel_lowers_for_cuda():
    # llama3_1b's shape: a 64-wide row (the engine's narrow bucket, several splits and the merge
    # launch) and two 512-wide rows: the Triton kernels build (reshapes, per-row masks, gathers)
    import jax
    from pallas_kernels.paged_prefill import paged_prefill_attention
    for rows, c in ((1, 64), (2, 512)):
        args = (jax.ShapeDtypeStruct((rows, c, 32, 64), jnp.bfloat16),
                jax.ShapeDtypeStruct((2, 300, 16, 8, 64), jnp.bfloat16),
                jax.ShapeDtypeStruct((2, 300, 16, 8, 64), jnp.bfloat16),
                jax.ShapeDtypeStruct((rows, 128), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
        lowered = jax.jit(paged_prefill_attention).trace(*args).lower(lowering_platforms=("cuda",))
        assert "paged_prefill_attention" in lowered.as_text()
        for tiles in (BlockSizes(block_q=64, pages_per_block=4, num_warps=8), BlockSizes(block_q=32, mask_tail=True)):
            wide = jax.jit(lambda *a, tiles=tiles: paged_prefill_attention(*a, block_sizes=tiles))
            assert "paged_prefill_attention" in wide.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        if c == 64:
            assert "paged_attention_merge" in lowered.as_text()
    # llama3_3b's group of 3 (24 heads on 8, d 128): its tail row builds with the group padded to 4
    args3 = (jax.ShapeDtypeStruct((1, 64, 24, 128), jnp.bfloat16), *(jax.ShapeDtypeStruct((2, 300, 16, 8, 128),
                                                                                          jnp.bfloat16),) * 2, *args[3:])
    assert "paged_attention_merge" in jax.jit(paged_prefill_attention).trace(*args3).lower(
        lowering_platforms=("cuda",)).as_text()
    # the decode kernel with V loaded alongside K (a sweep config) builds too
    dec = (jax.ShapeDtypeStruct((1, 32, 64), jnp.bfloat16), args[1], args[2], jax.ShapeDtypeStruct((1, 128), jnp.int32),
           jax.ShapeDtypeStruct((1,), jnp.int32), args[-1])
    lowered = jax.jit(lambda *a: paged_attention(*a, block_sizes=CONFIGS["dot8_vfirst"])).trace(*dec).lower(
        lowering_platforms=("cuda",))
    assert "paged_attention" in lowered.as_text()


@pytest.mark.gpu
def test_gpu_prompt_and_decode_kernels_match_references():
    # Compiled Triton on the GPU at llama3_1b's heads, bf16, an 8k-wide table holding ~2k tokens
    # (pages dealt over the splits at run time): a 64-wide row of a cached prefix's 16-token tail,
    # two 512-wide chunk rows (one from position 0), and decode rows at the same lengths
    for h, kvh, d in ((32, 8, 64), (24, 8, 128)):             # llama3_1b's heads, llama3_3b's (a group of 3)
        _gpu_prompt_and_decode_case(h, kvh, d)


def _gpu_prompt_and_decode_case(h, kvh, d):
    from pallas_kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
    rng = np.random.default_rng(0)
    ps, max_pages, num_pages = 16, 528, 1200
    k, v = (jnp.asarray(rng.normal(size=(2, num_pages, ps, kvh, d)), jnp.bfloat16) for _ in range(2))
    tables = jnp.asarray(np.stack([rng.permutation(num_pages)[:max_pages] for _ in range(2)]), jnp.int32)
    for rows, c, starts, ends in ((1, 64, [2032], [2048]), (2, 512, [0, 1536], [512, 2048])):
        q = jnp.asarray(rng.normal(size=(rows, c, h, d)), jnp.bfloat16)
        s, e = jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32)
        want = paged_prefill_reference(q, k[1], v[1], tables[:rows], s, e)
        # the default tiles, and wide query blocks with the mask kept to the last blocks (a sweep config)
        for tiles in (BlockSizes(), BlockSizes(block_q=64, pages_per_block=4, num_warps=8, mask_tail=True)):
            got = paged_prefill_attention(q, k, v, tables[:rows], s, e, jnp.int32(1), block_sizes=tiles)
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
    q = jnp.asarray(rng.normal(size=(2, h, d)), jnp.bfloat16)
    lengths = jnp.asarray([2048, 17], jnp.int32)
    for bs in (BlockSizes(), CONFIGS["dot8_vfirst"], decode_block_sizes(2, fused=False)):   # the serving tiles too
        got = paged_attention(q, k, v, tables, lengths, jnp.int32(1), block_sizes=bs)
        want = paged_attention_reference(q, k[1], v[1], tables, lengths)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2)
