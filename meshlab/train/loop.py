"""The training loop: set up mesh, rules, model, optimizer, data; run; write the run directory.

Runs survive: checkpoints every `checkpoint.every` steps and at the end (async, sharded), resume
with `checkpoint.resume=latest|STEP` onto any mesh or rule file, SIGTERM/Ctrl-C save and exit,
a NaN/Inf stops the run (or skips the step) and is never checkpointed, validation loss on
val.bin, an optional profiler window, metrics.jsonl appended across resumes."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import models
from meshlab import rules as rules_mod
from meshlab.checkpoint import corpus_tokenizer, write_run_tokenizer
from meshlab.layout import Layout, to_shardings
from meshlab.parallel.pipeline.layout import reorder
from meshlab.mesh import make_mesh, format_sizes
from meshlab.peak import measured_gemm_flops, mfu, peak_flops
from meshlab.profile_summary import ProfileWindow
from meshlab.train import data as data_mod
from meshlab.train import distributed
from meshlab.train import fit, resume
from meshlab.train.config import TrainConfig, to_yaml
from meshlab.train.metrics import MetricsWriter, Progress, plot_loss, read_metrics, this_run
from meshlab.train.optimizer import host_schedule, make_optimizer
from meshlab.train.state import abstract_state, state_specs
from meshlab.train.step import BATCH_KEYS, LossScaleConfig, make_train_step
from models import model_def

STEADY_FROM = 10   # the steady-state rate is the median over steps >= this (compilation and warm-up before)


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
    notes: list = dataclasses.field(default_factory=list)   # startup lines: auto choices, memory check
    layout: Layout | None = None   # the step's specs (state shardings, batch), built once in build_trainer

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
    meta = check_corpus(cfg, Path(data_dir))
    if split == "val" and path.stat().st_size == 0:
        raise ValueError(f"val.bin of {data_dir} is empty, so there is nothing to validate on (val.every="
                         f"{cfg.val.every}); prepare the corpus with --val-fraction > 0 (and enough documents for "
                         "at least one to go to validation), or set val.every=0")
    windows = data_mod.TokenWindows(path, cfg.data.seq_len, dtype=meta.get("dtype", "uint16"))
    return data_mod.GlobalBatches(windows, cfg.data.global_batch, cfg.data.seed, cfg.data.segment_docs,
                                  eod_id=meta.get("eod_id", data_mod.EOD))


def check_corpus(cfg: TrainConfig, data_dir: Path) -> dict:
    """The prepared corpus must fit the model's vocabulary; returns its metadata ({} if none)."""
    meta_path = data_dir / "meta.json"
    if not meta_path.exists():
        return {}
    import json
    meta = json.loads(meta_path.read_text())
    if meta.get("vocab_size", 0) > cfg.model.vocab_size:
        raise ValueError(f"{data_dir} was tokenized with {meta['tokenizer']!r} ({meta['vocab_size']} tokens) but "
                         f"the model has vocab_size={cfg.model.vocab_size}; set model.vocab_size={meta['vocab_size']}")
    if meta.get("dtype", "uint16") not in ("uint16", "uint32"):
        raise ValueError(f"{data_dir}/meta.json: token dtype {meta['dtype']!r} must be uint16 or uint32")
    corpus_tokenizer(str(data_dir))   # its tokenizer.json must be there: sample.txt and serving decode with it
    return meta


def build_trainer(cfg: TrainConfig, devices=None) -> Trainer:
    rules = rules_mod.load_rules(cfg.rules)
    mesh = make_mesh(cfg.mesh if cfg.mesh else rules.mesh, devices)
    rules.check_batch(cfg.data.global_batch, mesh, cfg.data.microbatches)
    md = model_def(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.steps, md.names)
    fp16 = cfg.model.dtype == "float16"
    layout = Layout.build(md, rules, mesh)   # validates every spec
    shardings = to_shardings(mesh, state_specs(md, rules, mesh, tx, fp16, layout=layout))
    loss_scale = LossScaleConfig(growth_interval=cfg.loss_scale_growth) if fp16 else None
    step_fn = make_train_step(md, rules, mesh, tx, shardings, microbatches=cfg.data.microbatches,
                              loss_scale=loss_scale, packed=cfg.data.segment_docs, layout=layout)
    # This process's rows of each global batch (all of them in a single-process run).
    per_proc = cfg.data.global_batch // jax.process_count()
    rows = range(jax.process_index() * per_proc, (jax.process_index() + 1) * per_proc)
    return Trainer(cfg, mesh, rules, md, tx, shardings, step_fn, load_batches(cfg), rows,
                   notes=list(getattr(cfg, "auto_notes", [])), layout=layout)


