"""The training loop: set up mesh, rules, model, optimizer, data; run; write the run directory."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshlab import rules as rules_mod
from meshlab.mesh import make_mesh, format_sizes
from meshlab.plan import account
from meshlab.train import data as data_mod
from meshlab.train.config import TrainConfig, to_yaml
from meshlab.train.metrics import MetricsWriter, Progress, plot_loss
from meshlab.train.optimizer import make_optimizer, schedule
from meshlab.train.peak import measured_matmul_flops
from meshlab.train.state import init_state, model_def, state_specs, to_shardings
from meshlab.train.step import LossScaleConfig, make_train_step

DATASHEET_PEAK = 989e12  # H100/H200 dense bf16, the datasheet figure MFU is also reported against


@dataclasses.dataclass
class Trainer:
    cfg: TrainConfig
    mesh: Any
    rules: rules_mod.Rules
    md: Any
    tx: Any
    shardings: Any
    step_fn: Any
    batches: Any
    rows: range

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.data.global_batch * self.cfg.data.seq_len


def load_batches(cfg: TrainConfig, split: str = "train"):
    if cfg.data.corpus == "stdlib":
        data_dir = data_mod.prepare_stdlib(cfg.data.data_dir, cfg.data.max_bytes)
    else:
        data_dir = Path(cfg.data.corpus)
    path = Path(data_dir) / f"{split}.bin"
    if not path.exists():
        raise FileNotFoundError(f"token file {path} not found; prepare the data first (scripts/prepare_data.py)")
    windows = data_mod.TokenWindows(path, cfg.data.seq_len)
    return data_mod.GlobalBatches(windows, cfg.data.global_batch, cfg.data.seed, cfg.data.segment_docs)


def build_trainer(cfg: TrainConfig, devices=None) -> Trainer:
    rules = rules_mod.load_rules(cfg.rules)
    mesh = make_mesh(cfg.mesh if cfg.mesh else rules.mesh, devices)
    rules.check_batch(cfg.data.global_batch, mesh, cfg.data.microbatches)
    md = model_def(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.steps, md.names)
    fp16 = cfg.model.dtype == "float16"
    shardings = to_shardings(mesh, state_specs(md, rules, mesh, tx, fp16))   # validates every spec
    loss_scale = LossScaleConfig(growth_interval=cfg.loss_scale_growth) if fp16 else None
    step_fn = make_train_step(md, rules, mesh, tx, shardings, microbatches=cfg.data.microbatches,
                              loss_scale=loss_scale)
    # This process's rows of each global batch (all of them in a single-process run).
    per_proc = cfg.data.global_batch // jax.process_count()
    rows = range(jax.process_index() * per_proc, (jax.process_index() + 1) * per_proc)
    return Trainer(cfg, mesh, rules, md, tx, shardings, step_fn, load_batches(cfg), rows)


def device_batch(tr: Trainer, host_batch: dict) -> dict:
    """Host rows -> global sharded arrays (each process contributes its own rows)."""
    sharding = tr.step_fn_batch_sharding if hasattr(tr, "step_fn_batch_sharding") else None
    from meshlab.train.step import batch_spec
    from jax.sharding import NamedSharding
    sharding = NamedSharding(tr.mesh, batch_spec(tr.rules, tr.mesh))
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in host_batch.items()}
    shape = (tr.cfg.data.global_batch, tr.cfg.data.seq_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in host_batch.items()}


def train(cfg: TrainConfig, devices=None, progress: bool = True, write: bool = True) -> dict:
    """Run `cfg.steps` steps; returns {"losses": [...], "state": ..., "run_dir": ...}."""
    tr = build_trainer(cfg, devices)
    run_dir = Path(cfg.run_dir)
    is_main = jax.process_index() == 0 and write
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    writer = MetricsWriter(run_dir, enabled=is_main)
    lr_at = schedule(cfg.optim, cfg.steps)
    flops_tok = account.train_flops_per_token(cfg.model, cfg.data.seq_len)
    with rules_mod.use_rules(tr.rules, tr.mesh):
        peak = measured_matmul_flops(tr.mesh)
        if progress and is_main:
            print(f"meshlab: {cfg.model.name} ({account.param_count(tr.md):,} params), rules {tr.rules.name}, "
                  f"mesh {format_sizes(dict(tr.mesh.shape))} on {tr.mesh.devices.size} {jax.default_backend()} devices")
            print(f"  {account.mfu_formula(cfg.model, cfg.data.seq_len)}")
            print(f"  peak = measured matmul rate {peak / 1e12:.3f} TFLOP/s (all devices); datasheet {DATASHEET_PEAK / 1e12:.0f}")
        state = init_state(tr.md, tr.tx, tr.shardings, cfg.seed, cfg.model.dtype == "float16")
        losses, rows_out = [], []
        bar = Progress(cfg.steps, enabled=progress)
        batches = tr.batches.iterator(0, cfg.steps, tr.rows)
        pending = None
        t_prev = time.perf_counter()

        def record(step_done, metrics, step_ms):
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            tok_s = tr.tokens_per_step / (step_ms / 1e3)
            row = {"step": step_done, "loss": m["loss"], "grad_norm": m["grad_norm"],
                   "lr": float(lr_at(step_done - 1)), "tokens_per_s": tok_s, "mfu": tok_s * flops_tok / peak,
                   "mfu_datasheet": tok_s * flops_tok / (DATASHEET_PEAK * tr.mesh.devices.size),
                   "step_ms": step_ms}
            if not m["finite"]:
                if cfg.on_nonfinite == "stop":
                    raise FloatingPointError(f"non-finite loss or gradient at step {step_done}; the update was "
                                             "not applied. Lower optim.lr, or set on_nonfinite=skip")
            losses.append(m["loss"])
            last = step_done == cfg.steps
            if step_done == 1 or last or step_done % cfg.log_every == 0:
                writer.write(row)
                rows_out.append(row)
                bar.update(row, force_line=(step_done % (cfg.log_every * 5) == 0) or last or step_done == 1)
            return row

        for i in range(cfg.steps):
            batch = device_batch(tr, next(batches))
            state, metrics = tr.step_fn(state, batch)
            if pending is not None:   # one step late: step i-1's numbers while step i runs
                now = time.perf_counter()
                record(i, pending, (now - t_prev) * 1e3)
                t_prev = now
            pending = metrics
        jax.block_until_ready(state)
        record(cfg.steps, pending, (time.perf_counter() - t_prev) * 1e3)
        bar.close()
    writer.close()
    result = {"losses": losses, "state": state, "run_dir": run_dir, "rows": rows_out, "trainer": tr}
    if is_main:
        plot_loss(run_dir, rows_out)
        if cfg.sample_tokens:
            result["sample"] = write_sample(tr, state, run_dir)
    return result


def write_sample(tr: Trainer, state, run_dir: Path) -> str:
    from meshlab.infer.sample import sample_tokens
    tok = data_mod.ByteTokenizer()
    params = jax.device_get(state["params"])   # the tiny model, gathered for a single-device sample
    prompt = tok.encode(tr.cfg.sample_prompt)
    ids = sample_tokens(tr.md, params, prompt, tr.cfg.sample_tokens, tr.cfg.data.seq_len * 2, seed=tr.cfg.seed)
    text = tr.cfg.sample_prompt + tok.decode(ids)
    (run_dir / "sample.txt").write_text(text)
    return text
