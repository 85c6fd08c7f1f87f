"""Memory per device: model state as meshlab stores it, activations per remat policy, KV cache.

Model state is exact: it reads the same PartitionSpecs the train step uses (`leaf_specs`), so
the bytes equal what the compiled program places. meshlab keeps fp32 params (they are the
master weights: no separate bf16 copy, the compute dtype is cast per use), an fp32 gradient
accumulator with the rule file's grads spec and Adam's mu/nu in fp32 with the optimizer spec:
4 + 4 + 8 = 16 bytes per parameter, the same total as the source material's
2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master, mu, nu), split differently by ZeRO stage.

Activations are an estimate read from the model itself: autodiff's saved residuals of a 2-layer
copy of the device-local model (heads, MLP, vocab divided by their tensor split), traced under
each remat policy of models/llama.py with a probe sequence length, then scaled to the real batch
and sequence (S and S^2 terms told apart by shape). Tracing is abstract: no compile, no
allocation, and it follows the model when its layers change (fused kernels, new norms). The
peak is taken per phase of the step (loss head, one layer's backward, optimizer update) with the
temporaries live in that phase (see `plan_memory`). tests/plan/test_memory_comm.py holds both to the
compiler's memory analysis.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from meshlab.layout import only_axes
from meshlab.mesh import entry_axes
from meshlab.plan import account, memory_context, memory_moe
from meshlab.plan.compute import is_flash

F32 = 4


@dataclasses.dataclass(frozen=True)
class Local:
    """Per-device sizes of one micro-batch's activations under a rule file and mesh."""
    b: int            # rows per device per micro-batch
    s: int            # residual-stream sequence per device (split by sequence/context parallelism)
    s_attn: int       # query sequence inside attention (split by context parallelism only)
    s_kv: int         # key sequence attention sees at once (full unless ring attention)
    h: int            # query heads per device
    kvh: int          # kv heads per device
    f: int            # MLP width per device
    v: int            # vocab columns per device (logits)
    d: int
    hd: int
    c: int            # bytes of the compute dtype
    t: int            # tensor-parallel size (activations all-reduced over it)
    sp: bool          # residual stream split over `tensor` (sequence parallelism)
    fe: int = 0       # a mixture of experts: each expert's width per device (its `mlp` split)
    fs: int = 0       # and the shared expert's (`act_mlp`, as the dense MLP)
    xp: float = 1.0   # expert dispatch buffers over the device's own assignments (dropless: the expert
                      # group's size, the exact worst case each side holds; capacity: E*C / (S*k))
    el: int = 0       # experts per device run as ragged groups (dropless); 0: dense or capacity dispatch
    ring_blocks: memory_context.RingBlocks | None = None   # ring attention's blocks (memory_context); None: no ring

    @property
    def ring(self) -> bool:
        """Ring attention: k/v shards attended in block_k tiles, never an [S, S] array."""
        return self.ring_blocks is not None


