"""Ulysses (all-to-all) context attention: equals single-device attention (output and gradients),
clear errors on head counts, collectives from the compiled program."""
import jax
import jax.numpy as jnp
import pytest
from test_ring_attention import check_against_reference, collectives, in_manual_region, inputs, make_mesh

from meshlab.parallel.context import context_attention
from meshlab.parallel.attention_blocks import jnp_flash_attention
from meshlab.parallel.ulysses import kv_head_repeats, ulysses_attention

# Compiling dominates (tiny shapes, many small programs): cheap_codegen.
pytestmark = pytest.mark.cheap_codegen
# Pairwise cover of context size x causal x GQA x segment ids; 8 query heads. kv heads 2 with
# context 4 or 8 takes the replicate-kv-heads path.
PAIRWISE = [  # n, causal, kv heads, segment ids
    (2, True, 2, True),
    (2, False, 8, False),
    (4, True, 8, True),
    (4, False, 2, False),
    (8, True, 2, False),
    (8, False, 8, True),
]


@pytest.mark.parametrize("n,causal,kvh,seg", PAIRWISE)
def test_ulysses_matches_single_device(n, causal, kvh, seg):
    mesh = make_mesh((n,), ("context",))
    q, k, v, sid, w = inputs(h=8, kvh=kvh, seg=seg)
    attn = lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, causal=causal, segment_ids=s)  # noqa: E731
    check_against_reference(attn, q, k, v, sid, w, causal, n, zigzag=False)


def test_ulysses_zigzag_input_with_fsdp_tensor_and_flash():
    """Through context_attention with zig-zag ordered input (the ring's pipeline), batch over
    fsdp, heads over tensor, and the memory-light jnp flash attention as the local kernel;
    called inside a shard_map already manual over fsdp (the train step's region)."""
    mesh = make_mesh((2, 2, 2), ("fsdp", "context", "tensor"))
    q, k, v, sid, w = inputs(h=8, kvh=4, seg=True, seed=3)
    fa = lambda *a, **kw: jnp_flash_attention(*a, block_k=8, **kw)  # noqa: E731
    attn = lambda q, k, v, s: context_attention(q, k, v, strategy="ulysses", mesh=mesh, causal=True,  # noqa: E731
                                                segment_ids=s, batch_axes="fsdp", head_axes="tensor",
                                                zigzag=True, attention_fn=fa)
    check_against_reference(in_manual_region(mesh, "fsdp", attn), q, k, v, sid, w, True, 2, zigzag=True)


def test_ulysses_head_errors():
    mesh = make_mesh((4,), ("context",))
    q, k, v, _, _ = inputs(h=6, kvh=3)
    with pytest.raises(ValueError, match=r"query heads \(6\) divisible by the context size \(4\)"):
        ulysses_attention(q, k, v, mesh=mesh)
    assert kv_head_repeats(2, 8, 4) == 2 and kv_head_repeats(8, 8, 4) == 1
    with pytest.raises(ValueError, match=r"kv heads \(3\)"):
        kv_head_repeats(3, 12, 4)
    with pytest.raises(ValueError, match="unknown context-parallel"):
        context_attention(q, k, v, strategy="star", mesh=mesh, causal=True)


def test_ulysses_compiled_collectives():
    """k/v/q/out move by all-to-all; the only all-gather is of the int32 segment ids."""
    n = 4
    mesh = make_mesh((n,), ("context",))
    q, k, v, sid, _ = inputs(h=8, kvh=4, seg=True)
    f = lambda q, k, v: jnp.sum(ulysses_attention(q, k, v, mesh=mesh, segment_ids=sid))  # noqa: E731
    ops = collectives(jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text())
    kinds = [op for op, _ in ops]
    assert "all-to-all" in kinds, ops
    assert "collective-permute" not in kinds
    for op, line in ops:
        if op == "all-gather":
            assert "s32[" in line and "f32[" not in line, line
    print(f"ulysses context={n}: " + ", ".join(f"{o} x{kinds.count(o)}" for o in sorted(set(kinds))))


def test_ulysses_temp_memory_with_flash_is_linear():
    """Local attention sees the whole sequence: with the default xla attention temp is ~ S^2 h/n,
    with a flash attention_fn ~ S x block_k x h/n. Printed for both; asserted for flash."""
    n = 4
    mesh = make_mesh((n,), ("context",))
    temps = {}
    flash = lambda *a, **kw: jnp_flash_attention(*a, block_k=256, **kw)  # noqa: E731
    for name, fn, s in (("jnp_flash", flash, 512), ("jnp_flash", flash, 2048), ("xla", None, 2048)):
        q = jax.ShapeDtypeStruct((1, s, 4, 16), jnp.float32)
        f = lambda q, k, v: jnp.sum(ulysses_attention(q, k, v, mesh=mesh, attention_fn=fn))  # noqa: E731
        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, q, q).compile()
        temps[name, s] = c.memory_analysis().temp_size_in_bytes
        print(f"ulysses S={s} context={n} local={name}: temp {temps[name, s] / 2**20:.2f} MiB")
    assert temps["jnp_flash", 2048] / temps["jnp_flash", 512] < 4 * 1.5
    assert temps["jnp_flash", 2048] < temps["xla", 2048]
