"""`train_step(state, batch) -> (state, metrics)`: one jitted, donated program per run.

Gradients are computed inside a `shard_map` that is manual over the data-parallel axes of the
rule file (`batch:`) and Auto over the rest (tensor, context, ...), so the data-parallel
collectives are written out rather than left to propagation:
  dp           local accumulation over micro-batches; in the last one's backward, per layer, an
               all-reduce (psum) of that layer's summed gradient (meshlab/parallel/grad_sync.py);
  zero1        the same with a reduce-scatter (psum_scatter) onto the optimizer shards;
  zero2        per layer, inside the backward layer scan, a reduce-scatter (psum_scatter) of each
               weight's gradient into the sharded accumulator (meshlab/parallel/grad_sync.py);
  fsdp         per-layer all-gather inside the layer scan (`rules.materialize`), whose
               transpose is the per-layer reduce-scatter of the gradient.
XLA on CPU would lower a propagated reduce-scatter to all-reduce + slice (DESIGN.md), which
is why these are explicit. The loss is the sum of token losses over the global count of valid
tokens, so any split over devices and micro-batches gives the same mean.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import models
from meshlab import compat
from meshlab import rules as rules_mod
from meshlab.parallel import grad_sync
from meshlab.layout import Layout, batch_spec, is_spec, only_axes  # noqa: F401 (batch_spec: the step's batch placement, read as step.batch_spec)
from meshlab.mesh import entry_axes
from meshlab.parallel.context import zigzag_batch
from models import ModelDef

BATCH_KEYS = ("tokens", "labels", "positions", "segment_ids")


class LossScaleConfig(NamedTuple):
    growth_interval: int = 200
    factor: float = 2.0


def _axes_in(spec: P, axes) -> list[tuple[int, tuple[str, ...]]]:
    """(dim, axes of `axes` that shard dim) for each dim of a spec."""
    out = []
    for dim, entry in enumerate(spec):
        kept = tuple(a for a in entry_axes(entry) if a in axes)
        if kept:
            out.append((dim, kept))
    return out


def make_loss_and_grads(md: ModelDef, rules, mesh, microbatches: int, packed: bool = False, pipeline=None,
                        layout: Layout | None = None):
    """(params, batch, scale) -> (loss, grads reduced onto the optimizer's sharding, valid tokens). A mesh with
    `stage` > 1 runs the rule file's pipeline schedule instead of the micro-batch scan; `pipeline`
    ({schedule, virtual}) forces one, e.g. on a 1-stage mesh to measure the executor itself. `layout`:
    the step's own (built here when not given). Traced by itself, it needs `layout.active()` (Layout.jit)."""
    if pipeline is not None or mesh.shape["stage"] > 1:
        return _pipelined(md, rules, mesh, microbatches, packed, pipeline, layout)
    layout = layout or Layout.build(md, rules, mesh)
    manual = layout.manual
    store, acc = layout.params, layout.grads
    red = layout.optimizer   # the reduced gradient: the optimizer's shards
    is_p = is_spec
    treedef = jax.tree.structure(store, is_leaf=is_p)
    leaves = list(zip(*(treedef.flatten_up_to(t) for t in (store, acc, red, md.abstract))))
    # Per leaf, the reductions at the weight's use (grad_sync): zero2 reduce-scatters every
    # micro-batch; dp / zero1 reduce in the last micro-batch only (DDP's no_sync before it).
    plans = [grad_sync.scatter_plan(_axes_in(st, manual), _axes_in(ac, manual), len(ab.shape))
             for st, ac, _, ab in leaves]
    # Final ties on the layer leaves only: each is used once per layer, so the carried sum is added
    # once (a tied embedding is used twice); the others are reduced after the backward (finish).
    layered = [bool(n) and n[0] == "layers" for n in treedef.flatten_up_to(md.names)]
    finals = [() if pl or not lay else grad_sync.final_plan(_axes_in(ac, manual), _axes_in(rd, manual), manual,
                                                            len(ab.shape))
              for pl, lay, (_, ac, rd, ab) in zip(plans, layered, leaves)]
    sinks = [_local_shape(ab.shape, only_axes(rd if fp else ac, manual), mesh)
             for fp, (_, ac, rd, ab) in zip(finals, leaves)]
    names = treedef.flatten_up_to(md.names)
    per_step = rules.strategies.get("fsdp_gather") == "per_step" and rules.state["params"] == "sharded" and bool(manual)
    if per_step and any("experts" in n for n in names):
        raise rules_mod.RulesError(f"{rules.path}: `fsdp_gather: per_step` with expert weights is not implemented; "
                                   "use fsdp_gather: per_layer")

    def local(params, batch, scale):
        # Local rows: [b_local, s] -> [k, b_local/k, s]; every micro-batch is a slice of every device's rows.
        mbs = {k: v.reshape(microbatches, v.shape[0] // microbatches, *v.shape[1:]) for k, v in batch.items()}
        n_valid = jnp.sum(batch["labels"] >= 0).astype(jnp.float32)
        n_valid = jax.lax.psum(n_valid, manual) if manual else n_valid
        rows = batch["tokens"].shape[0] * math.prod(mesh.shape[a] for a in manual)   # global batch rows

        def loss_fn(params, mb):
            model = md.bind(params)
            # Unpacked data: no segment mask at all (cheaper, and cuDNN takes none).
            h, aux = models.hidden_and_aux(model, mb["tokens"], mb["positions"], mb["segment_ids"] if packed else None)
            loss_sum = model.loss_sum(h, mb["labels"])
            ce = loss_sum / jnp.maximum(n_valid, 1.0) * scale
            # Auxiliary terms (MoE router losses) are sums over rows: over the global row count they
            # are the same mean on any mesh. Reported apart; `loss` stays the cross-entropy.
            return ce + aux.pop("loss", 0.0) / rows * scale, (ce, aux)

        def micro(carry, mb, last=False):
            # A tied leaf differentiates a sink of its reduced shape; the weight's use reduces its
            # gradient into it inside the backward layer scan (grad_sync). In the last micro-batch
            # the dp / zero1 leaves carry the earlier micro-batches' sum in, and come out reduced.
            ties = [(pl, None) if pl else (fp, True) if last and fp else None for pl, fp in zip(plans, finals)]
            if not any(ties):
                (_, loss_aux), g = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
                return jax.tree.map(jnp.add, carry, g), loss_aux
            p_l, c_l = treedef.flatten_up_to(params), treedef.flatten_up_to(carry)
            diff = [jnp.zeros(sh, jnp.float32) if t else p for p, t, sh in zip(p_l, ties, sinks)]

            def tied_loss(diff, mb):
                used = [grad_sync.Tied(p, d, c if t[1] else None, t[0]) if t else d
                        for p, d, c, t in zip(p_l, diff, c_l, ties)]
                return loss_fn(treedef.unflatten(used), mb)
            (_, loss_aux), g = jax.value_and_grad(tied_loss, has_aux=True)(diff, mb)
            g = [g_ if t and t[1] else c + g_ for g_, c, t in zip(g, c_l, ties)]   # the final ties hold the sum
            return treedef.unflatten(g), loss_aux

        zeros = treedef.unflatten([jnp.zeros(_local_shape(ab.shape, only_axes(ac, manual), mesh), jnp.float32)
                                   for _, ac, _, ab in leaves])
        if per_step:
            # fsdp_gather: per_step: every weight gathered whole (fp32) once, the micro-batches
            # differentiate the whole copy and accumulate whole gradients, reduced once below.
            with jax.named_scope("collectives"):
                whole = treedef.unflatten([rules_mod.gather_manual(p, n)
                                           for p, n in zip(treedef.flatten_up_to(params), names)])

            def micro_whole(carry, mb):
                (_, loss_aux), g = jax.value_and_grad(loss_fn, has_aux=True)(whole, mb)
                return jax.tree.map(jnp.add, carry, g), loss_aux
            with rules_mod.whole_params():
                grads, (losses, aux) = jax.lax.scan(micro_whole, jax.tree.map(jnp.zeros_like, whole), mbs)
        elif any(finals):   # dp / zero1: the last micro-batch apart, its backward reduces per layer
            grads = zeros
            if microbatches > 1:
                grads, early = jax.lax.scan(micro, zeros, jax.tree.map(lambda v: v[:-1], mbs))
            grads, last_aux = micro(grads, jax.tree.map(lambda v: v[-1], mbs), last=True)
            losses, aux = jax.tree.map(lambda b: b[None], last_aux)
            if microbatches > 1:
                losses, aux = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), early, (losses, aux))
        else:
            grads, (losses, aux) = jax.lax.scan(micro, zeros, mbs)

        def finish(g, ac, rd):
            # The leaves no final tie reduced (embedding, final norm): zero1 reduce-scatters onto its
            # optimizer shards (the params all-gathered after the update: one all-reduce's bytes).
            reduced = {a for _, ax in _axes_in(ac, manual) for a in ax}
            for dim, axes in _axes_in(rd, manual):
                axes = tuple(a for a in axes if a not in reduced)
                if axes:
                    g = jax.lax.psum_scatter(g, axes if len(axes) > 1 else axes[0], scatter_dimension=dim, tiled=True)
                    reduced |= set(axes)
            rest = tuple(a for a in manual if a not in reduced)
            return jax.lax.psum(g, rest) if rest else g

        if manual:   # no-op where a final tie reduced already (finish then finds nothing left)
            with jax.named_scope("collectives"):   # per_step: whole gradients, scattered onto the shards
                grads = treedef.unflatten([finish(g, P(), rd) if per_step else g if fp else finish(g, ac, rd)
                                           for g, fp, (_, ac, rd, _) in zip(treedef.flatten_up_to(grads), finals, leaves)])
        loss = jnp.sum(losses)
        loss = jax.lax.psum(loss, manual) if manual else loss
        aux = jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)
        aux = jax.lax.psum(aux, manual) if manual else aux
        return loss / scale, grads, n_valid, models.aux_metrics(aux, rows)

    if not manual:
        return local

    def sharded(params, batch, scale):
        in_specs = (jax.tree.map(lambda s: only_axes(s, manual), store, is_leaf=is_p),
                    {k: only_axes(layout.batch, manual) for k in batch}, P())
        out_specs = (P(), jax.tree.map(lambda s: only_axes(s, manual), red, is_leaf=is_p), P(), P())

        def body(params, batch, scale):
            with rules_mod.manual_axes(manual, rules, mesh):
                return local(params, batch, scale)
        return compat.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual)(
            params, batch, scale)
    return sharded