def local_sizes(cfg, rules, mesh, global_batch: int, seq: int, microbatches: int = 1) -> Local:
    dp = rules.data_parallel_size(mesh)
    b = max(global_batch // (dp * microbatches), 1)
    shards = functools.partial(account.logical_shards, rules, mesh)
    seq_split, attn_split = shards("act_seq"), shards("act_attn_seq")
    ring = rules.strategies.get("attention") == "ring"
    t = mesh.shape["tensor"]
    fe, fs, xp, el = memory_moe.expert_sizes(cfg, rules, mesh, seq)
    return Local(b=b, s=seq // seq_split, s_attn=seq // attn_split, s_kv=seq // attn_split if ring else seq,
                 h=cfg.n_heads // shards("act_heads"), kvh=max(cfg.n_kv_heads // shards("act_kv_heads"), 1),
                 f=cfg.mlp_dim // shards("act_mlp"), v=cfg.padded_vocab // shards("act_vocab"),
                 d=cfg.d_model, hd=cfg.head_dim, c=np.dtype(cfg.dtype).itemsize, t=t,
                 sp="tensor" in rules.axes("act_seq", mesh), fe=fe, fs=fs, xp=xp, el=el,
                 ring_blocks=memory_context.ring_blocks(seq // attn_split, mesh.shape["context"], cfg.head_dim) if ring else None)


# -- model state -------------------------------------------------------------------------------
def zero_stage(rules) -> int:
    st = rules.state
    return {("replicated",) * 3: 0, ("replicated", "replicated", "sharded"): 1,
            ("replicated", "sharded", "sharded"): 2}.get((st["params"], st["grads"], st["optimizer"]), 3)


def state_memory(md, rules, mesh) -> dict:
    """Exact per-device bytes of fp32 params (= master), fp32 grad accumulator, Adam mu+nu."""
    got = account.state_bytes(md, rules, mesh)
    return {"params": got["params"], "grads": got["grads"], "optimizer": got["optimizer"], "total": got["total"]}


def textbook_memory(n_params: int, stage: int, p: int) -> dict:
    """The source material's 16 B/param (bf16 params+grads, fp32 master+mu+nu) per ZeRO stage, p shards."""
    params = 2 * n_params / (p if stage >= 3 else 1)
    grads = 2 * n_params / (p if stage >= 2 else 1)
    opt = 12 * n_params / (p if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


# -- activations -------------------------------------------------------------------------------
_PROBES = (61, 67, 71, 73, 79, 83, 89, 97)


_TRACED: dict = {}


def _traced(cfg, policy: str, attention: str) -> tuple:
    key = (repr(cfg), policy, attention)
    if key not in _TRACED:
        _TRACED[key] = _trace(cfg, policy, attention)
    return _TRACED[key]


def _trace(cfg, policy: str, attention: str) -> tuple:
    """Residuals autodiff saves for `cfg` (local sizes, 2 layers), traced once with a probe sequence
    length P on one row: per array, its elements and how many of its dims are P (1: grows with S,
    2: S^2, e.g. XLA attention's [b,h,S,S] softmax). Returns (per-layer, head) lists of
    (elements per row at S=P, itemsize, P-dims), and per layer residual whether it is an expert
    dispatch buffer (a dim of P * top_k: the row's assignments). Tracing only: no compile, no allocation."""
    probe = next(p for p in _PROBES if not any(x % p == 0 for x in _model_dims(cfg)))
    layer, head = _residuals(cfg, policy, attention, probe)

    # A dim that is a multiple of P grows with S too: a mixture of experts' dispatch flattens its
    # rows' assignments to [b * S * k, ..].
    def entry(aval, per_layer):   # stacked [n_layers=2, ...]: one layer is half of it
        n = int(np.prod(aval.shape)) // (2 if per_layer else 1)
        return (n, aval.dtype.itemsize, sum(1 for x in aval.shape if x and x % probe == 0), probe)
    dispatch = tuple(probe * getattr(cfg, "top_k", 0) in a.shape for a in layer)
    return tuple(entry(a, True) for a in layer), tuple(entry(a, False) for a in head), dispatch


def _model_dims(cfg) -> set[int]:
    """Every size of the model that a residual can have besides the sequence (and the batch of 1)."""
    dims = {cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_dim, cfg.padded_vocab}
    dims |= {getattr(cfg, k) for k in ("n_experts", "top_k", "expert_mlp_dim", "shared_mlp_dim") if hasattr(cfg, k)}
    return {x for x in dims if x}


def _residuals(cfg, policy: str, attention: str, seq: int) -> tuple[list, list]:
    """(per-layer, head) avals of the residuals autodiff saves for `cfg` at 2 layers, 1 row x `seq`;
    the parameters and the batch (counted as state / input already) left out."""
    import jax
    import jax.numpy as jnp
    from models import model_def
    md = model_def(dataclasses.replace(cfg, n_layers=2, remat=policy, attention=attention))
    tok = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(params, tok):
        m = md.bind(params)
        return m.loss_sum(m.hidden(tok, tok, None), tok)
    layer, head = [], []
    for aval, why in _saved_residuals(loss, md.abstract, tok):
        if "argument" not in why:
            # The layer scan's residuals are stacked over the 2 traced layers; any other loop's
            # (a chunked loss's) are not per-layer, whatever produced them.
            per_layer = "output of scan" in why and len(aval.shape) > 0 and aval.shape[0] == 2
            (layer if per_layer else head).append(aval)
    return layer, head


_STREAM: dict = {}


def _stream_flags(cfg, policy: str, attention: str) -> tuple:
    """Per traced residual (same order as `_traced`): is it a residual-stream array, [.., S, d_model]?
    Sequence parallelism splits those over `tensor` (x, the norms' outputs, the row-parallel outputs
    after their reduce-scatter) while q/k/v, the MLP hidden and the logits keep the whole sequence.
    Read from a second trace with d_model set to a size no other dimension has, so an MLP or vocab
    shard that happens to equal d_model is not mistaken for it."""
    key = (repr(cfg), policy, attention)
    if key not in _STREAM:
        dims = {cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.mlp_dim, cfg.padded_vocab, *_PROBES}
        d = next(x for x in (101, 103, 107, 109, 113, 127, 131) if x not in dims)
        parts = _residuals(dataclasses.replace(cfg, d_model=d), policy, attention, _PROBES[-1])
        _STREAM[key] = tuple(tuple(bool(a.shape) and a.shape[-1] == d for a in part) for part in parts)
    return _STREAM[key]


def _saved_residuals(f, *args):
    """[(aval-like with .shape/.dtype, description)]: the private function where it exists, else the
    public `print_saved_residuals` parsed (lines like `f32[2,32,64] output of mul from ...`)."""
    try:
        from jax._src.ad_checkpoint import saved_residuals
        return saved_residuals(f, *args)
    except ImportError:
        return _from_printed(f, *args)


def _from_printed(f, *args):
    import contextlib
    import io
    import re
    from types import SimpleNamespace
    from jax.ad_checkpoint import print_saved_residuals
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(f, *args)
    names = {"f32": np.float32, "bf16": np.float16, "f16": np.float16, "s32": np.int32, "i32": np.int32,
             "pred": np.bool_, "bool": np.bool_, "f64": np.float64, "u32": np.uint32, "s8": np.int8, "u8": np.uint8}
    out = []
    for line in buf.getvalue().splitlines():
        m = re.match(r"\s*(\w+)\[([\d,]*)\]\s+(.*)", line)
        if m and m.group(1) in names:
            shape = tuple(int(d) for d in m.group(2).split(",") if d)
            out.append((SimpleNamespace(shape=shape, dtype=np.dtype(names[m.group(1)])), m.group(3)))
    return out


def _scale(entries, rows: int, seq: int, stream=None, stream_seq: int = 0) -> int:
    """Bytes of `entries` at `rows` x `seq`; the residual-stream ones (flags in `stream`) at `stream_seq`."""
    if stream is None:
        return int(sum(n * size * rows * (seq / p) ** k for n, size, k, p in entries))
    return int(sum(n * size * rows * ((stream_seq if st else seq) / p) ** k
                   for (n, size, k, p), st in zip(entries, stream)))


def local_config(cfg, lc: "Local"):
    """The model one device runs: heads, MLP and vocab divided by their tensor split."""
    experts = dict(expert_mlp_dim=lc.fe, shared_mlp_dim=lc.fs) if hasattr(cfg, "n_experts") else {}
    return dataclasses.replace(cfg, n_heads=lc.h, n_kv_heads=lc.kvh, mlp_dim=lc.f, vocab_size=lc.v, vocab_multiple=1,
                               **experts)


def attention_backward_bytes(lc: Local, attention: str, policy: str) -> dict:
    """The XLA attention's [S, S] arrays of one layer's backward beside its traced residuals, per device.

    n scores per device: rows by the batch axes, query heads by their tensor split, queries by the
    context split, keys whole (b * h * s_attn * s_kv of `lc`); Ulysses' local attention holds the
    whole sequence for h/context heads, the same count. The residuals themselves are traced
    (pallas_kernels/attention.py: xla_attention keeps exp(s - max) in fp32 and the probabilities in
    the compute dtype; saved under `none`, recomputed under every other policy: they are no dot
    outputs). Beside them:
      gradients   dP = dO V^T in the compute dtype (that of the probabilities it multiplied) and dS,
                  the fp32 softmax gradient dQ and dK are read from: c + 4 bytes per score, in the
                  one layer being differentiated, under every policy;
      stack copy  under `none`, the layer's probabilities copied out of the [L, ...] residual stack
                  as the dV GEMM's operand (c per score), made at the top of the layer's backward
                  and live through the MLP's backward too;
      mask        under `none`, the causal mask broadcast to [b, h, S, S] booleans (1 per score): a
                  residual of every layer that JAX hoists out of the layer scan, live the whole step.
    The compiled grad of a 2-layer model at S=512 (2 rows, 4 heads) holds all three on XLA:CPU and
    XLA:GPU (H100) alike; XLA:CPU also copies exp(s - max) out of the stack (the GPU reads it in its
    fusion) and its forward, like the GPU's, holds the -1e30 fill of the masked scores as an fp32
    [b, h, S, S] array, neither counted. A flash kernel (cudnn, pallas) forms dP and dS a tile at a
    time in on-chip memory and its mask in registers: all zero.

    Ring attention runs its own backward whatever `attention` says (memory_context): its jnp blocks
    form dP and dS per score of one ring step's tiles (`memory_context.ring_blocks`; none with the
    Pallas blocks) and mask each tile where it is formed (no stack copy, no hoisted mask); its fp32
    dQ, dK, dV accumulators, the dK/dV in flight and the k/v block received are counted in
    `gradients` too (memory_context.ring_backward_blocks)."""
    if lc.ring:
        n = lc.b * lc.h * lc.ring_blocks.step
        return {"gradients": n * (lc.c + F32) + memory_context.ring_backward_blocks(lc), "stack copy": 0, "mask": 0}
    if is_flash(attention):
        return {"gradients": 0, "stack copy": 0, "mask": 0}
    n = lc.b * lc.h * lc.s_attn * lc.s_kv
    saved = policy == "none"
    return {"gradients": n * (lc.c + F32), "stack copy": n * lc.c if saved else 0, "mask": n if saved else 0}


def activation_memory(cfg, lc: Local, policy: str, attention: str = "xla") -> dict:
    """Activation bytes of one micro-batch on one device, by phase of the step.

    Saved: L x one layer's residuals under `policy`, live from the forward to that layer's backward.
    Beside them, never at the same time (the compiled step frees the loss head's buffers before the
    first layer's backward starts, and recomputes one layer at a time):
      loss head phase       the embedding/head residuals (fp32 logits, softmax) and the head's backward;
      layer backward phase  one layer's recompute (what the policy dropped: residuals under `none`
                            minus those under `policy`; 0 under `none`) with a mixture of experts'
                            grouped-GEMM transients while the MLP's backward runs, or, later in the
                            same layer, attention's: its recomputed [S, S] residuals and the [S, S]
                            gradients it forms (`attention_backward_bytes`); the larger of the two.
    `total` is the larger phase. (Summing the two over-counted full remat by 40% on fsdp: the peak
    of the compiled step is one or the other, as its buffer assignment shows.) A flash attention
    (cudnn, pallas) keeps the [b,h,S] log-sum-exp instead of the [b,h,S,S] softmax: the S^2 arrays
    are replaced, the causal mask the XLA attention saves (beside the head's residuals: it does not
    depend on the layer) is dropped, and its backward forms no [S, S] gradients. Under sequence
    parallelism the residual-stream arrays are split over `tensor` (scaled with the whole sequence
    they were +16% on fsdp_tp_sp).

    Ring attention (memory_context) saves like a flash attention (its output too under save_dots_attn;
    under save_dots every step's score tiles), forms one ring step's [cq, bk] tiles and their gradients
    in the layer's backward under every policy (its custom_vjp recomputes them from the lse), and adds a
    phase of its own, the last layer's forward (`forward working set`; 0 without ring attention).
    Counted as the XLA attention's [S/context, S/context] arrays instead, cp_ring (context 4) would be
    21% over under none and 23% under under full at S=1024, 79% over at S=4096 (none) and 70% under at
    save_dots.
    """
    if policy not in ("none", "full", "save_dots", "save_dots_no_batch", "save_dots_attn"):
        raise ValueError(f"unknown remat policy {policy!r}; one of none, full, save_dots, save_dots_no_batch, "
                         "save_dots_attn")
    flash = is_flash(attention)
    # Ring attention saves q, k, v, its output and an lse per query and head (its custom_vjp), never the
    # XLA attention's [S, S] residuals the trace shows; under save_dots_attn its output is kept as a flash one's.
    lse_only = flash or lc.ring
    local = local_config(cfg, lc)
    layer, head, dispatch = _traced(local, policy, "xla")
    layer_none, _, dispatch_none = _traced(local, "none", "xla")
    # The trace runs the experts on one device; with expert parallelism each side of the exchange
    # holds xp times the device's own assignments (the dropless receive buffer's worst case).
    layer = memory_moe.dispatch_scaled(layer, dispatch, lc.xp)
    layer_none = memory_moe.dispatch_scaled(layer_none, dispatch_none, lc.xp)
    split = lc.s != lc.s_attn   # sequence parallelism: the stream is split where attention's sequence is not
    stream = {p: _stream_flags(local, p, "xla") if split else (None, None) for p in {policy, "none"}}

    def quad(entries, scores):
        """Bytes of the traced [S, S] entries (probed at p x p) at `scores` elements per row and head."""
        return int(sum(n * size * lc.b * scores / p ** 2 for n, size, k, p in entries if k >= 2))

    def scaled(entries, flags):
        """Bytes of traced entries: [S, S] ones (the XLA attention's) per query and key, none with a flash kernel."""
        flags = flags if flags is not None else (False,) * len(entries)
        lin = [(e, f) for e, f in zip(entries, flags) if e[2] < 2]
        out = _scale([e for e, _ in lin], lc.b, lc.s_attn, [f for _, f in lin], lc.s)
        return out + (0 if lse_only else quad(entries, lc.s_attn * lc.s_kv))

    def per_layer(entries, flags, keeps_attention_out=False):
        out = scaled(entries, flags)
        if lse_only:
            out += any(e[2] >= 2 for e in entries) and lc.b * lc.h * lc.s_attn * F32   # one lse per query and head
            if keeps_attention_out:   # save_dots_attn: and the attention output
                out += lc.b * lc.s_attn * lc.h * cfg.head_dim * np.dtype(cfg.dtype).itemsize
        return out
    saved_layer = per_layer(layer, stream[policy][0],   # save_dots_attn keeps a flash output (models/remat.py)
                            keeps_attention_out=policy == "save_dots_attn" and lse_only)
    if lc.ring:   # save_dots keeps the ring forward's score tiles, every step's
        saved_layer += memory_context.ring_saved_dots(lc, policy)
    recompute = max(per_layer(layer_none, stream["none"][0]) - saved_layer, 0)
    # The layer's backward runs the MLP's (or the experts') backward, then attention's. The first holds
    # the whole recompute and, for a mixture of experts, the grouped GEMMs' copies of their ragged
    # operand per local expert (xla backend) and their SwiGLU's two gradients (memory_moe). By the
    # second the MLP's residuals are consumed: live are the recomputed [S, S] residuals (exp and the
    # probabilities are no dot outputs: every policy but `none` recomputes them; under `none` they are
    # saved) and attention's [S, S] gradients. The larger of the two is the layer's working set; the XLA
    # attention's stack copy and mask are live in both (attention_backward_bytes), the mask in the loss
    # head phase too.
    xa = attention_backward_bytes(lc, attention, policy)
    mlp_phase = (recompute + memory_moe.grouped_gemm_backward_bytes(cfg, lc, policy)
                 + memory_moe.swiglu_grads_bytes(cfg, lc))
    if lc.ring:   # recomputed from the lse in every ring step's tiles, under every policy
        scores = quad(layer_none, lc.ring_blocks.step)
    else:
        scores = 0 if policy == "none" or flash else scaled([e for e in layer_none if e[2] >= 2], None)
    working = max(mlp_phase, scores + xa["gradients"]) + xa["stack copy"] + xa["mask"]
    # The [S, S] entries the trace finds outside the layers are the XLA attention's hoisted mask (its
    # bool, counted above) and the fp32 fill of the masked scores, a forward-only array.
    head_flags = stream[policy][1] or (False,) * len(head)
    head_bytes = scaled([e for e in head if e[2] < 2], [f for e, f in zip(head, head_flags) if e[2] < 2]) + xa["mask"]
    saved = cfg.n_layers * saved_layer
    # Ring attention's forward: one step's tiles, its accumulators and the loop invariants JAX hoists out
    # of the layer scan, beside every earlier layer's residuals and this layer's (memory_context).
    forward = sum(memory_context.ring_forward_bytes(lc, policy).values()) if lc.ring else 0
    return {"saved per layer": saved_layer, "saved (all layers)": saved, "backward working set": working,
            "forward working set": forward, "attention backward": xa, "loss head": head_bytes,
            "total": saved + max(working, head_bytes, forward),
            "detail": f"{len(layer)} residual arrays per layer ({sum(e[2] >= 2 for e in layer)} of them [.., S, S]), "
                      f"{len(head)} around the embedding and loss head, traced at remat={policy}"}


def gathered_weights(md, rules, mesh, policy: str) -> dict:
    """ZeRO-3: the all-gathered compute-dtype copies of the weights, per phase of the step. The embedding
    and head weights are gathered for the lookup and the loss head and freed after the head's backward.
    `fsdp_gather: keep` saves every layer's gathered copy for its backward; `per_layer` (the default,
    under every remat policy, models/remat.py) gathers each layer's weights again in its backward;
    `per_step` holds every weight and its gradient whole in fp32 for the whole step."""
    if rules.state["params"] != "sharded" or not rules.batch_axes(mesh):
        return {"loss head": 0, "layer backward": 0}
    c = np.dtype(md.cfg.dtype).itemsize
    rows = account.param_table(md, rules, mesh, "params")
    other = layer = 0
    for r in rows:
        full = account.bytes_per_device(r.shape, np.float32, _drop(r.spec, _replica_axes(rules, mesh)), mesh) // F32 * c
        if r.names and r.names[0] == "layers":
            layer += full // r.shape[0]
        else:
            other += full
    if rules.strategies.get("fsdp_gather") == "per_step":   # whole fp32 weights and gradients, all step
        whole = sum(account.bytes_per_device(r.shape, np.float32, _drop(r.spec, _replica_axes(rules, mesh)), mesh)
                    for r in rows)
        return {"loss head": 2 * whole, "layer backward": 2 * whole}
    keep = rules.strategies.get("fsdp_gather", "per_layer") == "keep"
    saved = md.cfg.n_layers * layer if keep else 0
    return {"loss head": other + saved, "layer backward": saved + (0 if keep else layer)}


def _replica_axes(rules, mesh) -> tuple:
    """The batch axes a weight is whole on once gathered (and its gradient before the reduction). An
    expert axis is a batch axis too, but it splits the experts' weights for good: they are never
    gathered over it and each rank's gradient is its own experts' (dropped with the others, the
    experts' gathered weights and layer gradients would count ep times their bytes)."""
    ep = set(rules.axes("experts", mesh)) if "experts" in rules.rules else set()
    return tuple(a for a in rules.batch_axes(mesh) if a not in ep)


def _drop(spec, axes):
    keep = [a for e in spec for a in entry_axes(e) if a not in axes]
    return only_axes(spec, keep)


def kv_cache_bytes(cfg, batch: int, seq: int, tensor: int = 1, dtype_bytes: int = 2) -> int:
    """Serving: K and V for every layer, [batch, seq, kv_heads/tensor, head_dim] each."""
    return 2 * cfg.n_layers * batch * seq * max(cfg.n_kv_heads // tensor, 1) * cfg.head_dim * dtype_bytes


def plan_memory(md, rules, mesh, global_batch: int, seq: int, microbatches: int = 1, policy: str | None = None,
                attention: str | None = None) -> dict:
    """Everything per device for one training step. The peak is the largest of three phases (four under
    ring attention), each activations + the temporaries live beside them (`temporaries` lists the peak
    phase's):
      loss head       saved residuals + the head's buffers; the gradient buffers (fp32: non-layer
                      leaves at their full local size until the data-parallel reduction, layer
                      leaves as the backward scan's stacked gradient, reduce-scattered per layer
                      under ZeRO-3), the accumulator when there are several micro-batches, ZeRO-3's
                      gathered embedding/head (and, under `none`, every layer's gathered weights);
      layer backward  saved residuals + one layer's recompute; the same gradient buffers plus the
                      layer's own fp32 weight gradients before they are reduced/stored, and under
                      remat that layer's re-gathered weights;
      update          the gradients + Adam's update tree (optimizer-spec, fp32);
      layer forward   ring attention only: saved residuals + the last layer's ring forward with the
                      loop invariants JAX hoists out of the layer scan (memory_context), the gradient
                      buffers and, under ZeRO-3, the layer's gathered weights.
    In every phase: the step's copy of Adam's moments. The step keeps the old state where the update
    is not finite (meshlab/train/step.py, jnp.where(finite, new, old)), so XLA copies mu and nu at
    the start of the step (the old values are read after the new ones are written in place) and the
    copies stay live to the end (every compiled step on CPU has them: `copy(param)` of each mu/nu
    leaf). The donated moment buffers are then free and take temporaries that fit them; counted as
    taking back as much as the gradient buffers where the rule file stores gradients like the
    moments (their shapes), nothing under ZeRO-1. Measured on 8 CPU devices for every shipped rule
    file, every remat policy, 2 and 4 layers, 2 and 4 rows per device: within 15% of the compiler's
    temp (one case, fsdp_tp_sp at full remat, -18%); without this term dp under remat was 16-27%
    under. At S=512, where the XLA attention's [S, S] arrays are most of the temp
    (`attention_backward_bytes`): -1% under none, -5% to -8% under the other policies. The context-
    parallel files (tiny, S = 512 to 4096, none, full and the save_dots policies): cp_ring and fsdp_cp
    -5% to +8%, cp_ulysses -9% to -1% (tests/plan/test_memory_comm.py, test_context_parallel_temp_estimate)."""
    cfg = md.cfg
    policy = policy or cfg.remat
    attention = attention or cfg.attention
    if rules.strategies.get("attention") == "ulysses":   # its local attention is `auto`'s, whatever the config says
        attention = memory_context.ulysses_local_attention()
    lc = local_sizes(cfg, rules, mesh, global_batch, seq, microbatches)
    state = state_memory(md, rules, mesh)
    act = activation_memory(cfg, lc, policy, attention)
    grads, layer_grads = _grads_before_reduce(md, rules, mesh)
    gathered = gathered_weights(md, rules, mesh, policy)
    shared = {"micro-batch grads (fp32)": grads, "accumulator": state["grads"] if microbatches > 1 else 0,
              "optimizer copy (non-finite guard)": _moment_copy(rules, state)}
    phases = {
        "loss head": (act["saved (all layers)"] + act["loss head"],
                      {**shared, "gathered weights": gathered["loss head"]}),
        "layer backward": (act["saved (all layers)"] + act["backward working set"],
                           {**shared, "one layer's weight grads (fp32)": layer_grads,
                            "gathered weights": gathered["layer backward"]}),
        "update": (0, {"grads": state["grads"], "Adam update": state["optimizer"] // 2,
                       "optimizer copy (non-finite guard)": _moment_copy(rules, state)}),
    }
    if act["forward working set"]:
        phases["layer forward"] = (act["saved (all layers)"] + act["forward working set"],
                                   {**shared, "gathered weights": gathered["layer backward"]})
    totals = {k: a + sum(t.values()) for k, (a, t) in phases.items()}
    peak_phase = max(totals, key=totals.get)
    act_at_peak, temps = phases[peak_phase]
    temps = dict(temps, total=sum(temps.values()))
    act = dict(act, total=act_at_peak)
    peak = totals[peak_phase]
    total = state["params"] + state["optimizer"] + peak
    return {"state": state, "activations": act, "temporaries": temps, "local": lc, "total": total,
            "estimate_temp": peak, "peak phase": peak_phase, "phases": totals,
            "textbook": _textbook(md, rules, mesh, state)}


def _moment_copy(rules, state) -> int:
    """Net temp bytes of XLA's copy of Adam's mu and nu (see `plan_memory`)."""
    same = rules.state["grads"] == rules.state["optimizer"]
    return max(state["optimizer"] - (state["grads"] if same else 0), 0)


def _textbook(md, rules, mesh, state) -> dict:
    """16 B/param on this device's model-parallel shard, split over as many devices as the rule file
    actually shards Adam over (fsdp alone in HSDP-style meshes, not every data-parallel device)."""
    n = _model_parallel_params(md, rules, mesh)
    p = max(round(8 * n / state["optimizer"]), 1) if state["optimizer"] else 1
    return textbook_memory(n, zero_stage(rules), p)


def _model_parallel_params(md, rules, mesh) -> int:
    """Parameters one device holds before ZeRO splits them (tensor/context shards only)."""
    batch = _replica_axes(rules, mesh)
    return sum(account.bytes_per_device(r.shape, np.float32, _drop(r.spec, batch), mesh)
               for r in account.param_table(md, rules, mesh, "params")) // F32


def _grads_before_reduce(md, rules, mesh) -> tuple[int, int]:
    """(gradient buffers of one micro-batch's backward, one layer's fp32 weight gradients) per device.
    Non-layer leaves: the params storage spec with the data-parallel axes removed (each device holds
    the full local gradient until it is reduced). Layer leaves: the backward scan's stacked [L, ...]
    gradient, full local size, except under ZeRO-2/3, which reduce-scatter each layer's gradient inside
    the loop and stack only the shards. The layer being differentiated adds its own full local fp32
    gradients (the second number) until they are reduced or written into the stack."""
    batch = _replica_axes(rules, mesh)
    rows = account.param_table(md, rules, mesh, "params")
    grads = account.param_table(md, rules, mesh, "grads")
    total = layer = 0
    for r, g in zip(rows, grads):
        full = account.bytes_per_device(r.shape, np.float32, _drop(r.spec, batch), mesh)
        if r.names and r.names[0] == "layers":
            layer += full // r.shape[0]
            if rules.state["grads"] == "sharded":
                full = g.bytes_per_device
        total += full
    return total, layer
