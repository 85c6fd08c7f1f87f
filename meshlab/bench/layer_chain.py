"""A batch-1 decode layer's Pallas kernels chained over many layers, without the engine around them.

`chain_time` runs what `models.serving.decode_step` runs per layer ([norm + q|k|v], [RoPE + cache
write + attention], the split merge, [wo + residual], [norm + gate|up + SwiGLU], [down + residual])
over `n_layers` layers of distinct random weights and one stacked paged cache, jitted once, and
times it: the launches sit back to back as in a decode step, so a variant's cost includes what it
does to the boundaries between launches. Each variant compiles in seconds (no engine, no prompt
programs), so one GPU call can time many attention tilings or leave a stage out (`skip`) to take
its cost by difference. `chain_fn` alone, run once per variant, is what a profiler (ncu) looks at.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.bench.timing import median_time
from pallas_kernels import decode_gemv as dg
from pallas_kernels import paged_tiles
from pallas_kernels.paged_attention import paged_decode_attention, rope_cos_sin
from pallas_kernels.rope import rope_frequencies


@dataclasses.dataclass(frozen=True)
class ChainState:
    weights: list            # per layer {"wqkv", "wo", "wgu", "wdown", "s_attn", "s_mlp"}, stored [n, k]
    k: jax.Array             # [layers, pages, page_size, kvh, hd]
    v: jax.Array
    table: jax.Array         # [1, max_pages] int32, the sequence's pages scattered over the pool
    lengths: jax.Array       # [1] tokens cached after this step's write (the new one included)
    cos_sin: jax.Array       # [1, 2, hd / 2]
    x: jax.Array             # [1, d]


def chain_state(cfg, n_layers: int, ctx: int, max_len: int, page_size: int = 16, seed: int = 0) -> ChainState:
    """Random weights (scaled so activations stay O(1)) and a cache of max_len // page_size pages per
    layer, a sequence of `ctx` tokens (its pages a random permutation of the pool, as an engine's
    become after some traffic)."""
    d, hd, h, kvh, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_dim
    dt = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 6 * n_layers + 3))
    normal = lambda shape, fan_in: (jax.random.normal(next(keys), shape, jnp.float32) * fan_in ** -0.5).astype(dt)  # noqa: E731
    weights = [{"wqkv": normal(((h + 2 * kvh) * hd, d), d), "wo": normal((d, h * hd), h * hd),
                "wgu": normal((2, f, d), d), "wdown": normal((d, f), f),
                "s_attn": jnp.ones((d,), jnp.float32), "s_mlp": jnp.ones((d,), jnp.float32)}
               for _ in range(n_layers)]
    pages = max_len // page_size
    k = jax.random.normal(next(keys), (n_layers, pages + 1, page_size, kvh, hd), jnp.float32).astype(dt)
    v = jax.random.normal(next(keys), k.shape, jnp.float32).astype(dt)
    table = jnp.asarray(np.random.default_rng(seed).permutation(pages)[None], jnp.int32)
    inv_freq = rope_frequencies(hd, cfg.rope_theta, None)
    x = jax.random.normal(next(keys), (1, d), jnp.float32).astype(dt)
    return ChainState(weights, k, v, table, jnp.array([ctx], jnp.int32),
                      rope_cos_sin(jnp.array([ctx - 1]), inv_freq), x)


def chain_fn(cfg, attn_tiles: paged_tiles.BlockSizes | None = None, skip: frozenset = frozenset(),
             interpret: bool = False):
    """jit((x, weights, k, v, table, lengths, cos_sin) -> (x, k, v)), k/v donated: every layer of
    `weights` as decode_step runs it. skip: "attention" (o = q, read from q|k|v: no attention or
    merge launch), "wo", "mlp" (the launches left out, their input passed on)."""
    h, hd = cfg.n_heads, cfg.head_dim
    tiles = attn_tiles or paged_tiles.decode_block_sizes()
    mv = lambda *a, **kw: dg.decode_gemv(*a, eps=cfg.norm_eps, interpret=interpret, **kw)  # noqa: E731

    def run(x, weights, k, v, table, lengths, cos_sin):
        for layer, w in enumerate(weights):
            qkv = mv(x, w["wqkv"], norm_scale=w["s_attn"])                                      # [1, (h+2kvh) hd]
            if "attention" in skip:
                o = qkv[:, :h * hd]                                                             # [1, h hd]
            else:
                o, k, v = paged_decode_attention(qkv.reshape(1, -1, hd), cos_sin, k, v, table, lengths, layer,
                                                 n_heads=h, block_sizes=tiles, interpret=interpret)   # [1, h, hd]
                o = o.reshape(1, h * hd)
            x = x + o[:, :x.shape[1]] if "wo" in skip else mv(o, w["wo"], residual=x)           # [1, d]
            if "mlp" not in skip:
                act = mv(x, w["wgu"], norm_scale=w["s_mlp"], swiglu=True)                        # [1, f]
                x = mv(act, w["wdown"], residual=x)                                              # [1, d]
        return x, k, v
    return jax.jit(run, donate_argnums=(2, 3))


def chain_time(cfg, state: ChainState, attn_tiles=None, skip=frozenset(), reps: int = 20,
               interpret: bool = False) -> tuple[float, jax.Array, ChainState]:
    """(median us per layer of the chain over state's layers, its output x, the state with its cache
    carried on: each run writes the same new token's K/V, so every run computes the same x)."""
    fn = chain_fn(cfg, attn_tiles, frozenset(skip), interpret)
    box = {"k": state.k, "v": state.v}

    def once():
        x, box["k"], box["v"] = fn(state.x, state.weights, box["k"], box["v"], state.table, state.lengths,
                                   state.cos_sin)
        return x
    x = jax.block_until_ready(once())
    t = median_time(once, warmup=1, reps=reps, inner=8)
    return t / len(state.weights) * 1e6, x, dataclasses.replace(state, k=box["k"], v=box["v"])


def attention_variants(max_pages: int) -> dict:
    """Named attention tilings for the batch-1 chain: the shipped decode tiles, and changes to the
    kernel's default BlockSizes: fewer splits (1 split: no merge launch, 8 programs each reading a KV
    head's whole context), warps, stages, page blocks and V loaded beside K, alone and combined
    (st1_ppb4_vfirst is what decode_block_sizes ships)."""
    tiles = paged_tiles.BlockSizes
    out = {"shipped": paged_tiles.decode_block_sizes(), "default": tiles()}
    for splits in (1, 8):
        out[f"s{splits}"] = tiles(pages_per_split=-(-max_pages // splits))
    out.update({"w2": tiles(num_warps=2), "w8": tiles(num_warps=8), "ppb4": tiles(pages_per_block=4),
                "vfirst": tiles(v_first=True)})
    for stages in (1, 3):
        st = dict(num_stages=stages)
        out.update({f"st{stages}": tiles(**st), f"st{stages}_vfirst": tiles(v_first=True, **st),
                    f"st{stages}_ppb4": tiles(pages_per_block=4, **st),
                    f"st{stages}_ppb4_vfirst": tiles(pages_per_block=4, v_first=True, **st)})
    out.update({"st1_ppb2": tiles(pages_per_block=2, num_stages=1), "st1_w2": tiles(num_warps=2, num_stages=1),
                "st1_w2_vfirst": tiles(num_warps=2, num_stages=1, v_first=True),
                "st1_s8": tiles(pages_per_split=-(-max_pages // 8), num_stages=1),
                "st1_ppb4_p528": tiles(pages_per_block=4, num_stages=1, min_programs=528)})
    return out