def check_memory(tr: Trainer) -> None:
    """Before anything is written or allocated: trace and lower the step against abstract arrays, so
    that a step that cannot be built (a rule file's strategy refusing the model's shapes, a sharding
    that does not divide) stops the run before its directory is touched. Where the device memory is
    known (not CPU, unless device_memory_gib is set), also compile it and compare its memory analysis
    with the device's (fit.py); the compiled program then runs the steps (no second compile). Without
    it the jitted step's first call reuses this trace and lowering (jax caches both), so the check
    costs nothing. Off where the step is not a jitted function."""
    cfg = tr.cfg
    if not hasattr(tr.step_fn, "lower"):
        return
    limit, source = fit.device_memory(cfg, tr.mesh.devices.flat[0])
    if limit is not None:
        fit.check_state(cfg, tr.md, tr.rules, tr.mesh, limit, source)
    batch = device_batch(tr, tr.batches.batch(0, tr.rows))
    abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in batch.items()}
    state = abstract_state(tr.md, tr.tx, tr.shardings, cfg.model.dtype == "float16")
    if limit is None:
        tr.step_fn.lower(state, abstract_batch)
        return
    try:
        compiled = tr.step_fn.lower(state, abstract_batch).compile()
    except Exception as e:   # XLA autotuning or buffer assignment out of memory: the same one message
        if fit.is_out_of_memory(e):
            raise fit.from_xla_error(cfg, e, limit, source, "compiling the step") from None
        raise
    tr.notes.append(fit.check_compiled(cfg, compiled, limit, source))
    tr.step_fn = _FirstCallFallback(compiled, tr.step_fn)


def check_run_dir(cfg: TrainConfig) -> None:
    """A ValueError, before any work, when the run directory (or checkpoint.dir) cannot be one: a path
    that is a file, or lies under a file or an unwritable directory."""
    paths = [("run_dir", "--run-dir DIR", Path(cfg.run_dir))]
    if cfg.checkpoint.dir:
        paths.append(("checkpoint.dir", "checkpoint.dir=DIR", Path(cfg.checkpoint.dir)))
    for key, flag, path in paths:
        path = path.absolute()
        if path.exists() and not path.is_dir():
            raise ValueError(f"{key} {path} is a file, not a directory; pass a directory ({flag}; a missing one is "
                             "created)")
        parent = next(p for p in path.parents if p.exists()) if not path.exists() else path
        if not parent.is_dir():
            raise ValueError(f"{key} {path} cannot be created: {parent} is a file, not a directory; pass a path "
                             f"under a directory ({flag})")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{key} {path} cannot be written: {parent} is not writable by this user; pass a "
                             f"directory you can write to ({flag})")


def fp8_experts_warning(model_cfg) -> str | None:
    """One line when model.matmul_dtype=float8 meets a mixture of experts: the experts' grouped GEMMs
    (most of its FLOPs) stay in the compute dtype; attention's projections and the shared expert run fp8."""
    if getattr(model_cfg, "matmul_dtype", "") != "float8" or not hasattr(model_cfg, "n_experts"):
        return None
    return (f"meshlab: warning: model.matmul_dtype=float8 on {model_cfg.name}: the routed experts' GEMMs stay "
            f"{model_cfg.dtype} (no fp8 grouped GEMM); attention's projections and the shared expert run fp8")


