"""Throughput measurement of the real train step on random tokens (scripts/bench_train.py and
scripts/bench_scaling.py call these): build, size the batch from the compiled program, time."""
from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from meshlab.layout import Layout, to_shardings
from meshlab.train.optimizer import OptimConfig, make_optimizer
from meshlab.train.state import abstract_state, init_state, state_specs
from meshlab.train.step import make_train_step
from models import model_def


def config_shape(config: str, overrides=()) -> tuple[str, int, int]:
    """(model name, batch, seq) of a config and key=value overrides, read without starting a JAX
    backend (load_config(resolve=False)), so that a torch peer run next gets the whole GPU."""
    from meshlab.train.config import load_config
    cfg = load_config(config, list(overrides), resolve=False)
    return cfg.model.name, cfg.data.global_batch, cfg.data.seq_len


def sample_tokens(kind: str, vocab: int, shape, seed: int = 0):
    """int32 tokens of `shape`: "random", uniform over the vocabulary (every id about once: no repeats
    in the embedding gradient's scatter), or "text", the start of train.py's embedded corpus (the files
    of meshlab.train.data.stdlib_files as byte ids, EOD between them; a few hundred ids, the most frequent
    thousands of times a batch)."""
    n = int(np.prod(shape))
    if kind == "random":
        return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32).reshape(shape)
    if kind != "text":
        raise ValueError(f"tokens={kind!r} must be random or text")
    from meshlab.tokenizer import EOD
    from meshlab.train.data import stdlib_files
    docs, total = [], 0
    for path in stdlib_files():
        docs.append(np.append(np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32), EOD))
        total += len(docs[-1])
        if total >= n:
            break
    return np.resize(np.concatenate(docs), n).astype(np.int32).reshape(shape)


def build(cfg, rules, mesh, batch, seq, tokens="random"):
    """(model def, optimizer, state shardings, jitted step, a sharded batch of `tokens`: sample_tokens)."""
    md = model_def(cfg)
    tx = make_optimizer(OptimConfig(lr=1e-4, warmup_steps=2), 100, md.names)
    layout = Layout.build(md, rules, mesh)
    sh = to_shardings(mesh, state_specs(md, rules, mesh, tx, False, layout=layout))
    step = make_train_step(md, rules, mesh, tx, sh, layout=layout)   # traced under its own rules and mesh
    tokens = sample_tokens(tokens, cfg.vocab_size, (batch, seq + 1))
    host = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": np.zeros((batch, seq), np.int32),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()}
    return md, tx, sh, step, {k: jax.device_put(v, layout.batch_sharding) for k, v in host.items()}


def program_memory(step, md, tx, sh, batch, compiled=None) -> tuple[int, int, int]:
    """(arguments, temporaries, whole program) bytes per device from the compiled program."""
    compiled = compiled or step.lower(abstract_state(md, tx, sh, False), batch).compile()
    m = compiled.memory_analysis()
    whole = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return m.argument_size_in_bytes, m.temp_size_in_bytes, whole


