"""Communication per step: which collectives a rule file causes, their bytes, and their time.

Time follows the alpha-beta model T = alpha + n/BW per message. For a group of p devices:
  ring all-reduce            2(p-1) alpha + 2(p-1)/p n/BW   (reduce-scatter then all-gather)
  ring all-gather / r-scatter (p-1) alpha +  (p-1)/p n/BW   (n = the full buffer)
  tree all-reduce            2 log2(p) (alpha + n/BW)       (reduce then broadcast, whole message per level:
                                                             few start-ups win for small n, the root's
                                                             log2(p) full copies lose for large n)
  all-to-all (pairwise)      (p-1) alpha +  (p-1)/p n/BW
  point-to-point             alpha + n/BW
`algorithm="auto"` takes the cheaper of ring and tree, as NCCL does by message size.

`step_collectives` lists what one train step moves, per kind and mesh axis, in the terms the
compiled HLO uses (all-reduce: the buffer; all-gather: its output; reduce-scatter: its output
shard), so the test suite can count the same thing in `compiled.as_text()`.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from meshlab.mesh import AXES, entry_axes
from meshlab.plan import account
from meshlab.plan.memory import F32, _drop, local_sizes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Comm:
    kind: str
    axes: tuple
    nbytes: int          # HLO-comparable bytes of one call (see module docstring)
    count: int           # calls per step
    what: str
    overlappable: bool   # can hide behind compute (FSDP prefetch, gradient buckets); TP activations cannot
    propagated: bool = False   # placed by GSPMD (on CPU a propagated reduce-scatter is all-reduce + slice)
    group: int = 1             # devices in the group (set by step_collectives)

    @property
    def total(self) -> int:
        return self.nbytes * self.count


def group_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def crosses_hosts(mesh_shape: dict, axis: str, devices_per_host: int) -> bool:
    """Axes are laid out as in meshlab.mesh: the last of AXES changes fastest (inside a host)."""
    inner = math.prod(mesh_shape.get(a, 1) for a in AXES[AXES.index(axis) + 1:])
    return inner * mesh_shape.get(axis, 1) > devices_per_host


def collective_time(kind: str, n: float, p: int, alpha: float, bw: float, algorithm: str = "auto") -> float:
    """Seconds for one collective over p devices; n is the full buffer (all-gather: output; reduce-scatter: input)."""
    if p <= 1 or n <= 0:
        return 0.0
    if kind == "collective-permute":
        return alpha + n / bw
    frac = (p - 1) / p
    if kind == "all-reduce":
        ring = 2 * (p - 1) * alpha + 2 * frac * n / bw
        tree = 2 * math.ceil(math.log2(p)) * (alpha + n / bw)
        return {"ring": ring, "tree": tree}.get(algorithm, min(ring, tree))
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        ring = (p - 1) * alpha + frac * n / bw
        # recursive doubling: log2(p) start-ups, the same bytes (p a power of two)
        direct = math.ceil(math.log2(p)) * alpha + frac * n / bw if kind != "all-to-all" else ring
        return {"ring": ring, "tree": direct}.get(algorithm, min(ring, direct))
    raise ValueError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")


def wire_bytes(kind: str, n: float, p: int) -> float:
    """Bytes each device sends for one call, ring algorithms (n as in collective_time)."""
    if p <= 1:
        return 0.0
    return {"all-reduce": 2 * (p - 1) / p * n, "collective-permute": n}.get(kind, (p - 1) / p * n)


def _spec_axes(spec) -> list:
    return [a for e in spec for a in entry_axes(e)]


def step_collectives(md, rules, mesh, global_batch: int, seq: int, microbatches: int = 1,
                     policy: str | None = None) -> list[Comm]:
    cfg = md.cfg
    policy = policy or cfg.remat
    k, L = microbatches, cfg.n_layers
    batch = rules.batch_axes(mesh)
    c = np.dtype(cfg.dtype).itemsize
    out: list[Comm] = []
    store = account.param_table(md, rules, mesh, "params")
    grads = account.param_table(md, rules, mesh, "grads")
    opt = account.param_table(md, rules, mesh, "optimizer")
    ep_axes = rules.axes("experts", mesh)
    for s, g, o in zip(store, grads, opt):
        layered = bool(s.names) and s.names[0] == "layers"
        # An expert bank's expert split is model parallel (never gathered, no gradient sum over it).
        dp = tuple(a for a in batch if not ("experts" in s.names and a in ep_axes))
        local_full = account.bytes_per_device(s.shape, np.float32, _drop(s.spec, dp), mesh)
        s_ax = [a for a in _spec_axes(s.spec) if a in dp]
        g_ax = [a for a in _spec_axes(g.spec) if a in dp and a not in s_ax]
        o_ax = [a for a in _spec_axes(o.spec) if a in dp and a not in s_ax]
        r_ax = [a for a in o_ax if a not in g_ax]   # ZeRO-1: reduce-scatter onto the optimizer shards
        rest = tuple(a for a in dp if a not in s_ax and a not in g_ax and a not in r_ax)
        if s_ax and rules.strategies.get("fsdp_gather") == "per_step":
            # gathered whole (fp32) once per step, whole gradients reduce-scattered once after the
            # micro-batches (meshlab/train/step.py): the bytes do not grow with the micro-batch count
            out.append(Comm("all-gather", tuple(s_ax), local_full, 1, f"{s.path} params (zero-3, per step)", False))
            out.append(Comm("reduce-scatter", tuple(s_ax), s.bytes_per_device, 1, f"{s.path} grads (zero-3, per step)",
                            False))
        elif s_ax:   # ZeRO-3: gather per use (compute dtype), its transpose reduce-scatters the gradient
            gathered = local_full // F32 * c
            # per_layer (reshard-after-forward) gathers each layer again in its backward; keep does not
            passes = 2 if layered and rules.strategies.get("fsdp_gather", "per_layer") == "per_layer" else 1
            n = gathered // L if layered else gathered
            cnt = (L if layered else 1) * k
            out.append(Comm("all-gather", tuple(s_ax), n, cnt * passes, f"{s.path} params (zero-3)", True))
            # A tied embedding is used twice (lookup, head): the two gathers are merged, but each use's
            # transpose is its own reduce-scatter (XLA does not add them first: twice the bytes).
            uses = 2 if (cfg.tie_embeddings and s.names == ("vocab", "embed")) else 1
            out.append(Comm("reduce-scatter", tuple(s_ax), s.bytes_per_device // (L if layered else 1), cnt * uses,
                            f"{s.path} grads (zero-3)", True))
        if g_ax:   # ZeRO-2: psum_scatter at each use, per layer inside the backward scan (grad_sync)
            uses = 2 if (cfg.tie_embeddings and s.names == ("vocab", "embed")) else 1
            out.append(Comm("reduce-scatter", tuple(g_ax), g.bytes_per_device // (L if layered else 1),
                            (L if layered else 1) * k * uses, f"{s.path} grads (zero-2)", True))
        # dp / zero1: a layer leaf is reduced per layer inside the last micro-batch's backward (it can
        # overlap the next layer's), the others once after the backward (exposed). zero1 scatters.
        per = L if layered and not g_ax else 1
        if r_ax:   # explicit psum_scatter: half an all-reduce's bytes
            out.append(Comm("reduce-scatter", tuple(r_ax), o.bytes_per_device // per, per, f"{s.path} grads (zero-1)",
                            per > 1))
        if rest:   # the remaining data-parallel sum
            out.append(Comm("all-reduce", rest, (o.bytes_per_device if r_ax else g.bytes_per_device) // per, per,
                            f"{s.path} grads", per > 1))
        if o_ax and not s_ax:   # ZeRO-1/2: the updated shards are gathered back into replicated params
            out.append(Comm("all-gather", tuple(o_ax), s.bytes_per_device, 1, f"{s.path} updated params", False,
                            propagated=True))
        # Tensor-replicated weights (norm scales) get partial gradients on each tensor shard.
        t_ax = tuple(a for a in ("tensor",) if mesh.shape[a] > 1 and a not in _spec_axes(s.spec))
        if t_ax and rules.axes("act_heads", mesh):
            out.append(Comm("all-reduce", t_ax, account.bytes_per_device(s.shape, np.float32, s.spec, mesh) //
                            (L if layered else 1), (L if layered else 1) * k, f"{s.path} grads (tensor partial)",
                            True, propagated=True))
    out += _activation_collectives(cfg, rules, mesh, global_batch, seq, k, c, policy)
    out += expert_collectives(cfg, rules, mesh, global_batch, seq, k, c, policy)
    for x in out:
        x.group = group_size(mesh, x.axes)
    return [x for x in out if x.group > 1 and x.count > 0]


def _activation_collectives(cfg, rules, mesh, global_batch, seq, k, c, policy: str = "none") -> list[Comm]:
    """Megatron tensor parallelism (and its sequence-parallel form) on the residual stream. Under full
    remat the backward recomputes each layer's forward up to what its backward needs: the attention
    output's row-parallel collective again (the MLP input is built from it), not the MLP's (the layer
    output is not needed). The dots policies save that projection's output, collective included."""
    lc = local_sizes(cfg, rules, mesh, global_batch, seq, k)
    L = cfg.n_layers
    t_ax = tuple(a for a in rules.axes("act_heads", mesh))
    # column-parallel projections whose input gradients travel: q, k, v, and gate and up (one GEMM stacked)
    n_col = 4 if cfg.gate_up == "stacked" else 5
    out = []
    if t_ax:
        x = lc.b * (lc.s * lc.t if lc.sp else lc.s) * lc.d * c   # the full residual stream of one micro-batch
        if lc.sp and rules.strategies.get("collective_matmul"):
            out += _collective_matmul_permutes(x // lc.t, lc.t, L * k, policy)
        elif lc.sp:   # all-gather before each block, reduce-scatter after; mirrored in the backward
            out.append(Comm("all-gather", t_ax, x, 2 * L * k, "sequence-parallel gather (fwd: attention, MLP input)",
                            False, True))
            out.append(Comm("reduce-scatter", t_ax, x // lc.t, 2 * L * k, "sequence-parallel scatter (fwd)", False, True))
            out.append(Comm("all-gather", t_ax, x, 2 * L * k, "sequence-parallel gather (bwd: o, down output grads)",
                            False, True))
            # The backward gathers each block's sequence-split input a second time for its weight-gradient
            # GEMMs (dWq,k,v = x^T dq.. and dWgate,up): autodiff saved the split input, not the gathered one,
            # so an extra all-gather replaces a full [b, S, d] residual per block. Megatron's sequence
            # parallelism makes the same trade (Korthikanti et al. 2022, 4.2.2) and the compiled HLO has it:
            # 6 sequence all-gathers per layer, not 4. Saving the gathered input instead (norm outputs
            # constrained to the whole sequence; tried on tiny, 8 CPU devices) drops 2 gathers but adds 2
            # reduce-scatters and 4% temp: not cheaper. Under remat the recomputed forward's gathers serve.
            out.append(Comm("all-gather", t_ax, x, 2 * L * k, "sequence-parallel re-gather (bwd: weight grads)",
                            False, True))
            out.append(Comm("reduce-scatter", t_ax, x // lc.t, n_col * L * k,
                            "sequence-parallel scatter (bwd: q,k,v,gate,up)", False, True))
            if policy == "full":
                out.append(Comm("reduce-scatter", t_ax, x // lc.t, L * k, "sequence-parallel scatter (remat: o)", False,
                                True))
        else:       # row-parallel outputs in the forward (o, down); input grads of q,k,v,gate,up in the backward
            out.append(Comm("all-reduce", t_ax, x, 2 * L * k, "row-parallel outputs (fwd)", False, True))
            out.append(Comm("all-reduce", t_ax, x, n_col * L * k, "column-parallel input grads (bwd)", False, True))
            if policy == "full":
                out.append(Comm("all-reduce", t_ax, x, L * k, "row-parallel output (remat: o)", False, True))
        if rules.axes("vocab", mesh) and lc.sp:
            # Vocab-split embedding and head around a sequence-split stream: the lookup's partial sums are
            # reduce-scattered onto the sequence split and its transpose gathers the output grad for the
            # scatter-add into the vocab shard; the head gathers its input (the backward's dW_head reuses it:
            # one computation, CSE) and reduce-scatters the input grad.
            out.append(Comm("reduce-scatter", t_ax, x // lc.t, 2 * k, "embedding lookup + head input grad", False, True))
            out.append(Comm("all-gather", t_ax, x, 2 * k, "head input (fwd) + embedding output grad (bwd)", False, True))
        elif rules.axes("vocab", mesh):   # vocab-split embedding lookup (fwd) and LM-head input grad (bwd)
            out.append(Comm("all-reduce", t_ax, x, 2 * k, "embedding lookup + head input grad", False, True))
        if rules.axes("vocab", mesh):
            out.append(Comm("all-reduce", t_ax, 3 * lc.b * lc.s_attn * F32, k, "softmax max/sum/label over vocab",
                            False, True))
    if rules.strategies.get("attention") == "ring" and "context" in rules.axes("act_attn_seq", mesh):
        p = mesh.shape["context"]
        kv = 2 * lc.b * lc.s_attn * lc.kvh * lc.hd * c
        out.append(Comm("collective-permute", ("context",), kv, 3 * (p - 1) * L * k, "ring attention K/V blocks", True))
    if rules.strategies.get("attention") == "ulysses" and "context" in rules.axes("act_attn_seq", mesh):
        qkvo = lc.b * lc.s_attn * (2 * lc.h + 2 * lc.kvh) * lc.hd * c
        out.append(Comm("all-to-all", ("context",), qkvo, 2 * L * k, "ulysses head/sequence switch", False))
    return out


def _collective_matmul_permutes(chunk: int, t: int, layers: int, policy: str) -> list[Comm]:
    """Sequence parallelism under `strategies.collective_matmul` (meshlab/parallel/collective_matmul.py):
    each of the 2 gathers and 2 scatters per layer is t-1 collective-permutes of one [b, s/t, d] chunk,
    each hidden behind the next chunk's GEMM; the backward transposes the 4 (q, k, v's input gradients
    summed before they travel, gate and up's too: 2 scatters where plain sequence parallelism has 5).
    remat=none saves the received chunks, so no re-gather for the weight gradients (the 2 plain ones).
    Under a remat policy the recomputed forward runs the attention and MLP gathers again (the chunks are
    not GEMM outputs, no policy saves them) and the o scatter (its sum feeds the MLP's input): 3 more
    (compiled HLO, tiny model: full, save_dots and save_dots_no_batch alike)."""
    again = 0 if policy == "none" else 3
    return [Comm("collective-permute", ("tensor",), chunk, 4 * (t - 1) * layers, "collective matmul (fwd)", True),
            Comm("collective-permute", ("tensor",), chunk, (4 + again) * (t - 1) * layers, "collective matmul (bwd)",
                 True)]


def expert_collectives(cfg, rules, mesh, global_batch, seq, k, c, policy: str = "none") -> list[Comm]:
    """Expert parallelism's all-to-alls per MoE layer (meshlab/parallel/experts.py): tokens out and results
    back in the forward, their transposes in the backward (full remat: the forward's pair again).
    capacity: the [E, rows, C, d] buffer; dropless: the padded [ep, A, d] buffer (A = rows*S*k; what
    the CPU moves; the GPU's ragged_all_to_all moves only the A rows sent, ~1/ep of it) plus one
    all-to-all of the [E] int32 assignment counts (forward only). `strategies.experts.chunks: n` cuts
    each exchange into n all-to-alls of a 1/n piece (capacity: ceil(rows*C/n) slots per expert;
    dropless: [ep, ceil(A/n), d]): the total stays the same when n divides the buffer."""
    if not hasattr(cfg, "n_experts"):
        return []
    from meshlab.parallel import experts
    ep_axes = rules.axes("experts", mesh)
    ep = group_size(mesh, ep_axes)
    if ep <= 1:
        return []
    mode = {**experts.DEFAULT, **(rules.strategies.get("experts") or {})}
    rows = local_sizes(cfg, rules, mesh, global_batch, seq, k).b
    passes = 4 + (2 if policy == "full" else 0)
    L = cfg.n_layers
    n = mode["chunks"]
    if mode["dispatch"] == "capacity":
        C = experts.row_capacity(seq, cfg.top_k, cfg.n_experts, mode["capacity_factor"])
        piece, what = cfg.n_experts * -(-rows * C // n) * cfg.d_model * c, "capacity buffers"
        counts = []
    else:
        piece, what = ep * -(-rows * seq * cfg.top_k // n) * cfg.d_model * c, "dropless, padded"
        counts = [Comm("all-to-all", ep_axes, cfg.n_experts * 4, (passes // 2 - 1) * L * k, "expert assignment counts",
                       False)]
    # Chunked, only the first piece out and the last piece back of each exchange wait on nothing to hide behind.
    out = [Comm("all-to-all", ep_axes, piece, passes * L * k, f"expert dispatch + return ({what})", False)]
    if n > 1:
        out.append(Comm("all-to-all", ep_axes, piece, passes * L * k * (n - 1),
                        f"expert dispatch + return ({what}), {n - 1} of {n} pieces under expert GEMMs", True))
    return out + counts


def layer_overlap(rows, compute_s: float, n_layers: int, microbatches: int) -> dict:
    """Exposed communication priced per layer. `rows`: comm_time's (Comm, seconds). A collective issued
    per layer inside the layer scan (count a multiple of layers x micro-batches) and marked overlappable
    hides behind one layer's compute (a gradient reduce-scatter behind the next layer's backward, an
    FSDP gather behind the previous layer's work): exposed = slots x max(0, comm per layer - compute per
    layer), with compute per layer = compute_s / slots (the embedding and head counted in: a slight
    over-estimate of what hides). Everything else (dp's all-reduce and zero1's reduce-scatter after the
    backward, the params' all-gather after the update, tensor-parallel activations) is exposed whole."""
    slots = max(n_layers * microbatches, 1)
    layered = sum(t for x, t in rows if x.overlappable and x.count >= slots and x.count % slots == 0)
    whole = sum(t for _, t in rows) - layered
    per_layer, layer_compute = layered / slots, compute_s / slots
    exposed_layers = slots * max(0.0, per_layer - layer_compute)
    return {"per_layer_comm": per_layer, "layer_compute": layer_compute, "hidden": layered - exposed_layers,
            "exposed": whole + exposed_layers}


def cpu_view(comms: list[Comm]) -> dict:
    """Bytes per kind as XLA on CPU writes them: a propagated reduce-scatter becomes an all-reduce of the
    full buffer (+ slice); explicit shard_map psum_scatter stays a reduce-scatter (DESIGN.md)."""
    return _view(comms, cpu=True)


def _view(comms, cpu: bool) -> dict:
    out = {k: 0 for k in KINDS}
    for x in comms:
        kind, n = x.kind, x.nbytes
        if cpu and kind == "reduce-scatter" and x.propagated:
            kind, n = "all-reduce", n * x.group
        out[kind] += n * x.count
    return out


def per_kind(comms: list[Comm]) -> dict:
    return _view(comms, cpu=False)


def comm_time(comms: list[Comm], mesh, hw, hosts: int = 1, algorithm: str = "auto") -> dict:
    """Seconds per step: total, the part that can overlap with compute, and the exposed part."""
    shape = dict(mesh.shape)
    per_host = max(int(np.prod(list(shape.values()))) // max(hosts, 1), 1)
    total = hidden = 0.0
    rows = []
    for x in comms:
        p = group_size(mesh, x.axes)
        links = [hw.link(a, crosses_hosts(shape, a, per_host)) for a in x.axes]
        alpha = max(lk.alpha_s for lk in links)
        bw = min(lk.bw_Bps for lk in links)   # a multi-axis group runs at its slowest link (no hierarchy modelled)
        n = x.nbytes * (p if x.kind == "reduce-scatter" else 1)   # reduce-scatter's input is p shards
        t = x.count * collective_time(x.kind, n, p, alpha, bw, algorithm)
        total += t
        hidden += t if x.overlappable else 0.0
        rows.append((x, t))
    return {"total": total, "overlappable": hidden, "exposed": total - hidden, "rows": rows}