def pipeline_bubble_warning(tr: Trainer) -> str | None:
    """One line when a pipeline runs fewer micro-batches than it has stages: most of each step is then
    the schedule's bubble. Names the fraction and the data.microbatches that the rule files advise
    (4 x stages, or the largest of 4p, 2p, p that the global batch divides into)."""
    from meshlab.parallel.pipeline.schedules import theory_bubble
    pipeline = tr.rules.strategies.get("pipeline")
    p, m = tr.mesh.shape.get("stage", 1), tr.cfg.data.microbatches
    if not pipeline or p <= 1 or m >= p:
        return None
    virtual = int(pipeline.get("virtual") or 1)
    bubble = theory_bubble(p, m, virtual, pipeline.get("schedule") or "")
    advice = ""
    for k in (4, 2, 1):
        try:
            tr.rules.check_batch(tr.cfg.data.global_batch, tr.mesh, k * p)
        except ValueError:
            continue
        advice = f"; set data.microbatches={k * p}" + (" (the rule file advises >= 4 x stages)" if k == 4 else
                                                        f" (4 x stages={4 * p} needs a larger data.global_batch)")
        break
    if not advice:
        advice = (f"; set data.microbatches={4 * p} (the rule file advises >= 4 x stages) with data.global_batch a "
                  f"multiple of {tr.rules.data_parallel_size(tr.mesh) * 4 * p}")
    return (f"meshlab: warning: rules {tr.rules.name} run a {p}-stage pipeline with data.microbatches={m}: about "
            f"{bubble:.0%} of each step is the pipeline's bubble (stages idle){advice}")


class _FirstCallFallback:
    """Runs the compiled program; should its first call refuse the arguments (a sharding or layout
    it was not compiled for, checked before anything runs or is donated), the jitted step instead."""

    def __init__(self, compiled, jitted):
        self.fn, self.jitted, self.checked = compiled, jitted, False

    def __call__(self, state, batch):
        if self.checked:
            return self.fn(state, batch)
        try:
            out = self.fn(state, batch)
        except (TypeError, ValueError) as e:
            print(f"meshlab: the precompiled step refused its arguments ({str(e)[:200]}); using the jitted one",
                  file=sys.stderr)
            self.fn = self.jitted
            out = self.fn(state, batch)
        self.checked = True
        return out


def device_batch(tr: Trainer, host_batch: dict) -> dict:
    """Host rows -> global sharded arrays (each process contributes its own rows)."""
    sharding = tr.layout.batch_sharding
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in host_batch.items()}
    shape = (tr.cfg.data.global_batch, tr.cfg.data.seq_len)
    return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in host_batch.items()}


def make_eval(tr: Trainer):
    """(params, batch) -> (sum of token losses, valid tokens): the validation forward, no grads,
    traced under the step's rules and mesh (Layout.jit)."""
    from jax.sharding import PartitionSpec as P
    data_sh = tr.layout.batch_sharding
    rep = NamedSharding(tr.mesh, P())

    def loss_sums(params, batch):
        # An interleaved pipeline's state stores chunk order: the forward runs model order (a gather
        # of the layer stack per validation batch, never in the train step).
        model = tr.md.bind(reorder(params, tr.layout.layer_order, None))
        h = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
        return model.loss_sum(h, batch["labels"]), jnp.sum(batch["labels"] >= 0).astype(jnp.float32)
    return tr.layout.jit(loss_sums, in_shardings=(tr.shardings["params"], {k: data_sh for k in BATCH_KEYS}),
                         out_shardings=(rep, rep))


class Validator:
    """Mean loss over the same `cfg.val.batches` global batches of val.bin each time."""

    def __init__(self, tr: Trainer):
        self.tr = tr
        self.fn = make_eval(tr)
        self.batches = load_batches(tr.cfg, "val")

    def __call__(self, params) -> float:
        total, count = 0.0, 0.0
        for k in range(self.tr.cfg.val.batches):
            s, n = self.fn(params, device_batch(self.tr, self.batches.batch(k, self.tr.rows)))
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)


