"""KV caches, contiguous and paged, and the `Attend` each step hands the model's serving forward.

The model (models/serving.py) knows nothing about the layout: it hands each layer's new q/k/v to
`attend(layer, q, k, v, cache)`, which writes k/v into the cache and attends over it. Both
layouts keep KV heads only (GQA: a group of query heads reads one cached head), stacked over
layers in one array per k/v so the layer scan updates only the new tokens in place (the cache is
the scan carry and is donated, so XLA writes into the same buffer).

  contiguous  k/v [layers, batch, max_len, kv_heads, head_dim]   names cache_batch, cache_seq, cache_kv_heads
              a row per sequence; reads need no gather; memory is batch * max_len even for short ones.
  paged       k/v [layers, pages, page_size, kv_heads, head_dim] names cache_pages, cache_kv_heads
              fixed-size pages from a shared pool; a page table [batch, max_pages] maps a sequence's
              position p to page_table[b, p // page_size], slot p % page_size. Memory follows the
              tokens actually held; the price is a gather of the sequence's pages per read.

Writes of padding tokens (valid=False) go to an out-of-range index and are dropped (`mode="drop"`),
so one compiled program serves any mix of prompt chunks and decode tokens.

The cache is in the model's dtype, or float8_e4m3fn (`cache_dtype(cfg, "fp8")`, vLLM's
kv_cache_dtype="fp8": no scales, K/V saturated at +-448): half the bytes a decode step reads per
cached token and twice the tokens a memory budget holds. Values are rounded to it when written
(`to_cache`) and widened back to the model's dtype after each read, so attention's products and
softmax run as they do over a bf16 cache; only the stored K/V lose precision.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from meshlab.rules import constrain
from models.serving import Attend
from pallas_kernels import paged_tiles
from pallas_kernels.paged_tiles import to_cache, widened

KV_CACHE_DTYPES = ("auto", "fp8")      # auto: the model's dtype

FUSED_MAX_BATCH = 16   # paged_attend: largest batch that uses the RoPE + write + attention kernel
CONTIGUOUS_NAMES = (None, "cache_batch", "cache_seq", "cache_kv_heads", None)
PAGED_NAMES = (None, "cache_pages", None, "cache_kv_heads", None)


def _zeros(shape, dtype, names, rules=None, mesh=None):
    """A zero cache created directly in its rule-file sharding (never whole on one device)."""
    if rules is None or mesh is None:
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    sharding = NamedSharding(mesh, rules.spec(names, shape, mesh, path="kv_cache"))
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return {"k": make(), "v": make()}


def cache_dtype(cfg, kv_cache_dtype: str = "auto"):
    """The cache's dtype for an engine's kv_cache_dtype (one of KV_CACHE_DTYPES)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{kv_cache_dtype=} must be one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype, "
                         f"{cfg.dtype})")
    return jnp.dtype(jnp.float8_e4m3fn if kv_cache_dtype == "fp8" else cfg.dtype)


def pages_past_wrap(cfg, num_pages: int, page_size: int, dtype) -> int:
    """num_pages, or for an fp8 cache that would lie in paged_tiles.WRAPPING_BYTES (2-4 GiB per K/V,
    where the Pallas kernels' 32-bit offsets wrap) the fewest pages past 4 GiB: the extra pages are
    usable capacity, and the cache is then about as large as a bf16 cache of the pages asked for."""
    itemsize = jnp.dtype(dtype).itemsize
    per_page = cfg.n_layers * page_size * cfg.n_kv_heads * cfg.head_dim * itemsize
    wraps = paged_tiles.cache_bytes_wrap(num_pages * per_page, itemsize)     # paged_tiles' range, read now
    return paged_tiles.WRAPPING_BYTES[1] // per_page + 1 if wraps else num_pages


def summary(cache: dict) -> str:
    """A paged cache in one line, as a server states it at start: usable pages (page 0 is reserved),
    the tokens they hold, K and V's bytes together and their dtype."""
    k = cache["k"]
    pages, page_size = k.shape[1] - 1, k.shape[2]
    return (f"KV cache: {pages:,} pages of {page_size} tokens ({pages * page_size:,} tokens), "
            f"{2 * k.size * k.dtype.itemsize / 2 ** 30:.2f} GiB of {k.dtype}")


