"""Throughput measurement of the real train step on random tokens (scripts/bench_train.py and
scripts/bench_scaling.py call these): build, size the batch from the compiled program, time."""
from __future__ import annotations

import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshlab import rules as R
from meshlab.train.optimizer import OptimConfig, make_optimizer
from meshlab.train.state import abstract_state, init_state, model_def, state_specs, to_shardings
from meshlab.train.step import batch_spec, make_train_step


def build(cfg, rules, mesh, batch, seq):
    """(model def, optimizer, state shardings, jitted step, a sharded random batch)."""
    md = model_def(cfg)
    tx = make_optimizer(OptimConfig(lr=1e-4, warmup_steps=2), 100, md.names)
    sh = to_shardings(mesh, state_specs(md, rules, mesh, tx, False))
    step = make_train_step(md, rules, mesh, tx, sh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    host = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": np.zeros((batch, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()}
    sharding = NamedSharding(mesh, batch_spec(rules, mesh))
    return md, tx, sh, step, {k: jax.device_put(v, sharding) for k, v in host.items()}


def program_memory(step, md, tx, sh, batch) -> tuple[int, int, int]:
    """(arguments, temporaries, whole program) bytes per device from the compiled program."""
    m = step.lower(abstract_state(md, tx, sh, False), batch).compile().memory_analysis()
    whole = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return m.argument_size_in_bytes, m.temp_size_in_bytes, whole


def pick_batch(cfg, rules, mesh, seq, hbm_bytes, budget=0.80, multiple=1):
    """One compile at 2 x `multiple` rows; its temporaries per row (an upper bound: they include
    fixed buffers) set the largest batch keeping arguments + temporaries under `budget` of HBM."""
    rows = 2 * multiple
    with R.use_rules(rules, mesh):
        md, tx, sh, step, b = build(cfg, rules, mesh, rows, seq)
        args, temp, _ = program_memory(step, md, tx, sh, b)
    per_row = max(temp / rows, 1)
    batch = int((budget * hbm_bytes - args) // per_row) // multiple * multiple
    return max(multiple, min(batch, 64 * multiple)), (args, temp, per_row)


def time_steps(cfg, rules, mesh, batch, seq, steps, profile_dir=None, profile_steps=2):
    """(tokens/s, median step s, last loss, program bytes per device). With `profile_dir`, a
    Perfetto trace of `profile_steps` more steps is written there after the timed ones."""
    with R.use_rules(rules, mesh):
        md, tx, sh, step, b = build(cfg, rules, mesh, batch, seq)
        # This program's own footprint (the allocator's peak is process-wide across variants).
        _, _, program_bytes = program_memory(step, md, tx, sh, b)
        state = init_state(md, tx, sh, 0, False)
        state, m = step(state, b)           # compile + first step
        float(m["loss"])
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            state, m = step(state, b)
            loss = float(m["loss"])         # sync each step: a clean per-step time
            times.append(time.perf_counter() - t)
        if profile_dir:
            with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
                for _ in range(profile_steps):
                    state, m = step(state, b)
                float(m["loss"])
    if not np.isfinite(loss):
        raise FloatingPointError(f"non-finite loss {loss}")
    dt = float(np.median(times))
    del state
    return batch * seq / dt, dt, loss, program_bytes