def pick_batch(cfg, rules, mesh, seq, hbm_bytes, budget=0.80, multiple=1):
    """One compile at 2 x `multiple` rows; its temporaries per row (an upper bound: they include
    fixed buffers) set the largest batch keeping arguments + temporaries under `budget` of HBM."""
    rows = 2 * multiple
    md, tx, sh, step, b = build(cfg, rules, mesh, rows, seq)
    args, temp, _ = program_memory(step, md, tx, sh, b)
    per_row = max(temp / rows, 1)
    batch = int((budget * hbm_bytes - args) // per_row) // multiple * multiple
    return max(multiple, min(batch, 64 * multiple)), (args, temp, per_row)


class StepRunner:
    """One variant's compiled step, state and batch, kept so that it can be timed again: `time()` per
    round, variants alternating (bench_train.py --rounds), the clock drift between them shared."""

    def __init__(self, cfg, rules, mesh, batch, seq, tokens="random"):
        md, tx, sh, jitted, self.batch = build(cfg, rules, mesh, batch, seq, tokens)
        # One compile: its memory analysis is this program's own footprint (the allocator's peak is
        # process-wide across variants), and it runs the steps.
        self.step = jitted.lower(abstract_state(md, tx, sh, False), self.batch).compile()
        _, _, self.program_bytes = program_memory(jitted, md, tx, sh, self.batch, compiled=self.step)
        self.state = init_state(md, tx, sh, 0, False)
        try:
            self.state, m = self.step(self.state, self.batch)       # first step
        except (TypeError, ValueError):     # arguments the compiled program refuses (checked before it runs)
            self.step = jitted
            self.state, m = self.step(self.state, self.batch)
        self.loss = float(m["loss"])

    def time(self, steps: int) -> float:
        """Median seconds of `steps` steps, each synchronised (a clean per-step time)."""
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            self.state, m = self.step(self.state, self.batch)
            self.loss = float(m["loss"])
            times.append(time.perf_counter() - t)
        if not np.isfinite(self.loss):
            raise FloatingPointError(f"non-finite loss {self.loss}")
        return float(np.median(times))

    def profile(self, profile_dir, steps: int = 2):
        """A Perfetto trace of `steps` more steps, the program's text beside it (the kernel table names
        each fusion's shape and root op)."""
        Path(profile_dir).mkdir(parents=True, exist_ok=True)
        if hasattr(self.step, "as_text"):
            (Path(profile_dir) / "step.hlo.txt").write_text(self.step.as_text())
        with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
            for _ in range(steps):
                self.state, m = self.step(self.state, self.batch)
            float(m["loss"])

    def close(self):
        self.state = None


def time_steps(cfg, rules, mesh, batch, seq, steps):
    """(tokens/s, median step s, last loss, program bytes per device) of one variant on random tokens,
    timed once (bench_train.py keeps a StepRunner to time it again, profile it or feed it text)."""
    runner = StepRunner(cfg, rules, mesh, batch, seq)
    dt = runner.time(steps)
    loss, program_bytes = runner.loss, runner.program_bytes
    runner.close()
    return batch * seq / dt, dt, loss, program_bytes


# torch's own GEMM rate on the same card, the reference the measured JAX rate is held to (within 5%):
# bf16 a @ b at 8192^3, warmed, 10 launches per CUDA-event timing, median of 5.
TORCH_GEMM = r"""
import json, torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    c = a @ b
torch.cuda.synchronize()
times = []
for _ in range(5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        c = a @ b
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / 10)
times.sort()
print(json.dumps({"tflops": 2 * n ** 3 / times[len(times) // 2] / 1e12, "device": torch.cuda.get_device_name()}))
"""


def torch_gemm_tflops(timeout: float = 120) -> dict:
    """{"tflops", "device"} from torch in its own process (it must not share JAX's allocator), or {"error"}."""
    import json
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", TORCH_GEMM], capture_output=True, text=True, timeout=timeout)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": (out.stderr or out.stdout)[-300:]}
    except Exception as e:   # no torch, no GPU: the JAX figure stands alone
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def torch_peer(model: str, batch: int, seq: int, extra=(), timeout: float = 300, runner=None) -> dict:
    """scripts/bench_scaling_torch.py's JSON row for torch FSDP2 on GPU 0 at this shape (tokens_per_s_per_gpu,
    step_ms, ...; `extra`: e.g. --float8), or {"error"}. Its own process: call it before this process
    starts a JAX backend. runner(cmd, timeout) -> stdout (tests pass their own)."""
    import json
    import subprocess
    import sys
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "bench_scaling_torch.py"),
           "--gpus", "1", "--modes", "fsdp2", "--no-collectives", "--model", model, "--batch", str(batch),
           "--seq", str(seq), *extra]
    runner = runner or (lambda c, t: subprocess.run(c, capture_output=True, text=True, timeout=t).stdout)
    try:
        rows = [json.loads(x) for x in runner(cmd, timeout).splitlines() if x.startswith("{")]
    except Exception as e:   # a hung or failed peer is a row that says so, not a lost benchmark
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    rows = [r for r in rows if "tokens_per_s_per_gpu" in r or "error" in r]
    return rows[-1] if rows else {"error": "no JSON row"}