def init_contiguous(cfg, batch: int, max_len: int, dtype=None, rules=None, mesh=None) -> dict:
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    return _zeros(shape, dtype, CONTIGUOUS_NAMES, rules, mesh)


def init_paged(cfg, num_pages: int, page_size: int, dtype=None, rules=None, mesh=None) -> dict:
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
    return _zeros(shape, dtype, PAGED_NAMES, rules, mesh)


def cache_bytes(cfg, tokens: int, dtype=None) -> int:
    """Bytes of K and V for `tokens` cached tokens over all layers."""
    return 2 * cfg.n_layers * tokens * cfg.n_kv_heads * cfg.head_dim * jnp.dtype(dtype or cfg.dtype).itemsize


def memory_per_device(devices) -> int | None:
    """Bytes one of `devices` holds: the accelerator's allocator limit, or this host's RAM for CPU devices
    (None where neither is known)."""
    from meshlab.mesh import allocator_limit
    if (limit := allocator_limit(devices[0])) is not None:
        return limit
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if devices[0].platform == "cpu" else None
    except (ValueError, OSError):
        return None


def check_fits(cfg, tokens: int, dtype, mesh, what: str) -> None:
    """ValueError, before anything is allocated, when a cache of `tokens` could not fit even split evenly over
    the mesh's devices (one device without a mesh; what: the settings that sized it, for the message)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    need, have = cache_bytes(cfg, tokens, dtype), memory_per_device(devices)
    if have is not None and need > have * len(devices):
        raise ValueError(f"the KV cache of {tokens:,} tokens ({what}) takes {need / 2**30:,.1f} GiB, more than the "
                         f"{len(devices)} device(s) hold ({have / 2**30:,.1f} GiB each); lower the settings that size it")


def dense_attention(q, k, v, q_pos):
    """q [b, t, h, d] at positions q_pos [b, t]; k/v [b, s, kvh, d] where index == position.
    Key j is visible to a query at position p iff j <= p (everything up to p is already written)."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    out_dtype, wide = q.dtype, widened(q.dtype, k.dtype)                               # an fp8 cache: widened
    q, k, v = q.astype(wide), k.astype(wide), v.astype(wide)
    qg = q.reshape(b, t, kvh, h // kvh, d)                                              # [b, t, kvh, g, d]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * d ** -0.5
    mask = jnp.arange(s)[None, None, :] <= q_pos[:, :, None]                           # [b, t, s]
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    p = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(out_dtype)


def contiguous_attend(positions, valid):
    """The Attend of the contiguous layout; positions/valid [b, t] for this step's tokens."""
    def attend(layer, q, k, v, cache):
        b, t = positions.shape
        max_len = cache["k"].shape[2]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        pos = jnp.where(valid, positions, max_len)                   # padding -> out of range -> dropped
        new = {name: constrain(cache[name].at[layer, rows, pos].set(to_cache(x, cache[name].dtype), mode="drop"),
                               CONTIGUOUS_NAMES)
               for name, x in (("k", k), ("v", v))}
        o = dense_attention(q, new["k"][layer], new["v"][layer], positions)
        return o, new
    return Attend(attend, live=valid[:, 0])


def gathered_attention(q, cache, layer, page_table, q_pos):
    """q [b, t, h, d] at positions q_pos [b, t] over the pages page_table [b, max_pages] of the
    stacked cache's `layer`, gathered into [b, max_pages * page_size, kvh, d] (XLA's path)."""
    b, max_pages = page_table.shape
    page_size, kvh, d = cache["k"].shape[2:]
    seq_k = cache["k"][layer][page_table].reshape(b, max_pages * page_size, kvh, d)    # [b, s, kvh, d]
    seq_v = cache["v"][layer][page_table].reshape(b, max_pages * page_size, kvh, d)
    return dense_attention(q, seq_k, seq_v, q_pos)


def windowed_flash_attention(q, cache, layer, table, start, interpret: bool = False):
    """Prompt-chunk rows q [k, c, h, d] whose first query sits at position start [k] (queries at
    start + i; padding at the end), through the tiled flash kernel (no [c, s] score matrix in HBM).
    Each row gathers the window of its sequence's s = max_pages * page_size positions that ends
    with its chunk: key j is position start + c - s + j, so causality is the kernel's static
    offset s - c (query i sees key j <= i + s - c), and positions below 0 are masked by segment
    ids. The window is gathered per token (a row's start need not be page-aligned)."""
    from pallas_kernels.flash_attention import flash_attention
    k_rows, c = q.shape[:2]
    page_size, max_pages = cache["k"].shape[2], table.shape[1]
    s = max_pages * page_size
    kpos = (start + c - s)[:, None] + jnp.arange(s)[None, :]                           # [k, s]
    page = jnp.take_along_axis(table, jnp.clip(kpos // page_size, 0, max_pages - 1), axis=1)
    off = kpos % page_size
    kw, vw = cache["k"][layer, page, off], cache["v"][layer, page, off]                 # [k, s, kvh, d]
    seg = (jnp.ones((k_rows, c), jnp.int32), (kpos >= 0).astype(jnp.int32))
    return flash_attention(q, kw.astype(q.dtype), vw.astype(q.dtype), causal=True, segment_ids=seg,
                           interpret=interpret)


def packed_attend(positions, write_page, write_off, dec_table, dec_len, pre_table, impl: str = "xla",
                  interpret: bool = False, prefill: str = "auto"):
    """The Attend of a token-packed step: this step's T tokens as one stream [1, T], laid out as
    n_dec decode tokens (one per sequence) then k prompt-chunk rows of `chunk` tokens (a row holds
    one sequence's consecutive tokens, padding at its end; a sequence may fill several rows, each
    attending to the earlier ones' keys, written first): T = n_dec + k * chunk, shapes only.

    positions [1, T]; write_page/write_off [T]: the cache slot of each token's k/v (write_page =
    num_pages for padding: dropped); dec_table [n_dec, max_pages] and dec_len [n_dec] (tokens
    cached, this one included; 0 = padding row); pre_table [k, max_pages]. Projections, MLPs
    and the cache write run over the packed stream; attention splits it: the decode tokens
    through the paged decode kernel (impl="pallas": reads pages in place) or the gather, the
    chunk rows through
      prefill="paged" (or "auto" with impl="pallas", where its tiles fit the shape): the paged
        prompt kernel, reading each row's pages in place up to its last real query;
      "flash": the flash kernel over a window of the table's full width, gathered per token (its
        cost follows max_len, not the context: a 16-token cached tail in an 8k engine attends
        over 8k positions);
      "xla": the gather and dense causal attention over their sequence's pages (fp32 scores
        [k, h, c, s] in HBM).
    """
    n_dec, k_rows = dec_table.shape[0], pre_table.shape[0]

    def attend(layer, q, k, v, cache):
        t, h, d = q.shape[1:]
        new = {name: constrain(cache[name].at[layer, write_page, write_off].set(to_cache(x[0], cache[name].dtype),
                                                                               mode="drop"), PAGED_NAMES)
               for name, x in (("k", k), ("v", v))}
        outs = []
        if n_dec:
            qd = q[0, :n_dec]                                                             # [n_dec, h, d]
            if impl in ("pallas", "pallas_unfused"):
                from pallas_kernels.paged_attention import paged_attention
                from pallas_kernels.paged_tiles import decode_block_sizes
                outs.append(paged_attention(qd, new["k"], new["v"], dec_table, dec_len, layer, interpret=interpret,
                                            block_sizes=decode_block_sizes(n_dec, fused=False)))
            else:
                outs.append(gathered_attention(qd[:, None], new, layer, dec_table, (dec_len - 1)[:, None])[:, 0])
        if k_rows:
            chunk = (t - n_dec) // k_rows
            qp = q[0, n_dec:].reshape(k_rows, chunk, h, d)                                # [k, chunk, h, d]
            pos = positions[0, n_dec:].reshape(k_rows, chunk)
            how = prefill_path(prefill, impl, k_rows, chunk, q.shape[2], new["k"].shape, pre_table.shape[1])
            if how == "paged":
                from pallas_kernels.paged_prefill import paged_prefill_attention
                from pallas_kernels.paged_tiles import prefill_block_sizes
                real = jnp.sum((write_page[n_dec:] < new["k"].shape[1]).reshape(k_rows, chunk), axis=1)   # [k]
                o = paged_prefill_attention(qp, new["k"], new["v"], pre_table, pos[:, 0], pos[:, 0] + real, layer,
                                            block_sizes=prefill_block_sizes(chunk), interpret=interpret)
            elif how == "flash":
                o = windowed_flash_attention(qp, new, layer, pre_table, pos[:, 0], interpret)
            else:
                o = gathered_attention(qp, new, layer, pre_table, pos)
            outs.append(o.reshape(k_rows * chunk, h, d))
        return jnp.concatenate(outs)[None], new                                           # [1, T, h, d]
    return Attend(attend)


def prefill_path(prefill: str, impl: str, rows: int, chunk: int, heads: int, cache_shape, max_pages: int) -> str:
    """The chunk rows' attention (packed_attend): "paged" | "flash" | "xla"."""
    if prefill != "auto":
        return prefill
    if impl not in ("pallas", "pallas_unfused"):
        return "xla"
    from pallas_kernels.paged_prefill import prefill_plan
    from pallas_kernels.paged_tiles import prefill_block_sizes
    _, _, page_size, kvh, d = cache_shape
    try:
        prefill_plan(prefill_block_sizes(chunk), rows, chunk, kvh, max_pages, page_size, heads // kvh, d)
        return "paged"
    except ValueError:                        # the GPU tiles cannot take this group / chunk: the window
        return "flash"


def span_attention(q, cache, layer, page_table, start, count, interpret: bool = False):
    """q [b, t, h, d], row i's queries at positions start[i] + j, the first count[i] real, through the
    paged prompt kernel (pages read in place up to the row's last real query), or None where its GPU
    tiles cannot take the shape. t is padded up to a power of two that the kernel's query tiles take
    (a GQA group of 4 and t = 5: 8), so a speculative step's k + 1 tokens need no program of their own;
    the padding queries attend to nothing and come back as zeros, sliced off."""
    from pallas_kernels.paged_prefill import paged_prefill_attention, prefill_plan
    from pallas_kernels.paged_tiles import pow2_at_least, prefill_block_sizes
    b, t, h, d = q.shape
    page_size, kvh = cache["k"].shape[2:4]
    for width in (pow2_at_least(t) << i for i in range(4)):
        try:
            prefill_plan(prefill_block_sizes(width), b, width, kvh, page_table.shape[1], page_size, h // kvh, d)
        except ValueError:
            continue
        qp = jnp.pad(q, ((0, 0), (0, width - t), (0, 0), (0, 0)))                     # [b, width, h, d]
        o = paged_prefill_attention(qp, cache["k"], cache["v"], page_table, start, start + count, layer,
                                    block_sizes=prefill_block_sizes(width), interpret=interpret)
        return o[:, :t]                                                                # [b, t, h, d]
    return None


def paged_attend(positions, valid, page_table, impl: str = "xla", interpret: bool = False, cached=None,
                 spans: bool = False):
    """The Attend of the paged layout; page_table [b, max_pages] int32 (unused entries may be any page).

    cached [b, t] bool or None: tokens whose K/V already lie in a shared prefix page (a fully cached
    prompt's last token, fed again for its logits): attended from there and not written, so the
    page stays exactly as every other request reads it (recomputed K/V of the same token may differ
    in the last bits). The fused kernel takes the same flag per row.

    impl="xla" gathers the sequence's pages and runs dense attention (any t); impl="pallas" uses
    the paged decode kernel for t == 1 (reads pages in place through the table, no gather). With
    impl="pallas" the Attend also offers `fused(layer, qkv, inv_freq, cache)` for t == 1: the
    projections before RoPE in, RoPE + cache write + attention in one kernel
    (pallas_kernels.paged_attention.paged_decode_attention); the model uses it when it has them
    concatenated (serving layers="fused"). impl="pallas_unfused": the kernel without that fusion
    (XLA's RoPE and scatter around it), kept for the benchmark's A/B.

    spans=True: each row's t tokens sit at consecutive positions from positions[:, 0], its valid ones
    first (a speculative step: the row's token, then its drafts). With impl="pallas" and t > 1 they
    attend through the paged prompt kernel (`span_attention`), which reads the row's pages up to its
    last valid token, where the gather would copy the table's full width (max_len, not the context)
    for every layer.
    """
    def lengths():
        return jnp.where(valid[:, 0], positions[:, 0] + 1, 0)

    def attend(layer, q, k, v, cache):
        num_pages, page_size = cache["k"].shape[1:3]
        logical_page = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
        page = jnp.take_along_axis(page_table, logical_page, axis=1)                  # [b, t]
        write = valid if cached is None else valid & ~cached
        page = jnp.where(write, page, num_pages)                                     # padding -> dropped
        offset = positions % page_size
        new = {name: constrain(cache[name].at[layer, page, offset].set(to_cache(x, cache[name].dtype), mode="drop"),
                               PAGED_NAMES)
               for name, x in (("k", k), ("v", v))}
        if impl in ("pallas", "pallas_unfused") and q.shape[1] == 1:
            from pallas_kernels.paged_attention import paged_attention
            from pallas_kernels.paged_tiles import decode_block_sizes
            o = paged_attention(q[:, 0], new["k"], new["v"], page_table, lengths(), layer,   # layer read in place
                                block_sizes=decode_block_sizes(q.shape[0], fused=False), interpret=interpret)
            return o[:, None], new
        if spans and impl in ("pallas", "pallas_unfused"):
            o = span_attention(q, new, layer, page_table, positions[:, 0], jnp.sum(valid, axis=1), interpret)
            if o is not None:
                return o, new
        return gathered_attention(q, new, layer, page_table, positions), new

    def fused(layer, qkv, inv_freq, cache):
        """qkv [b, t, h + 2 kvh, d] before RoPE -> (o [b, t, h, d], cache). t == 1, or t == 2 at b == 1:
        the second row is the zero padding of the model's one-token GEMM, passed through the kernel
        (read as nothing, returned as zeros) so that neither a slice nor a pad runs around it."""
        from pallas_kernels import paged_tiles
        from pallas_kernels.paged_attention import paged_decode_attention, rope_cos_sin
        b, t, heads, d = qkv.shape
        n_heads = heads - 2 * cache["k"].shape[3]
        o, k, v = paged_decode_attention(qkv.reshape(b * t, heads, d), rope_cos_sin(positions[:, 0], inv_freq),
                                         cache["k"], cache["v"], page_table, lengths(), layer,
                                         None if cached is None else cached[:, 0], n_heads=n_heads,
                                         block_sizes=paged_tiles.decode_block_sizes(b), interpret=interpret)
        return o.reshape(b, t, n_heads, d), {"k": constrain(k, PAGED_NAMES), "v": constrain(v, PAGED_NAMES)}

    # Batch <= 16 only: the fused kernel loads K in two d/2-wide column halves (rotate-half without a
    # concatenate), fine while decode is latency-bound but slower once it is bandwidth-bound. H200,
    # llama3_1b, ctx 2048 (docs/benchmarks.md#decode-and-serving): b=1 921 vs 873 tokens/s; b=16 10,329
    # vs 10,147; b=32 12,560 vs 15,730; b=64 15,787 vs 21,595 (fused vs unfused).
    small = positions.shape[0] <= FUSED_MAX_BATCH
    return Attend(attend, fused if impl == "pallas" and positions.shape[1] == 1 and small else None, live=valid[:, 0])
