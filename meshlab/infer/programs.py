"""The compiled serving programs and the weights they take.

Serving weights (`serving_params`, once at load): matrices in the compute dtype (a training
checkpoint's fp32 masters would otherwise be cast inside every step: 4 bytes read + 2 written + 2
read per weight per token), and with layers="split" the stacked [n_layers, ...] weights become
one buffer per layer, run by a Python loop over the layers. A decode step at small batch reads
every weight once and is limited by HBM bandwidth; XLA copies a slice of a stacked weight into a
temporary before the GEMM (the layer scan's dynamic slice, and the unrolled scan's static slice
alike), tripling those bytes. layers="fused" also concatenates wq|wk|wv and w_gate|w_up per
layer (two GEMM launches instead of five; XLA's own dot merger would concatenate them at run
time); it assumes those weights are not tensor-sharded. layers="kernels" stores each layer's
matrices [n, k] instead (a mixture of experts' experts too; models/serving.py nk_step reads them
transposed); its decode tokens (one row, Pallas attention) run each layer as five Pallas launches
(decode_step; a mixture of experts: six, and its experts through the same expert kernels up to four
rows). layers="scan" | "unroll" keep the stacked params.

Programs:
  make_programs          (step, decode_loop) over a fixed batch [b, t] (the contiguous generator
                         and the decode microbenchmark): prefill chunks and decode share one shape
                         per t; decode_loop runs n steps in one call (a lax.scan, sampling on device).
  make_engine_programs   (packed_step, decode_loop) for the continuous-batching engine:
    packed_step  one stream of T tokens: n_dec decode tokens, then k prompt-chunk rows of `chunk`
                 tokens (kv_cache.packed_attend), so the GEMMs see only real rows (a [max_seqs,
                 chunk] grid would run every row at chunk width whenever any row prefills); the LM
                 head and sampler run on the last token of each row only (with `score`, the
                 head also over every chunk-row token, for prompt logprobs).
    decode_loop  n decode steps over the compacted decode rows [b] (b a bucket, rows padded),
                 each row fed while its position is below its own limit (rows that end mid-call
                 stop writing; their extra samples are dropped on the host).
    head_step    the LM head and sampler alone over hidden states kept in the cache (see HIDDEN).
  All take static `greedy` (no row samples or penalises: argmax only, the seen-token mask
  untouched), `logprobs`: None (off), 0 (the chosen token's log-softmax) or TOP_LOGPROBS
  (also the TOP_LOGPROBS best, one top-k pass over the vocabulary), and `cut` (some row sets
  top_k or top_p: the draw finds those thresholds; sampler.filtered).
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from meshlab.infer import kv_cache
from meshlab.infer.sampler import CUT_TOP_K, count_sampled, sample
from meshlab.rules import use_rules
from pallas_kernels.decode_gemv import quantize_rows
from models import serving

TOP_LOGPROBS = 20       # the most alternatives a request may ask for (OpenAI's limit)
# The cache entry [num_pages, d] holding, per page, the final-normed hidden state of its last token
# when a packed step computed that token (Engine reuse_hidden): a prompt met before up to its last
# page then samples its first token from it with the LM head alone (head_step) instead of feeding
# its last token again through every layer. Decode steps leave it alone (their page ends are not
# recorded: the engine's Scheduler.hidden_ok says which pages hold a valid one).
HIDDEN = "h"
# The cache entry [max_seqs] int32 holding each slot's last sampled token, written by every packed
# step and decode call. The engine plans and dispatches a step before reading the one before back
# (Engine overlap_steps): a row whose token is still on the device is fed from here (from_last)
# instead of from the host.
LAST = "last"
# The cache entry [max_seqs, V] int32 counting, per slot, the tokens its request generated (the
# presence and frequency penalties): every program that samples without the greedy promise adds its
# kept samples; the engine sets a slot's row when a request with those penalties is admitted.
COUNTS = "counts"
# The cache entry [max_seqs, 3, BIAS_WIDTH] int32 of each slot's logit_bias and min_tokens' held stop
# tokens (sampler.bias_row: ids, the biases' float32 bits, the counter each holds until), set by the
# engine at admission; read by the programs that sample without the greedy promise.
BIAS = "bias"
# The cache entry [max_seqs, ceil(V / 32)] int32: each slot's allowed-token bitmask (all bits set: free),
# set by the engine before each step of a request held to a grammar (meshlab.infer.guided); read by
# the programs that sample without the greedy promise.
MASK = "mask"
# With speculative calls on: each slot's tokens [max_seqs, max_len], next position and output count after
# the last speculative call, which a call chained behind it starts from (meshlab.infer.speculative).
SPEC = "spec"
OWN = (HIDDEN, LAST, COUNTS, BIAS, MASK, SPEC)    # the engine's entries of the cache dict, beside K and V


def add_own_entries(cache: dict, md, max_seqs: int, max_len: int, *, free_bias, mask_width: int,
                    reuse_hidden: bool, speculative: bool) -> dict:
    """cache (kv_cache.init_paged's) with the engine's OWN entries added, each as a fresh request
    leaves it: no token, no counts, free_bias (sampler.bias_row of the defaults, [3, BIAS_WIDTH]) in
    every slot, every token allowed; HIDDEN with reuse_hidden, SPEC with speculative calls."""
    if reuse_hidden:
        cache[HIDDEN] = jnp.zeros((cache["k"].shape[1], md.cfg.d_model), md.cfg.dtype)
    cache[LAST] = jnp.zeros((max_seqs,), jnp.int32)
    cache[COUNTS] = jnp.zeros((max_seqs, md.cfg.vocab_size), jnp.int32)
    cache[BIAS] = jnp.broadcast_to(jnp.asarray(free_bias), (max_seqs, *free_bias.shape))
    cache[MASK] = jnp.full((max_seqs, mask_width), -1, jnp.int32)
    if speculative:
        cache[SPEC] = {"history": jnp.zeros((max_seqs, max_len), jnp.int32),
                       "pos": jnp.zeros((max_seqs,), jnp.int32), "count": jnp.zeros((max_seqs,), jnp.int32)}
    return cache


LAYER_MODES = ("split", "fused", "kernels", "scan", "unroll")
CONCATENATED = ("fused", "kernels")     # modes whose layers are pairs (params, their projections rearranged: _fuse)
FUSED = {("attn", "wqkv"): ("wq", "wk", "wv"), ("mlp", "w_gate_up"): ("w_gate", "w_up")}   # concat axis 1


def default_impl(mesh=None, interpret: bool = False) -> str:
    """Engine(impl="auto"): the Pallas paged kernel on one GPU (862 vs 720 tokens/s at batch 1 and
    21.5k vs 12.2k at batch 64 on the H200, docs/benchmarks.md). A custom call does not shard, and
    on CPU it would run interpreted: XLA's gather there."""
    one_device = mesh is None or mesh.size == 1
    return "pallas" if jax.default_backend() == "gpu" and one_device and not interpret else "xla"


def check_quantize(md, quantize: str | None, mesh=None) -> None:
    """quantize="fp8" serves a dense model on one device with fp8 tensor cores (Engine's and
    ContiguousGenerator's argument; serving_params checks the value and the layers)."""
    if not quantize:
        return
    if (mesh is not None and mesh.size > 1) or "mlp" not in md.abstract["layers"]:
        raise ValueError(f"quantize={quantize!r} serves a dense model on one device (layers='kernels'); "
                         "leave it out for a mixture of experts or a mesh of several devices")
    check_fp8_devices(jax.devices())


def check_fp8_devices(devices) -> None:
    """quantize="fp8" needs fp8 tensor cores on a GPU: compute capability 8.9+ (Ada, Hopper). Below it
    neither the decode kernels' fp8 loads (Triton) nor cuBLASLt's FP8 GEMMs exist; a CPU emulates them."""
    old = [d for d in devices if d.platform == "gpu" and float(getattr(d, "compute_capability", 0) or 0) < 8.9]
    if old:
        raise ValueError(f"quantize='fp8' needs a GPU of compute capability 8.9 or more (Ada, Hopper); "
                         f"{old[0].device_kind} is {old[0].compute_capability}: serve it in bf16 (leave --quantize out)")


def default_layers(md, impl: str, mesh=None) -> str:
    """Engine(layers="auto"). With the Pallas kernels on one device: kernels, a one-row decode layer
    as five Pallas launches over [n, k] matrices (1,114-1,128 vs 1,010 tokens/s at batch
    1, level at 16 and 64; H200, docs/benchmarks.md); a mixture of experts too (moe_1b_8e at batch 1:
    856 against 433 tokens/s split on an H100). Else fused: one q|k|v GEMM and, with the Pallas
    kernel at batch <= 16, RoPE + cache write inside the attention kernel; a mixture of experts
    split (fused: 9% slower). Both concatenate weights, so a tensor-sharded mesh keeps split."""
    if mesh is not None and mesh.size > 1:
        return "split"
    if impl == "pallas":
        return "kernels"
    return "fused" if "mlp" in md.abstract["layers"] else "split"


def check_layers(md, layers: str, mesh=None) -> None:
    """A mixture of experts' kernels layers run outside the rule file's expert dispatch: one device only."""
    if layers == "kernels" and "mlp" not in md.abstract["layers"] and mesh is not None and mesh.size > 1:
        raise ValueError(f"layers='kernels' serves a mixture of experts on one device; on this mesh of {mesh.size} "
                         "devices use layers='split' (or 'auto')")


# The engine's activations are one packed stream ([1, T, d]) or a decode bucket ([b, 1, d], b from 1):
# a rule file's batch or sequence split (fsdp_tp's act_batch over fsdp) cannot divide them, and one
# engine serves its rows together (replicas, not this, are data parallelism). They stay whole; the
# weights and the cache keep the rule file's placement.
WHOLE_IN_ENGINE = ("act_batch", "act_seq", "act_attn_seq")


def engine_rules(rules, names=WHOLE_IN_ENGINE, md=None, mesh=None):
    """The rule file as the engine's programs run under it: `names` replicated. With the rows whole,
    expert parallelism has no rows to exchange (a rank holds every row): for a mixture of experts (md),
    a file that splits `experts` over an axis of `mesh` is refused."""
    if rules is None:
        return None
    moe = md is not None and "mlp" not in md.abstract["layers"]
    experts = rules.axes("experts", mesh) if moe and mesh is not None and "experts" in rules.rules else ()
    if experts:
        raise ValueError(f"{rules.path}: serving keeps the batch whole on every device, so the experts cannot be "
                         f"split over {list(experts)} (expert parallelism exchanges rows between ranks); serve "
                         "with a rule file whose `experts:` is null (tp, fsdp_tp) or on one device")
    return dataclasses.replace(rules, rules={**rules.rules, **{name: () for name in names}})


def placement(rules, mesh):
    """The context programs run in: the rule file's constraints when given, else nothing."""
    return use_rules(rules, mesh) if rules is not None and mesh is not None else contextlib.nullcontext()


def _fuse(layer: dict, decode: bool = False, quantize: str | None = None):
    """(params without the fused projections, {"wqkv", "w_gate_up"}) of one layer. decode: instead
    ({"decode": ...}, the layer's matrices stored [n, k], each output's weights contiguous, for
    pallas_kernels/decode_gemv.py; the prompt path reads them transposed): wqkv_t [(h + 2 kvh) hd, d],
    wo_t [d, h hd], w_gate_up_t [2, f, d], w_down_t [d, f]; wo and w_down leave the params too (a
    mixture of experts: its experts' matrices as _experts_nk lays them out, in place of its own).
    quantize="fp8": each of the four float8_e4m3fn, with its per-row fp32 scale beside it as
    `<name>_scale` (decode_gemv.quantize_rows)."""
    here = {(mod, new): olds for (mod, new), olds in FUSED.items() if mod in layer}   # a mixture of experts: no mlp
    drop = {mod: olds for (mod, _), olds in here.items()}
    if decode:
        drop = {**drop, "attn": drop["attn"] + ("wo",),
                **({"mlp": drop["mlp"] + ("w_down",)} if "mlp" in drop else {"moe": ("w_gate", "w_up", "w_down", "shared")})}
    rest = {k: ({n: w for n, w in v.items() if n not in drop.get(k, ())} if isinstance(v, dict) else v)
            for k, v in layer.items()}
    fused = {new: jnp.concatenate([layer[mod][n] for n in olds], axis=1) for (mod, new), olds in here.items()}
    if not decode:
        return rest, fused
    d = layer["attn"]["wo"].shape[-1]
    nk = {"wqkv_t": fused["wqkv"].reshape(d, -1).T,                                              # [(h+2kvh) hd, d]
          "wo_t": layer["attn"]["wo"].reshape(-1, d).T}                                          # [d, h hd]
    nk.update(_mlp_nk(layer["mlp"]) if "mlp" in layer else _experts_nk(layer["moe"]))
    if quantize == "fp8":
        nk = {key: v for name, w in nk.items() for key, v in zip((name, name + "_scale"), quantize_rows(w))}
    return rest, {"decode": nk}


def _mlp_nk(mlp: dict, prefix: str = "") -> dict:
    """A SwiGLU MLP's matrices stored [n, k]: w_gate_up_t [2, f, d], w_down_t [d, f]."""
    return {prefix + "w_gate_up_t": jnp.stack([mlp["w_gate"].T, mlp["w_up"].T]), prefix + "w_down_t": mlp["w_down"].T}


def _experts_nk(moe: dict) -> dict:
    """A mixture of experts' matrices stored [n, k] (pallas_kernels/expert_gemv.py; models/serving.py
    experts_ffn reads them transposed): experts_gate_up_t [E, 2, f, d], experts_down_t [E, d, f], a
    shared expert's as `shared_` + _mlp_nk's."""
    nk = {"experts_gate_up_t": jnp.stack([jnp.swapaxes(moe["w_gate"], 1, 2), jnp.swapaxes(moe["w_up"], 1, 2)], axis=1),
          "experts_down_t": jnp.swapaxes(moe["w_down"], 1, 2)}
    return {**nk, **(_mlp_nk(moe["shared"], "shared_") if "shared" in moe else {})}


def weights_summary(params) -> str:
    """Serving params in one line, as a server states them at start: their bytes, and by dtype (fp8
    matrices with their fp32 scales beside them, the embedding in the compute dtype)."""
    by_dtype = {}
    for a in jax.tree.leaves(params):
        by_dtype[str(a.dtype)] = by_dtype.get(str(a.dtype), 0) + a.size * a.dtype.itemsize
    size = lambda b: f"{b / 2 ** 30:.2f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"   # noqa: E731
    parts = ", ".join(f"{size(b)} {name}" for name, b in sorted(by_dtype.items(), key=lambda kv: -kv[1]))
    return f"weights: {size(sum(by_dtype.values()))} ({parts})"


def _unfused_placeholders(md, rest: dict) -> dict:
    """Fill the fused-away leaves with abstract values: nnx.merge needs every parameter, none is read."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), md.abstract["layers"])
    return {k: ({**abstract[k], **v} if isinstance(v, dict) else v) for k, v in rest.items()}


def serving_params(md, params, layers: str = "split", quantize: str | None = None):
    """Params as the programs of `make_programs(..., layers=layers)` take them (see the module doc).

    Matrices (ndim >= 2) are cast to the compute dtype, which the model would do per step anyway:
    the tokens are the same. 1-D leaves (norm scales, read in fp32) stay as stored. Under a rule
    file, each slice keeps its weight's sharding (propagated from the stacked array). The caller
    may drop its own `params` afterwards: split weights are new buffers. quantize="fp8" (layers
    "kernels" only): the layers' matrices in fp8 with a scale per output row, from the weights in the
    compute dtype; the embedding (and the tied LM head) stays in the compute dtype.
    """
    if layers not in LAYER_MODES:
        raise ValueError(f"layers={layers!r} must be one of {LAYER_MODES}")
    if quantize not in (None, "fp8") or (quantize and layers != "kernels"):
        raise ValueError(f"quantize={quantize!r} must be None or 'fp8', and fp8 needs layers='kernels' "
                         f"(got layers={layers!r}): the decode kernels and the prompt GEMMs read its [n, k] matrices")
    dt = jnp.dtype(md.cfg.dtype)
    cast = lambda a: a.astype(dt) if a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating) else a

    def prepare(p):
        p = jax.tree.map(cast, p)
        if layers in ("split",) + CONCATENATED:
            p = dict(p, layers=[jax.tree.map(lambda a: a[i], p["layers"]) for i in range(md.cfg.n_layers)])
        if layers in CONCATENATED:
            p["layers"] = [_fuse(one, decode=layers == "kernels", quantize=quantize) for one in p["layers"]]
        return p
    return jax.jit(prepare)(params)


def _bind(md, params, layers: str):
    """(model, per-layer params or None) for params from serving_params(md, ., layers)."""
    if layers in ("split",) + CONCATENATED:   # the stacked layers are only a structure here: bind abstract ones
        model, per_layer = md.bind(dict(params, layers=md.abstract["layers"])), params["layers"]
        if layers in CONCATENATED:
            per_layer = [(_unfused_placeholders(md, rest), fused) for rest, fused in per_layer]
        return model, per_layer
    return md.bind(params), None


def _step_fn(md, layout: str, impl: str = "xla", interpret: bool = False, layers: str = "split"):
    """The un-jitted step: (params, cache, seen, tokens, positions, valid, last, table, rows, counters,
    greedy) -> (next token [b], cache, seen). `seen` marks every fed token for the repetition penalty;
    params come from `serving_params(md, ., layers)`."""
    vocab = md.cfg.vocab_size

    def step(params, cache, seen, tokens, positions, valid, last, table, rows, counters, greedy=None):
        model, per_layer = _bind(md, params, layers)
        if layout == "contiguous":
            attend = kv_cache.contiguous_attend(positions, valid)
        else:
            attend = kv_cache.paged_attend(positions, valid, table, impl, interpret)
        h, cache = serving.forward(model, tokens, positions, cache, attend, unroll=layers == "unroll",
                                   layers=per_layer, kernels=layers == "kernels")   # [b, t, d]
        h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)               # [b, 1, d]
        logits = model.logits(h_last)[:, 0, :vocab]                                 # [b, V]
        b = tokens.shape[0]
        seen = seen.at[jnp.arange(b)[:, None], jnp.where(valid, tokens, vocab)].set(True, mode="drop")
        return sample(logits, rows, counters, seen, greedy), cache, seen
    return step


def make_programs(md, layout: str, impl: str = "xla", interpret: bool = False, layers: str = "split"):
    """(step, decode_loop) jitted, cache and seen donated (updated in place). Both take a static
    `greedy=all_greedy(rows)` (None: decide on device)."""
    step = _step_fn(md, layout, impl, interpret, layers)

    def decode_loop(params, cache, seen, tok, pos, active, table, rows, counters, n, greedy=None):
        def body(carry, _):
            cache, seen, tok, pos, counters = carry
            nxt, cache, seen = step(params, cache, seen, tok[:, None], pos[:, None], active[:, None],
                                    jnp.zeros_like(pos), table, rows, counters, greedy)
            return (cache, seen, nxt, pos + 1, counters + 1), nxt
        (cache, seen, *_), toks = jax.lax.scan(body, (cache, seen, tok, pos, counters), None, length=n)
        return toks, cache, seen                                                    # toks [n, b]

    return (jax.jit(step, donate_argnums=(1, 2), static_argnames=("greedy",)),
            jax.jit(decode_loop, donate_argnums=(1, 2), static_argnames=("n", "greedy")))


def _head(model, h, vocab, rows, counters, seen_rows, greedy, logprobs, own=None, slots=None,
          cut=CUT_TOP_K):
    """h [R, d] last hidden states -> {"tokens" [R], and with logprobs: "logprob" [R], "top_logprob",
    "top_id" [R, TOP_LOGPROBS]} (log-softmax of the raw logits: what the model says, before
    temperature and the filters). own: the cache's engine entries, whose COUNTS, logit-bias and MASK
    rows at `slots` [R] the sampler reads (not greedy)."""
    logits = model.logits(h[:, None])[:, 0, :vocab]                                 # [R, V] fp32
    counts = bias = allowed = None
    if not greedy and own:
        pick = lambda name: own[name][jnp.minimum(slots, own[name].shape[0] - 1)]   # noqa: E731 - [R, ...]
        counts = pick(COUNTS) if COUNTS in own else None
        bias = pick(BIAS) if BIAS in own else None                                   # [R, 3, BIAS_WIDTH]
        allowed = pick(MASK) if MASK in own else None                               # [R, V / 32]
    tok = sample(logits, rows, counters, seen_rows, greedy, counts, bias, allowed, cut)
    out = {"tokens": tok}
    if logprobs is not None:
        out["logprob"], out["top_logprob"], out["top_id"] = _logprobs(logits, tok, logprobs and TOP_LOGPROBS)
    return out


def _logprobs(logits, ids, top: int):
    """(log-softmax of logits [R, V] at ids [R], and the top best [R, top] (logprobs, ids)): no top-k
    pass when top == 0 (only the given tokens' logprobs were asked)."""
    lp = jax.nn.log_softmax(logits, axis=-1)                                        # [R, V] fp32
    at = jnp.take_along_axis(lp, ids[:, None], axis=1)[:, 0]                         # [R]
    if top:
        return at, *jax.lax.top_k(lp, min(top, lp.shape[-1]))                         # [R, top] x2
    return at, lp[:, :0], ids[:, None][:, :0]


def _prompt_scores(model, h, targets, k: int, vocab: int, top: int, ranks: bool = False) -> dict:
    """The prompt logprobs of a packed step's k chunk rows: h [k c, d] their final-normed hidden states,
    targets [k c] the token after each (any id where none is asked) -> {"prompt_logprob" [k c],
    "prompt_top_logprob", "prompt_top_id" [k c, min(top, V)]}, the log-softmax of the raw logits as
    _head reports it; with ranks also "prompt_rank" [k c], the target's rank (1 + the tokens more
    likely: vLLM's), one more pass over the vocabulary. One row at a time (lax.map): the fp32 logits
    are [c, V] at once (263 MB at c = 512 for llama3's vocabulary), not [k c, V]."""
    d = h.shape[-1]

    def row(args):
        h_row, t_row = args                                                             # [c, d], [c]
        logits = model.logits(h_row[None])[0, :, :vocab]                                # [c, V]
        lp, top_lp, top_id = _logprobs(logits, t_row, top)                              # [c], [c, top] x2
        if not ranks:
            return lp, top_lp, top_id
        # a compare-and-count pass over the row's log-softmax (XLA shares the log-softmax with _logprobs')
        return lp, top_lp, top_id, 1 + jnp.sum(jax.nn.log_softmax(logits, axis=-1) > lp[:, None], axis=-1,
                                               dtype=jnp.int32)                         # ..., [c]
    lp, top_lp, top_id, *rank = jax.lax.map(row, (h.reshape(k, -1, d), targets.reshape(k, -1)))   # [k, c, ...]
    out = {"prompt_logprob": lp.reshape(-1), "prompt_top_logprob": top_lp.reshape(lp.size, -1),
           "prompt_top_id": top_id.reshape(lp.size, -1)}
    return dict(out, prompt_rank=rank[0].reshape(-1)) if ranks else out


def _mark(seen, slots, tokens, valid):
    """seen[slot, token] = True for each valid fed token (slots [n], tokens [n])."""
    return seen.at[jnp.where(valid, slots, seen.shape[0]), tokens].set(True, mode="drop")


def _split_own(cache: dict):
    """(the K/V cache, the engine's own entries OWN present in it): the layers see only K and V."""
    return {k: v for k, v in cache.items() if k not in OWN}, {k: cache[k] for k in OWN if k in cache}


def _count(own: dict, greedy, slots, tokens) -> None:
    """own[COUNTS] with the samples of the rows naming a slot (< max_seqs) added (programs without
    the greedy promise, when the entry is present)."""
    if not greedy and COUNTS in own:
        own[COUNTS] = count_sampled(own[COUNTS], slots, tokens, slots < own[COUNTS].shape[0])


def page_end_rows(positions, write_page, page_size: int, num_pages: int, xp=jnp):
    """Per token, the page whose kept hidden state it sets: its write page when it is the last token of
    that page, else num_pages (none; padding's write page is num_pages already). One rule for the
    packed step's write (jnp) and the engine's record of which pages hold one (numpy)."""
    return xp.where(positions % page_size == page_size - 1, write_page, num_pages)


def _keep_page_ends(own: dict, page_size: int, h, positions, write_page) -> None:
    """own[HIDDEN] (when present) with its rows set to h [T, d] at the tokens that end a page."""
    if HIDDEN in own:
        rows = page_end_rows(positions, write_page, page_size, own[HIDDEN].shape[0])        # [T]
        own[HIDDEN] = own[HIDDEN].at[rows].set(h.astype(own[HIDDEN].dtype), mode="drop")


def _fed_from_last(tok, from_last, last):
    """tok [b] with each row whose from_last names a slot (< max_seqs) fed that slot's LAST token
    instead: a token a call before sampled that the host has not read back yet."""
    dev = last[jnp.minimum(from_last, last.shape[0] - 1)]                              # [b]
    return jnp.where(from_last < last.shape[0], dev, tok)


def head_params(params: dict) -> dict:
    """The serving params head_step takes: all but the layers (embedding, final norm, LM head)."""
    return {k: v for k, v in params.items() if k != "layers"}


def make_head_program(md):
    """head_step(params, cache, seen, pages, slots, rows, counters, greedy, logprobs), jitted, cache and
    seen donated (returned as they came): the sampled outputs of the hidden states cache[HIDDEN][pages]
    (rows [b]); params from head_params (a call passes a few leaves, not every layer's)."""
    vocab = md.cfg.vocab_size

    def head_step(params, cache, seen, pages, slots, rows, counters, greedy, logprobs, cut=CUT_TOP_K):
        model = md.bind(dict(params, layers=md.abstract["layers"]))
        h = cache[HIDDEN][pages]                                                      # [b, d]
        out = _head(model, h, vocab, rows, counters, None if greedy else seen[slots], greedy, logprobs, cache, slots,
                    cut)
        cache = dict(cache)
        _count(cache, greedy, slots, out["tokens"])
        return out, cache, seen
    return head_step


def make_engine_programs(md, impl: str = "xla", interpret: bool = False, layers: str = "split",
                         prefill: str = "auto"):
    """(packed_step, decode_loop) of the continuous-batching engine, jitted, cache and seen donated.

    packed_step(params, cache, seen, p, rows, counters, out_slot, greedy, logprobs, score=None): p holds the
      packed stream (tokens, positions, slot [T]; write_page, write_off [T]: write_page = num_pages
      marks padding, write_off = page_size a real token whose K/V are already cached (not written);
      dec_table, dec_len, pre_table; out_idx [R]: the token whose hidden state each output row
      samples from; from_last [n_dec]: a slot whose LAST entry replaces the decode row's token, or
      max_seqs; last_slot [R]: the slot whose LAST entry takes the row's sampled token, or max_seqs);
      rows/counters/out_slot describe the R = n_dec + k output rows. score (static): None, or the
      chunk rows' prompt logprobs are computed too (_prompt_scores: at p["targets"] [k chunk], the
      token after each position, and their `score` best; with ranks, each target's rank).
    decode_loop(params, cache, seen, tok, pos, limit, table, slots, rows, counters, n, greedy,
      logprobs, keep=None): rows [b] at positions pos, each fed while pos < limit; returns outputs
      [n, b]. keep [b]: positions below it lie in shared prefix pages (a fully cached prompt's
      last token): attended from there, not written (kv_cache.paged_attend's cached). from_last [b]: a
      slot whose LAST entry replaces the row's token, or max_seqs; the last samples go to LAST[slots]
      (what a chained call, dispatched before this one is read back, feeds its rows).
    seen [max_seqs, V] bool: tokens fed per slot (the repetition penalty); read and written only
    when greedy is False. prefill: the chunk rows' attention (kv_cache.packed_attend). With a HIDDEN
    entry in the cache, packed_step keeps the hidden state of every token that ends a page there.
    The cache's LAST entry (required) holds each slot's last sample: both programs feed the rows
    named by from_last from it and record there the samples of the rows named by last_slot / slots.
    """
    vocab = md.cfg.vocab_size
    unroll, kernels = layers == "unroll", layers == "kernels"

    def packed_step(params, cache, seen, p, rows, counters, out_slot, greedy, logprobs, score=None,
                    cut=CUT_TOP_K, ranks=False):
        model, per_layer = _bind(md, params, layers)
        cache, own = _split_own(cache)
        nd = p["from_last"].shape[0]
        tokens = p["tokens"].at[:nd].set(_fed_from_last(p["tokens"][:nd], p["from_last"], own[LAST]))   # [T]
        attend = kv_cache.packed_attend(p["positions"][None], p["write_page"], p["write_off"], p["dec_table"],
                                        p["dec_len"], p["pre_table"], impl, interpret, prefill)
        h, cache = serving.forward(model, tokens[None], p["positions"][None], cache, attend, unroll=unroll,
                                   layers=per_layer)                                  # [1, T, d]
        _keep_page_ends(own, cache["k"].shape[2], h[0], p["positions"], p["write_page"])
        if not greedy:
            seen = _mark(seen, p["slot"], tokens, p["slot"] < seen.shape[0])
        seen_rows = None if greedy else seen[out_slot]
        out = _head(model, h[0, p["out_idx"]], vocab, rows, counters, seen_rows, greedy, logprobs, own, out_slot, cut)
        _count(own, greedy, p["last_slot"], out["tokens"])
        own[LAST] = own[LAST].at[p["last_slot"]].set(out["tokens"], mode="drop")
        if score is not None:
            out.update(_prompt_scores(model, h[0, nd:], p["targets"], p["pre_table"].shape[0], vocab, score, ranks))
        return out, dict(cache, **own), seen

    def decode_loop(params, cache, seen, tok, pos, limit, table, slots, rows, counters, n, greedy, logprobs,
                    keep=None, from_last=None, cut=CUT_TOP_K):
        model, per_layer = _bind(md, params, layers)
        cache, own = _split_own(cache)
        if from_last is not None:        # rows whose token the host has not read yet
            tok = _fed_from_last(tok, from_last, own[LAST])                            # [b]

        def body(carry, _):
            cache, seen, counts, tok, pos, counters = carry
            valid = pos < limit                                                       # [b]
            cached = None if keep is None else (pos < keep)[:, None]                  # [b, 1]
            attend = kv_cache.paged_attend(pos[:, None], valid[:, None], table, impl, interpret, cached)
            h, cache = serving.forward(model, tok[:, None], pos[:, None], cache, attend, unroll=unroll,
                                       layers=per_layer, kernels=kernels)             # [b, 1, d]
            if not greedy:
                seen = _mark(seen, slots, tok, valid)
            out = _head(model, h[:, 0], vocab, rows, counters, None if greedy else seen[slots], greedy, logprobs,
                        dict(own, **{COUNTS: counts}) if counts is not None else own, slots, cut)
            if counts is not None:
                counts = count_sampled(counts, slots, out["tokens"], valid)
            return (cache, seen, counts, out["tokens"], pos + 1, counters + 1), out
        counts = None if greedy else own.get(COUNTS)
        (cache, seen, counts, last, *_), outs = jax.lax.scan(body, (cache, seen, counts, tok, pos, counters), None,
                                                             length=n)
        if counts is not None:
            own[COUNTS] = counts
        # each row's last sample, for a step dispatched before this one is read back
        own[LAST] = own[LAST].at[slots].set(last, mode="drop")
        return outs, dict(cache, **own), seen                                                      # outs: [n, b, ...]

    return (jax.jit(packed_step, donate_argnums=(1, 2), static_argnames=("greedy", "logprobs", "score", "cut", "ranks")),
            jax.jit(decode_loop, donate_argnums=(1, 2), static_argnames=("n", "greedy", "logprobs", "cut")))
