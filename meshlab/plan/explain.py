"""What a rule file does to a model, without allocating it: per parameter its shape, PartitionSpec
and bytes per device; totals for params, grads and Adam state; the main activations' specs."""
from __future__ import annotations

import numpy as np

from meshlab.plan import account, memory

ACTIVATIONS = {
    "tokens / labels [B, S]": ("act_batch", "act_seq"),
    "residual stream [B, S, d]": ("act_batch", "act_seq", "act_embed"),
    "q [B, S, h, hd]": ("act_batch", "act_attn_seq", "act_heads", None),
    "k, v [B, S, kvh, hd]": ("act_batch", "act_attn_seq", "act_kv_heads", None),
    "MLP hidden [B, S, f]": ("act_batch", "act_attn_seq", "act_mlp"),
    "logits [B, S, V]": ("act_batch", "act_attn_seq", "act_vocab"),
}


def describe(md, rules, mesh, global_batch: int | None = None, seq: int = 4096) -> str:
    fb = account.fmt_bytes
    if seq < 1 or (global_batch is not None and global_batch < 1):
        raise ValueError(f"global batch {global_batch} and sequence length {seq} must be >= 1")
    if mesh.shape["stage"] > 1:   # what training would refuse is an error here too, not a table
        from meshlab.plan.pipeline import check_model
        check_model(md.cfg, rules)
    sizes = {a: s for a, s in mesh.shape.items() if s > 1}
    lines = [f"rules {rules.name} ({rules.path}), mesh {sizes or 'single device'}, ZeRO stage "
             f"{memory.zero_stage(rules)} (state: {rules.state})"]
    params = account.param_table(md, rules, mesh, "params")
    grads = account.param_table(md, rules, mesh, "grads")
    opt = account.param_table(md, rules, mesh, "optimizer")
    rows = [("parameter", "shape", "params spec", "params/dev", "grads spec", "opt spec")]
    rows += [(p.path, str(p.shape), str(tuple(p.spec)), fb(p.bytes_per_device), str(tuple(g.spec)), str(tuple(o.spec)))
             for p, g, o in zip(params, grads, opt)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]       # columns as wide as their longest cell
    lines += [" ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
              for r in rows]
    st = memory.state_memory(md, rules, mesh)
    n = md.param_count()
    lines.append(f"\n{n:,} parameters; per device: params (fp32, = master) {fb(st['params'])}, grads (fp32 accumulator) "
                 f"{fb(st['grads'])}, optimizer (Adam mu+nu fp32) {fb(st['optimizer'])}, total {fb(st['total'])} "
                 f"({st['total'] / max(n, 1):.2f} B/param vs 16 B/param unsharded)")
    lines += experts_lines(md, rules, mesh, params, grads, opt, global_batch, seq)
    lines.append("\nactivations (logical names -> PartitionSpec):")
    for what, names in ACTIVATIONS.items():
        try:
            spec = rules.spec(names, None, mesh)
        except Exception as e:   # a rule missing for an activation name is worth seeing, not fatal here
            spec = f"error: {e}"
        lines.append(f"  {what:<28} {str(names):<56} {spec}")
    if mesh.shape["stage"] > 1:   # which layers sit on which stage; the embedding/head imbalance (FLOPs at seq)
        from meshlab.plan.pipeline import stage_table
        lines += [""] + stage_table(md.cfg, rules, mesh, seq)
    return "\n".join(lines)


def experts_lines(md, rules, mesh, params, grads, opt, global_batch, seq) -> list[str]:
    """A mixture of experts: total vs active parameters, the expert banks' bytes per device (params,
    grads, Adam), and expert parallelism's all-to-all bytes per MoE layer (meshlab/plan/comm.py)."""
    cfg = md.cfg
    if not hasattr(cfg, "n_experts"):
        return []
    from meshlab.plan import comm
    fb = account.fmt_bytes
    counts = cfg.param_count()
    bank = lambda rows: sum(r.bytes_per_device for r in rows if "experts" in r.names)  # noqa: E731
    ep = comm.group_size(mesh, rules.axes("experts", mesh))
    out = [f"\nmixture of experts: {cfg.n_experts} experts, top-{cfg.top_k}, expert width {cfg.expert_mlp_dim}"
           f"{f', shared {cfg.shared_mlp_dim}' if cfg.shared_mlp_dim else ''}; {counts['total']:,} parameters, "
           f"{counts['active']:,} active per token (FLOPs and MFU count {cfg.matmul_param_count():,} active matmul "
           f"weights); experts split over {ep} device(s) ({cfg.n_experts // max(ep, 1)} each)",
           f"expert weights per device: params {fb(bank(params))}, grads {fb(bank(grads))}, "
           f"Adam mu+nu {fb(2 * bank(opt))}"]
    batch = global_batch or rules.data_parallel_size(mesh)
    c = np.dtype(cfg.dtype).itemsize
    a2a = comm.expert_collectives(cfg, rules, mesh, batch, seq, 1, c)
    if a2a:
        for x in a2a:
            out.append(f"all-to-all over {'x'.join(x.axes)} per MoE layer (batch {batch} x seq {seq}): "
                       f"{x.count // cfg.n_layers} x {fb(x.nbytes)} ({x.what})")
    else:
        out.append("no expert all-to-all: the experts are not split over devices (`experts` maps to no axis > 1)")
    return out