def train(cfg: TrainConfig, devices=None, progress: bool = True, write: bool = True) -> dict:
    """Run up to `cfg.steps` steps; returns {"losses", "state", "run_dir", "rows", "trainer"} and,
    when stopped by a signal, "interrupted": the step saved.

    Everything that can refuse the run (the run directory's path, the rule file and mesh, the step's
    trace and the memory check, the validation data, the multi-process agreement, a resume's step)
    runs before the run directory is written to or its checkpoints are moved, so a run that stops at
    start leaves the directory as it was."""
    if write:
        check_run_dir(cfg)
    tr = build_trainer(cfg, devices)
    check_memory(tr)   # may stop with fit.OutOfMemoryError or a trace error: nothing has been written yet
    validate = Validator(tr) if cfg.val.every > 0 else None
    distributed.check_same_run(to_yaml(cfg))   # multi-process: same config and code everywhere
    run_dir = Path(cfg.run_dir)
    is_main = jax.process_index() == 0 and write
    ckpt = resume.checkpointer(cfg, run_dir) if write and cfg.checkpoint.resume else None
    if ckpt is not None and cfg.checkpoint.resume == "latest":
        try:
            resume.check_resume_step(cfg, ckpt.latest_step(), ckpt)
        except ValueError:
            ckpt.close()
            raise
    for warning in (pipeline_bubble_warning(tr), fp8_experts_warning(cfg.model)):
        if warning and jax.process_index() == 0:
            print(warning, file=sys.stderr, flush=True)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.checkpoint.resume:       # a resume writes it once its checkpoint has restored
            (run_dir / "config.yaml").write_text(to_yaml(cfg))
        write_run_tokenizer(cfg.data.corpus, run_dir)   # serving reads the tokenizer from the run dir
    if write and not cfg.checkpoint.resume:
        resume.set_aside(Path(cfg.checkpoint.dir or run_dir / "checkpoints"))
    if write and ckpt is None:
        ckpt = resume.checkpointer(cfg, run_dir)
    fp16 = cfg.model.dtype == "float16"
    watchdog = distributed.Watchdog(cfg.heartbeat_timeout).start()
    try:
        with resume.StopRequest() as stop:   # the step and eval programs carry their own rules (Layout.jit)
            state, start = resume.start_state(tr, ckpt, fp16)
            if is_main and cfg.checkpoint.resume:
                (run_dir / "config.yaml").write_text(to_yaml(cfg))
            result = _run(tr, state, start, ckpt, stop, run_dir, is_main, progress, watchdog, validate)
    finally:
        watchdog.stop()
        if ckpt is not None:
            ckpt.close()   # waits for async saves of good states, even when the run failed
    if is_main and result["rows"]:
        plot_loss(run_dir, this_run(read_metrics(run_dir)))   # the whole run, across its resumes
    if is_main and cfg.sample_tokens and "interrupted" not in result:
        result["sample"] = write_sample(tr, result["state"], run_dir)
    return result


