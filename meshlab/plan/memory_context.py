"""Memory of context-parallel attention (meshlab/parallel/ring_attention.py, ulysses.py), per device.

Neither strategy runs the attention `model.attention` names:
  ring     its own custom_vjp: q, k, v, the output and an fp32 lse per query and head are saved (never
           an [S, S] array), and forward and backward run one ring step at a time over k/v blocks that
           travel the `context` ring. With the jnp blocks (what `auto` runs off a GPU, and on a GPU for
           head dims the Pallas blocks do not take) each step forms [cq, bk] score tiles in memory; the
           Pallas blocks keep them on chip.
  ulysses  all-to-alls to head sharding, then `dot_product_attention(impl="auto")` on the whole sequence
           for heads/context heads (meshlab/parallel/context.py): on this process's devices that is
           `resolve("auto")`, so on a CPU the XLA attention with its [S, S] arrays, on a GPU a flash kernel.
"""
from __future__ import annotations

import dataclasses

F32 = 4


@dataclasses.dataclass(frozen=True)
class RingBlocks:
    """What ring attention's jnp blocks hold on one device, per row and query head (zig-zag causal order)."""
    hops: int      # k/v blocks each device receives (context size - 1)
    step: int      # score elements one ring step holds at once (0: the Pallas blocks keep them on chip)
    hoisted: int   # score elements of the diagonal step's single-tile causal calls (their mask and fills)
    inits: int     # query rows of the accumulators the forward creates once per step and branch
    dots: int      # elements of the forward's dot outputs over every step and branch (what save_dots keeps)


def ring_blocks(s_local: int, n: int, head_dim: int) -> RingBlocks:
    """Ring attention's blocks for a local shard of `s_local` tokens on a ring of `n` devices. With the
    Pallas block kernel (attention_blocks.resolve_block_impl, as the model's call resolves it) no score is
    held in memory: only the ring's own output and lse accumulators are counted.

    Each block call tiles its keys by bk = block_k where block_k divides them, else takes them whole
    (attention_blocks._tile), and a square causal call is split along its queries while half of it is at
    least block_k (MAX_SPLITS deep). With c = s_local / 2 a step off the diagonal runs one call, both
    query halves against one k/v half (s_local x c) or one half against both (c x s_local); the diagonal
    step runs two causal calls, c x c and c x s_local, whose tiles the compiled step holds at once
    (XLA:CPU, 8 devices).

    The forward's loop invariants are hoisted out of the layer scan by JAX and live until the forward
    ends: each single-tile causal call's broadcast mask and its two fp32 fills (-1e30 for the masked
    scores, 0 for their exponentials), and the zero/-1e30 accumulators every call of every step starts
    from ([cq, head_dim + 2] fp32 per head: output, max, sum; both branches of a step whose devices run
    different calls), the ring's own output and lse among them.

    Under remat=save_dots (checkpoint_dots: batched dots too) the forward's dots are saved: every key
    tile's scores and partial output, fp32, of every step, and of both branches of a step whose devices
    run different calls (the switch returns each branch's residuals): about context - 1/4 times the
    [S/context, S/context] scores the XLA attention would save."""
    from meshlab.parallel.attention_blocks import MAX_SPLITS, resolve_block_impl
    from meshlab.parallel.ring_attention import BLOCK_K as block_k   # what the model's call runs
    if resolve_block_impl("auto", head_dim) != "jnp":
        return RingBlocks(hops=n - 1, step=0, hoisted=0, inits=s_local, dots=0)

    def tile(keys):
        return block_k if keys > block_k and keys % block_k == 0 else keys

    def causal(cq, ck, depth=0):
        if cq == ck and cq % 2 == 0 and cq // 2 >= block_k and depth < MAX_SPLITS:
            return causal(cq // 2, cq // 2, depth + 1) + [(cq // 2, ck)]
        return [(cq, ck)]

    def dots(cq, ck):   # the scores and the partial output (head_dim wide) of every key tile
        return cq * (ck + head_dim * (ck // tile(ck)))
    c = s_local // 2
    diagonal, off = causal(c, c) + [(c, s_local)], [(s_local, c), (c, s_local)]
    step = max(sum(q * tile(k) for q, k in diagonal), *(q * tile(k) for q, k in off))
    return RingBlocks(hops=n - 1, step=step, hoisted=sum(q * k for q, k in diagonal if tile(k) == k),
                      inits=2 * c + (n - 1) * (s_local + c) + s_local,
                      dots=sum(dots(*x) for x in diagonal) + (n - 1) * sum(dots(*x) for x in off))


def ring_saved_dots(lc, policy: str) -> int:
    """Bytes per device and layer that remat=save_dots saves of the ring's forward (`ring_blocks`)."""
    return F32 * lc.b * lc.h * lc.ring_blocks.dots if policy == "save_dots" else 0


def ring_forward_bytes(lc, policy: str) -> dict:
    """One layer's ring attention forward beside the saved residuals, per device (`lc`: memory.Local).
      tiles    one step's scores and their exponentials, fp32;
      blocks   the ring's fp32 output and lse accumulators and the k/v blocks received (`received_kv`);
      hoisted  the loop invariants of `ring_blocks`: 1 (mask) + 2 x 4 (fills) bytes per score of the
               diagonal's single-tile causal calls, 4 x (head_dim + 2) per accumulator row and head;
      dots     under save_dots the layer's saved dots (`ring_saved_dots`) a second time: the steps'
               outputs are held until the layer scan writes its residuals into their stack.
    Measured on 8 CPU devices (tiny, 2 layers, context 4 and 8): while the shards are within block_k
    (S = 512 and 1024) the step's peak is here, in the last layer's forward, under every policy; at
    S = 4096 (context 4: 1024 tokens a shard, tiled) it is the backward's tiles."""
    rb, n = lc.ring_blocks, lc.b * lc.h
    return {"tiles": 2 * F32 * n * rb.step, "blocks": lc.b * lc.s_attn * F32 * lc.h * (lc.hd + 1) + received_kv(lc),
            "hoisted": n * ((1 + 2 * F32) * rb.hoisted + F32 * (lc.hd + 2) * rb.inits),
            "dots": ring_saved_dots(lc, policy)}


def received_kv(lc) -> int:
    """The k/v blocks a device receives in one pass of the ring, compute dtype: all `hops` of them. The
    collective-permutes form a chain that no block computation feeds, so the compiled step issues them
    ahead of the blocks that read them (XLA:CPU holds every received block at the forward's peak and at
    the recomputed forward's): the whole sequence's k and v but the device's own shard."""
    return lc.ring_blocks.hops * 2 * lc.b * lc.s_attn * lc.kvh * lc.hd * lc.c


def ring_backward_blocks(lc) -> int:
    """The ring backward's buffers beside its score tiles, per device: the fp32 dQ, dK, dV accumulators,
    the dK/dV travelling to the next device (fp32), the k/v blocks received (`received_kv`: the backward's
    own pass, or under remat the recomputed forward's) and delta = rowsum(dO * O) per query and head (fp32)."""
    return lc.b * lc.s_attn * (lc.hd * F32 * (lc.h + 4 * lc.kvh) + F32 * lc.h) + received_kv(lc)


def ulysses_local_attention() -> str:
    """The attention Ulysses runs on its gathered sequence on this process's devices (see the module
    docstring): "xla" where `auto` resolves to it, else the flash kernel it picks."""
    from pallas_kernels.attention import resolve
    return resolve("auto")