def stage_fns(md: ModelDef, packed: bool = False):
    """The model cut where a pipeline stage needs it: embedding, one layer, final norm + loss."""
    from meshlab.parallel.pipeline import StageFns
    model = md.bind(md.abstract)
    if not hasattr(model, "layer_fn") or hasattr(model, "hidden_and_aux"):
        raise ValueError(f"model {md.cfg.name!r} has no pipeline stages (its auxiliary losses or its layers do not "
                         "split into embed_tokens / layer_fn / head_loss); train it on a mesh with stage=1"
                         + (", e.g. under ep, fsdp_ep or fsdp_tp_ep" if hasattr(md.cfg, "n_experts") else ""))
    # Built per call, inside the stage's manual region: the remat wrapper reads the active rules
    # (strategies.fsdp_gather decides whether gathered weights are saved for the backward).
    return StageFns(embed=lambda params, tokens: md.bind(params).embed_tokens(tokens),
                    layer=lambda w, x, positions, seg: model.layer_fn()(w, x, positions, seg if packed else None),
                    head=lambda params, x, labels: md.bind(params).head_loss(x, labels),
                    stream=model.place_stream)


def _pipelined(md: ModelDef, rules, mesh, microbatches: int, packed: bool, pipeline, layout: Layout | None):
    from meshlab.parallel.pipeline import runner
    if pipeline is None and not rules.strategies.get("pipeline"):
        raise rules_mod.RulesError(f"{rules.path}: the mesh has stage={mesh.shape['stage']} but the rule file names no "
                                   "`strategies.pipeline`; add e.g. `pipeline: {schedule: 1f1b, virtual: 1}` or use "
                                   "stage=1")
    if rules.strategies.get("attention", "plain") != "plain":
        raise rules_mod.RulesError(f"{rules.path}: a pipeline with `attention: {rules.strategies['attention']}` "
                                   "(context parallelism) is not implemented; use attention: plain")
    if rules.strategies.get("fsdp_gather") == "per_step":
        raise rules_mod.RulesError(f"{rules.path}: a pipeline with `fsdp_gather: per_step` is not implemented; use "
                                   "per_layer (each layer's weights gathered per micro-batch) or keep")
    sched = runner.schedule_for(rules, mesh, microbatches, md.cfg.n_layers, pipeline)
    layout = layout or Layout.build(md, rules, mesh)
    runner.check_order(layout.layer_order, sched, md.cfg.n_layers, rules)
    return runner.make_loss_and_grads(stage_fns(md, packed), md.names, layout.params, layout.grads, rules, mesh,
                                      layout.batch, microbatches, sched)