def _run(tr: Trainer, state, start: int, ckpt, stop: resume.StopRequest, run_dir: Path, is_main: bool,
         progress: bool, watchdog, validate: Validator | None) -> dict:
    cfg = tr.cfg
    writer = MetricsWriter(run_dir, enabled=is_main)
    lr_at = host_schedule(cfg.optim, cfg.steps)
    flops_tok = cfg.model.train_flops_per_token(cfg.data.seq_len)
    ndev = tr.mesh.devices.size
    peak, peak_source = peak_flops(tr.mesh.devices.flat[0], cfg.peak_tflops)
    profiler = ProfileWindow(cfg.profile, run_dir, hlo_text=lambda: _program_text(tr))
    if progress and is_main:
        print(f"meshlab: {cfg.model.name} ({tr.md.param_count():,} params), rules {tr.rules.name}, "
              f"mesh {format_sizes(dict(tr.mesh.shape))} on {ndev} {jax.default_backend()} devices")
        for note in tr.notes:
            print(f"  {note}")
        print(f"  {models.mfu_formula(cfg.model, cfg.data.seq_len)}")
        print(f"  peak = {peak_source}" + (f" x {ndev} devices" if peak else ""))
        if jax.default_backend() == "gpu":   # a figure of its own, not MFU's denominator
            try:
                gemm = f"{measured_gemm_flops(tr.mesh.devices.flat[0]) / 1e12:.0f} TFLOP/s (8192^3, median of 5 x 10)"
            except Exception as e:   # 400 MB it may not find beside a model that fills the device
                gemm = f"not measured ({type(e).__name__})"
            print(f"  bf16 GEMM measured on this device: {gemm}")
        if start:
            print(f"  resumed from step {start} ({ckpt.directory})")
    writer.write({"event": "resume" if start else "start", "step": start, "time": time.time(),
                  "rules": tr.rules.name, "mesh": format_sizes(dict(tr.mesh.shape))})
    losses, rows_out, rates = [], [], []
    bar = Progress(cfg.steps, enabled=progress)
    batches = tr.batches.iterator(start, cfg.steps - start, tr.rows)
    pending, t_prev, done, interrupted = None, time.perf_counter(), start, None

    def first_step_error(e, step_done):
        """e itself, or for an out-of-memory error of the run's first step the one message that says so."""
        if step_done != start + 1 or not fit.is_out_of_memory(e):
            return e
        return fit.from_xla_error(cfg, e, None, "", "running the first step",
                                  written=f"Written so far: {run_dir}/config.yaml and the start row of metrics.jsonl; "
                                          "no checkpoint.")

    def record(step_done, metrics, extra=None):
        # The clock is read after the metrics arrive (the step has finished): read before, the
        # first interval would end at an asynchronous dispatch and report an impossible rate.
        nonlocal t_prev
        try:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        except Exception as e:   # an asynchronous backend (XLA:CPU) reports the first step's OOM here
            raise first_step_error(e, step_done) from None
        now = time.perf_counter()
        step_ms, t_prev = (now - t_prev) * 1e3, now
        tok_s = tr.tokens_per_step / (step_ms / 1e3)
        rates.append((step_done, tok_s))
        row = {"step": step_done, "loss": m["loss"], "grad_norm": m["grad_norm"],
               "lr": lr_at(step_done - 1), "tokens_per_s": tok_s, "mfu": mfu(tok_s, flops_tok, peak, ndev),
               "step_ms": step_ms, **{k: v for k, v in m.items() if k.startswith("moe_")}, **(extra or {})}
        # fp16: an overflow of the scaled loss is routine (the step skips it and halves the scale);
        # only once the scale is down to 1 is a non-finite step the model's own.
        overflow = not m["finite"] and m.get("loss_scale", 0.0) > 1.0
        if overflow:
            row["skipped"] = "fp16 overflow"
        elif not m["finite"]:
            if cfg.on_nonfinite == "stop":
                raise FloatingPointError(f"non-finite loss or gradient at step {step_done}; the update was not "
                                         "applied and no checkpoint of it was written. Lower optim.lr, or set "
                                         "on_nonfinite=skip")
            row["skipped"] = True
            if is_main:
                print(f"meshlab: non-finite loss or gradient at step {step_done}; update skipped", file=sys.stderr)
        losses.append(m["loss"])
        last = step_done == cfg.steps
        if step_done == 1 or last or step_done % cfg.log_every == 0 or extra:
            writer.write(row)
            rows_out.append(row)
            bar.update(row, force_line=(step_done % (cfg.log_every * 5) == 0) or last or step_done == 1)

    for i in range(start, cfg.steps):
        profiler.before(i, state)
        with jax.profiler.StepTraceAnnotation("train", step_num=i):
            try:
                state, metrics = tr.step_fn(state, device_batch(tr, next(batches)))
            except Exception as e:   # the allocator's own OOM at the first step: the same one message
                raise first_step_error(e, i + 1) from None
        if pending is not None:   # one step late: step i's numbers while step i+1 runs
            record(i, pending)
        pending, done = metrics, i + 1
        watchdog.beat(done)
        profiler.after(i, state)
        extra = None
        if validate and done % cfg.val.every == 0:
            with watchdog.paused():
                # The step finishes first, so that the validation pass is timed alone and taken off the
                # step's clock: step_ms (and tokens/s) of a validation step are the step's own.
                jax.block_until_ready(pending)
                t_val = time.perf_counter()
                val_loss = validate(state["params"])
                val_s = time.perf_counter() - t_val
                t_prev += val_s
                extra = {"val_loss": val_loss, "val_ms": val_s * 1e3}
        stopping = stop.requested(done)
        if extra or stopping or (ckpt and ckpt.should_save(done)) or done == cfg.steps:
            # A checkpoint (or a val row) only after this step's own numbers are checked finite.
            record(done, pending, extra)
            pending = None
        if ckpt and (ckpt.should_save(done) or stopping or (done == cfg.steps and cfg.checkpoint.at_end)):
            with watchdog.paused():
                # save() waits for the step (its finiteness check) and copies the state to the host
                # before it returns: taken off the next step's clock and written as its own row.
                t_save = time.perf_counter()
                saved = ckpt.save(done, state, resume.run_meta(tr, done), wait=stopping or done == cfg.steps,
                                  layer_order=tr.layout.layer_order)
                save_s = time.perf_counter() - t_save
                t_prev += save_s
            if saved:
                writer.write({"event": "checkpoint", "step": done, "save_ms": save_s * 1e3})
        if stopping:
            interrupted = done
            break
    if pending is not None:
        record(done, pending)
    jax.block_until_ready(state)
    profiler.close()
    bar.close()
    steady = steady_state(rates, flops_tok, peak, ndev)
    if steady:
        writer.write({"event": "summary", "step": done, **steady})
        if progress and is_main:
            print(f"steady state, steps {steady['from_step']}-{steady['to_step']}: median "
                  f"{steady['tokens_per_s']:,.0f} tokens/s, " + (f"MFU {100 * steady['mfu']:.2f}%" if steady["mfu"]
                                                                 is not None else "MFU n/a"), flush=True)
    writer.close()
    out = {"losses": losses, "state": state, "run_dir": run_dir, "rows": rows_out, "trainer": tr, "step": done,
           "steady": steady}
    if interrupted is not None:
        out["interrupted"] = interrupted
        if ckpt is not None:
            out["checkpoint_dir"] = str(ckpt.directory)
    return out


