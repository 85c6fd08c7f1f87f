"""Memory of a mixture of experts' feed-forward (models/moe.py, meshlab/parallel/experts.py), per device.

Three parts beside what the traced residuals already hold (meshlab/plan/memory.py):
  dispatch buffers  the residuals of the dropless dispatch are [b * S * k, ..] rows on the tracing
                    device; with expert parallelism each side of the exchange holds the expert
                    group's size times that (the receive buffer's exact worst case);
  grouped GEMM      `jax.lax.ragged_dot` (the xla backend of pallas_kernels/grouped_matmul.py: what
                    `auto` runs off a GPU, and `gemm: xla`) is lowered to a dense GEMM over a masked copy of
                    its ragged operand, one copy per local expert: [G, R, width] for R dispatched
                    rows and G experts on the device, G times the operand. These copies live only
                    inside the GEMMs and their transposes, so the traced residuals never show them;
                    in the compiled step they are the largest buffers of one layer's backward;
  SwiGLU gradients  the experts' activation (pallas_kernels.swiglu.silu_mul) writes d_gate and d_up
                    in one fusion, both live until the gate and up GEMMs' transposes read them.
"""
from __future__ import annotations

from meshlab.plan.account import logical_shards


def expert_sizes(cfg, rules, mesh, seq: int) -> tuple[int, int, float, int]:
    """(expert width, shared expert width, dispatch buffer factor, experts per device run as ragged
    groups) per device; zeros for a dense model. The factor is the expert group's size under dropless
    dispatch and E*C / (S*k) under capacity dispatch, whose padded batched GEMMs have no ragged groups (0)."""
    if not hasattr(cfg, "n_experts"):
        return 0, 0, 1.0, 0
    from meshlab.parallel import experts
    mode = {**experts.DEFAULT, **(rules.strategies.get("experts") or {})}
    ep = logical_shards(rules, mesh, "experts")
    if mode["dispatch"] == "capacity":
        cap = experts.row_capacity(seq, cfg.top_k, cfg.n_experts, mode["capacity_factor"])
        xp, groups = cfg.n_experts * cap / (seq * cfg.top_k), 0
    else:
        xp, groups = float(ep), cfg.n_experts // ep
    return (cfg.expert_mlp_dim // logical_shards(rules, mesh, "mlp"),
            cfg.shared_mlp_dim // logical_shards(rules, mesh, "act_mlp"),
            xp, groups)


def dispatch_scaled(entries, dispatch, xp: float) -> tuple:
    """Traced residual entries (elements, itemsize, S-dims, probe) with the dispatch buffers' elements
    multiplied by `xp` (the flags in `dispatch`, one per entry)."""
    return tuple((n * xp if d else n, size, k, p) for (n, size, k, p), d in zip(entries, dispatch))


def expands_ragged_operand(cfg) -> bool:
    """Whether the experts' grouped GEMM is `lax.ragged_dot` (xla backend): `gemm: xla`, or `auto` where
    this process's devices are not GPUs (pallas_kernels.grouped_matmul.resolve_backend's choice, the
    same devices the memory probe traces on). The Mosaic (Hopper) and Triton kernels read the groups in place."""
    if cfg.gemm != "auto":
        return cfg.gemm == "xla"
    from pallas_kernels.grouped_matmul import resolve_backend
    return resolve_backend(cfg.gemm) == "xla"


def dispatched_rows(cfg, lc) -> float:
    """R, the rows that reach the device's experts: xp times its own b * S * k assignments."""
    return lc.xp * lc.b * lc.s_attn * cfg.top_k


def grouped_gemm_backward_bytes(cfg, lc, policy: str) -> int:
    """Peak bytes of the xla grouped GEMMs' masked operand copies in one MoE layer's backward, per device.

    R = xp * b * S * k rows reach the device's G experts (its own assignments, or under expert
    parallelism the receive buffer of the whole group); the expert width is `lc.fe` (its `mlp`
    split), d the model width. Each GEMM expands its ragged operand to [G, R, width] in the compute
    dtype. Read from the compiled step's buffer assignment (8 CPU devices; dp, ep, fsdp_ep and
    fsdp_tp_ep; S = 32 and 512): at the experts' backward peak two f-wide expansions (the down
    projection's input h, the gate/up gradients) and the output gradient's d-wide one are live, each
    f-wide one also transposed to [R, G*f] for the dot (a free bitcast when G = 1): 4f + d per row
    and expert. When the layer is recomputed (any remat policy but `none`: ragged_dot is no dot the
    save_dots policies keep) the recomputed forward's d-wide expansion and, where G > 1, a third
    f-wide one with its transpose join them: 6f + 2d (G = 1: 2f + 2d). The Mosaic and Triton kernels
    read the groups in place: nothing."""
    if not lc.el or not expands_ragged_operand(cfg):
        return 0
    rows = dispatched_rows(cfg, lc)
    f_wide = 2 if policy == "none" or lc.el == 1 else 3
    d_wide = 1 if policy == "none" else 2
    per_row = f_wide * lc.fe * (2 if lc.el > 1 else 1) + d_wide * lc.d
    return int(per_row * lc.el * rows * lc.c)


def swiglu_grads_bytes(cfg, lc) -> int:
    """Bytes of the experts' SwiGLU gradients beside the layer's residuals, per device: silu_mul's
    backward writes d_gate and d_up [R, fe] in one fusion, and the second is live while the first's
    GEMM transposes run. Its residuals are gate and up as given, which the trace counts; the pair of
    gradients holds one [R, fe] more. Read from the compiled step (8 CPU devices, moe_tiny): on ep at
    S=512 under full remat the temp rose by exactly one such array when the activation moved from
    autodiff's fp32 expression to silu_mul, and on fsdp_ep at S=512 without remat it fell by the three
    fp32 [2, R, fe] stacks the trace no longer holds, less one [R, fe] array."""
    if not lc.fe:
        return 0
    return int(dispatched_rows(cfg, lc) * lc.fe * lc.c)