def _local_shape(shape, spec, mesh):
    shape = list(shape)
    for dim, entry in enumerate(spec):
        shape[dim] //= math.prod(mesh.shape[a] for a in entry_axes(entry))
    return tuple(shape)


def make_train_step(md: ModelDef, rules, mesh, tx, state_shardings, *, microbatches: int = 1,
                    loss_scale: LossScaleConfig | None = None, packed: bool = False, pipeline=None,
                    layout: Layout | None = None):
    """The jitted step, traced and run under its own rules and mesh (Layout.jit): callers install
    nothing. `loss_scale` turns on fp16 dynamic loss scaling; `packed` applies the batch's segment
    ids (documents packed into one row) to attention; `pipeline` forces the pipeline executor
    (make_loss_and_grads); `layout`: the one the state's shardings came from (built when not given)."""
    layout = layout or Layout.build(md, rules, mesh)
    loss_and_grads = make_loss_and_grads(md, rules, mesh, microbatches, packed, pipeline, layout=layout)
    acc_shardings = layout.shardings("optimizer")   # reduced grads, as the update takes them

    n_context = mesh.shape["context"]
    zigzag = rules.strategies["attention"] == "ring" and n_context > 1

    def step(state, batch):
        if zigzag:
            # Ring attention's causal load balance: device i holds sequence chunks i and 2n-1-i.
            # Tokens, labels, positions and segment ids move together, so RoPE and the loss
            # (a sum over tokens) are unchanged; only int32 [B, S] arrays are permuted.
            batch = zigzag_batch(batch, n_context)
        scale = state["loss_scale"]["scale"] if loss_scale else jnp.float32(1.0)
        loss, grads, n_valid, *aux = loss_and_grads(state["params"], batch, scale)   # aux: {name: scalar} or none
        grads = jax.lax.with_sharding_constraint(grads, acc_shardings)
        if loss_scale:
            grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        with jax.named_scope("optimizer"):
            updates, new_opt = tx.update(grads, state["opt"], state["params"])
            new_params = optax.apply_updates(state["params"], updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = dict(state, step=state["step"] + 1, params=keep(new_params, state["params"]),
                         opt=keep(new_opt, state["opt"]))
        if loss_scale:
            ls = state["loss_scale"]
            good = jnp.where(finite, ls["good_steps"] + 1, 0)
            grow = good >= loss_scale.growth_interval
            new_scale = jnp.where(finite, jnp.where(grow, ls["scale"] * loss_scale.factor, ls["scale"]),
                                  ls["scale"] / loss_scale.factor)
            new_state["loss_scale"] = {"scale": new_scale, "good_steps": jnp.where(grow, 0, good)}
        metrics = {"loss": loss, "grad_norm": grad_norm, "valid_tokens": n_valid, "finite": finite}
        if loss_scale:
            metrics["loss_scale"] = scale
        metrics.update(aux[0] if aux else {})
        return new_state, metrics

    batch_shardings = {k: layout.batch_sharding for k in BATCH_KEYS}
    return layout.jit(step, in_shardings=(state_shardings, batch_shardings),
                      out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