def steady_state(rates: list, flops_tok: float, peak, ndev: int) -> dict | None:
    """Median tokens/s over the steps numbered >= STEADY_FROM (the first steps hold compilation and
    warm-up); None for a run too short to have any."""
    steady = [r for s, r in rates if s >= STEADY_FROM]
    if not steady:
        return None
    med = float(np.median(steady))
    return {"from_step": max(STEADY_FROM, rates[0][0]), "to_step": rates[-1][0], "tokens_per_s": med,
            "mfu": mfu(med, flops_tok, peak, ndev), "steps_timed": len(steady)}


def _program_text(tr: Trainer) -> str | None:
    """The optimized HLO of the compiled step the loop runs (None when it runs the jitted function)."""
    compiled = getattr(tr.step_fn, "fn", None)
    return compiled.as_text() if hasattr(compiled, "as_text") else None


def write_sample(tr: Trainer, state, run_dir: Path) -> str:
    """run_dir/sample.txt: the prompt and its continuation, in the corpus's tokenizer (the one
    write_run_tokenizer copied into run_dir for serving)."""
    from meshlab.tokenizer import ByteTokenizer, TokenizerJson
    from models.sample import sample_tokens
    src = corpus_tokenizer(tr.cfg.data.corpus)
    tok = ByteTokenizer() if src is None else TokenizerJson(src)
    # Gathered onto one device once (not a host copy passed to every token's call, which would
    # move the whole model host -> device per token).
    params = jax.device_put(reorder(jax.device_get(state["params"]), tr.layout.layer_order, None), jax.devices()[0])
    prompt = tok.encode(tr.cfg.sample_prompt)
    ids = sample_tokens(tr.md, params, prompt, tr.cfg.sample_tokens, tr.cfg.data.seq_len * 2, seed=tr.cfg.seed)
    text = tr.cfg.sample_prompt + tok.decode(ids)
    (run_dir / "sample.txt").write_text(text)
    return text
