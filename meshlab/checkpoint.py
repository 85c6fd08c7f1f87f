"""Sharded, asynchronous checkpoints of the train state with orbax's CheckpointManager.

A checkpoint step directory holds two items:
  state  the train-state pytree (params, optax state, step, loss scale), written by every
         process for its own shards (OCDBT), restored straight into whatever shardings the
         *new* run asks for (abstract targets), so a different rule file, mesh or process
         count reshards on load without a host copy of the whole state;
  meta   JSON: the step, the resolved config, the data position (the batch is a function of
         the step; the grain iterator state is kept too), a per-leaf fingerprint that is
         checked after a restore, so silently damaged bytes are caught, and `layer_order`
         where the state stored its layer stack in an interleaved pipeline's chunk order (none:
         model order); a restore converts to the order its caller asks for (model order unless
         said), so a checkpoint restores under any rule file (meshlab/parallel/pipeline/layout.py).

Failure rules: orbax writes into a temporary directory and renames it when complete, so an
interrupted save never shows up as a step. A step that exists but fails to restore (damaged
files, missing item, fingerprint mismatch) is moved aside to `corrupt-step-N` -- never
deleted, never overwritten -- and the previous complete step is used instead, with a warning.
Asking for a specific step that is missing or damaged is an error naming what exists. A resume
from a step with later steps after it moves those aside into a sibling directory (the run it
branches away from; `Checkpointer.set_aside_after`), so the new run's saves are never skipped as
"already saved" and a later resume never takes the abandoned run's state.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from meshlab.parallel.pipeline.layout import META_KEY as LAYER_ORDER, reorder_placed

# Tolerance of the fingerprint check, relative to a leaf's sum of |x|: a restore onto another mesh
# sums the same values in another order (float32), which moves either sum by a rounding error of
# each term, i.e. by a fraction of sum |x| -- not of the signed sum, which may be near zero (a
# weight matrix of mean ~0). A damaged chunk moves the sums by far more.
_FINGERPRINT_RTOL = 1e-4
_FINGERPRINT_ATOL = 1e-6


# Written by orbax (0.12) as the last act of a save; a step directory without it is incomplete.
COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
    pass


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(f"meshlab checkpoint: {msg}", file=sys.stderr, flush=True)


@jax.jit
def fingerprint(state) -> jax.Array:
    """Per-leaf (sum, sum of |x|) as one small replicated vector: a cheap integrity check.
    Costs one reduction pass over the state per save and per restore."""
    leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(state)]
    return jnp.stack([jnp.stack([jnp.sum(x), jnp.sum(jnp.abs(x))]) for x in leaves])


def fingerprint_mismatches(have, want) -> list[int]:
    """Indices of the leaves whose fingerprint rows (sum, sum of |x|) differ by more than summing the
    same float32 values in another order can explain: each column within _FINGERPRINT_RTOL of the
    leaf's sum of |x| as stored (damage cannot widen its own tolerance; a NaN is a mismatch).
    Fingerprints of different shapes (another leaf count) mismatch at every leaf."""
    have, want = np.asarray(have, np.float64), np.asarray(want, np.float64)
    if have.shape != want.shape:
        return list(range(max(len(have), len(want))))
    scale = np.abs(want[:, 1:2])
    close = np.abs(have - want) <= _FINGERPRINT_RTOL * scale + _FINGERPRINT_ATOL   # False for a NaN
    return [int(i) for i in np.flatnonzero(~close.all(axis=1))]


def _check_fingerprint(tree, want, what: str) -> None:
    """A CheckpointError naming the first leaf of `tree` whose values do not match `want` (rows of
    `fingerprint`, as written at save time)."""
    have = np.asarray(jax.device_get(fingerprint(tree)), np.float64)
    want = np.asarray(want, np.float64)
    bad = fingerprint_mismatches(have, want)
    if not bad:
        return
    if have.shape != want.shape:
        where = f"{len(want)} leaves stored, {len(have)} restored"
    else:
        names = [jax.tree_util.keystr(path, simple=True, separator=".")
                 for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
        where = f"leaf {names[bad[0]]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
    raise CheckpointError(f"{what} do not match the fingerprint written at save time ({where})")


@jax.jit
def all_finite(state) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class Checkpointer:
    """Save every `every` steps (async) and at the end; keep the last `keep` (and every
    `keep_every`-th); restore the latest complete one or a given step."""

    def __init__(self, directory: str | os.PathLike, every: int = 0, keep: int = 3,
                 keep_every: int = 0, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.every = every
        self._async = async_save
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None,
            keep_period=keep_every if keep_every > 0 else None,
            enable_async_checkpointing=async_save,
            create=True,
            # Leftovers of a save killed half-way are orbax's temporary dirs; removing them
            # at start is safe (they were never a complete step) and keeps the dir tidy.
            cleanup_tmp_directories=True)
        self.mgr = self._open()

    def _open(self):
        return ocp.CheckpointManager(self.directory, options=self._options, item_names=("state", "meta"))

    # -- listing ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Complete steps. A step directory without orbax's commit marker (a save cut short
        on a file system without atomic rename, or a copy gone wrong) is moved aside first."""
        self.mgr.reload()
        steps = self.mgr.all_steps()
        marked = {s for s in steps if (self.directory / str(s) / COMMIT_MARKER).exists()}
        # Only where this orbax writes markers at all (some step has one): an orbax version
        # without them must not have every step declared partial.
        partial = [s for s in steps if s not in marked] if marked else []
        for s in partial:
            _log(f"step {s} has no {COMMIT_MARKER} (its save never finished); moving it aside")
            self._quarantine(s, "partial")
        return sorted(self.mgr.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state, meta: dict[str, Any], wait: bool = False, layer_order=None) -> bool:
        """Start a save of `state` at `step` (async unless `wait`), its layer stack stored in
        `layer_order` (None: model order; recorded in the meta). Refuses a state with a NaN
        or Inf; skips (with a note) a step that already exists rather than overwrite it."""
        if not bool(all_finite(state)):
            raise CheckpointError(f"refusing to save step {step}: the state holds NaN or Inf values "
                                  "(the last good checkpoint is kept)")
        # orbax itself finishes the previous async save before starting the next; waiting here
        # first means the listing below never mistakes that save in flight for a partial one.
        self.mgr.wait_until_finished()
        if step in self.steps():
            _log(f"step {step} already saved in {self.directory}; not overwriting it")
            return False
        meta = dict(meta, step=int(step), saved_at=time.time(),
                    fingerprint=np.asarray(jax.device_get(fingerprint(state))).tolist())
        meta.pop(LAYER_ORDER, None)
        if layer_order is not None:
            meta[LAYER_ORDER] = [int(i) for i in layer_order]
        self.mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
        if wait or not self._async:
            self.wait()
        return True

    def wait(self) -> None:
        self.mgr.wait_until_finished()

    def close(self) -> None:
        self.mgr.wait_until_finished()
        self.mgr.close()

    # -- restoring -------------------------------------------------------------------------
    def restore(self, abstract_state, step: Optional[int] = None, layer_order=None):
        """(state, meta) from `step`, or from the latest complete step (falling back past
        damaged ones). `abstract_state` carries the NEW run's shardings, `layer_order` the
        order it stores the layer stack in (None: model order); the checkpoint's recorded
        order is converted to it (after the fingerprint check, which a reorder cannot move)."""
        state, meta = self._restore_any(abstract_state, step)
        return reorder_placed(state, meta.get(LAYER_ORDER), layer_order, donate=True), meta

    def _restore_any(self, abstract_state, step: Optional[int]):
        steps = self.steps()
        if step is not None:
            if step not in steps:
                raise CheckpointError(f"no complete checkpoint for step {step} in {self.directory}; "
                                      f"complete steps: {steps or 'none'}")
            self._check_same_model(abstract_state, step)
            try:
                return self._restore_one(abstract_state, step)
            except Exception as e:  # noqa: BLE001 - any failure here means the step is unusable
                others = [s for s in steps if s != step]
                hint = (f"Resume from another step ({others}) or without a step (the latest good one)" if others
                        else "It is the only checkpoint: start a fresh run")
                raise CheckpointError(f"checkpoint step {step} in {self.directory} cannot be restored: "
                                      f"{_short(e)}. {hint}") from None
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory} to resume from; start without --resume "
                                  "or point checkpoint.dir at the run's checkpoints")
        self._check_same_model(abstract_state, steps[-1])
        for s in reversed(steps):
            try:
                return self._restore_one(abstract_state, s)
            except Exception as e:  # noqa: BLE001
                _log(f"step {s} is damaged ({_short(e)}); moving it aside and trying the previous one")
                self._quarantine(s, "corrupt")
        raise CheckpointError(f"every checkpoint in {self.directory} is damaged (moved aside as corrupt-step-N); "
                              "start a fresh run")

    def _check_same_model(self, abstract_state, step: int) -> None:
        """A CheckpointError, before anything is read or moved, when the step's stored leaves differ from
        `abstract_state`'s in name or shape (a run resumed with other model dimensions): that is
        another model, not a damaged checkpoint. Unreadable metadata passes, for the restore to judge."""
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.StandardRestore)
        def shapes(tree) -> dict:         # leaf name as orbax writes it (opt.1.0.mu.embed) -> shape
            return {jax.tree_util.keystr(path, simple=True, separator="."): tuple(x.shape)
                    for path, x in jax.tree_util.tree_leaves_with_path(tree)}
        mgr = ocp.CheckpointManager(self.directory, handler_registry=registry)
        try:
            with _absl_errors_only():
                have = shapes(mgr.item_metadata(step)["state"])
        except Exception:  # noqa: BLE001 - damage, which the restore finds and handles
            return
        finally:
            mgr.close()
        want = shapes(abstract_state)
        differ = sorted((k for k in want.keys() | have.keys() if want.get(k) != have.get(k)),
                        key=lambda k: (not k.startswith("params."), k))           # the parameters first
        if differ:
            shown = "; ".join(f"{k}: stored {have.get(k, 'absent')}, this run {want.get(k, 'absent')}"
                              for k in differ[:3])
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} holds another model's state than this run's ({shown}"
                + (f"; {len(differ) - 3} more" if len(differ) > 3 else "") + "). Resume with the model settings the "
                "run was trained with (its config.yaml; drop the model overrides) or start a fresh run in another "
                "run directory; no checkpoint was touched")

    def _restore_one(self, abstract_state, step: int):
        got = self.mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        state, meta = got["state"], got["meta"]
        if meta is None or "fingerprint" not in meta:
            raise CheckpointError("its meta item is missing")
        if int(meta.get("step", -1)) != step:
            raise CheckpointError(f"its meta says step {meta.get('step')}, not {step}")
        _check_fingerprint(state, meta["fingerprint"], "its values")
        return state, meta

    def set_aside_after(self, step: int) -> Optional[Path]:
        """After a resume from `step`: move the later steps (the run this resume branches away from)
        into a sibling directory `<dir>.after-step-<step>-<time>`, itself a checkpoint directory
        (kept, never deleted), so that the new run's saves of those step numbers land and a later
        resume cannot take the old run's state for the new one's. Returns that directory, or None
        when there were no later steps."""
        later = [s for s in self.steps() if s > step]
        if not later:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dst = self.directory.with_name(f"{self.directory.name}.after-step-{step}-{stamp}")
        if jax.process_index() == 0:
            n = 1
            while dst.exists():    # two resumes within a second: never merge into an earlier set
                n += 1
                dst = self.directory.with_name(f"{self.directory.name}.after-step-{step}-{stamp}-{n}")
            dst.mkdir()
            for s in later:
                os.replace(self.directory / str(s), dst / str(s))
            _log(f"resumed from step {step}: the later steps {later} are the run this resume branches away from; "
                 f"moved to {dst} (checkpoint.dir={dst} resumes them)")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"meshlab_set_aside_after_{step}")
        self.mgr.reload()
        return dst

    def _quarantine(self, step: int, why: str) -> None:
        """Move a damaged step out of orbax's sight (kept for inspection, never deleted)."""
        if jax.process_index() == 0:
            src = self.directory / str(step)
            dst = self.directory / f"{why}-step-{step}-{int(time.time())}"
            if src.exists():
                os.replace(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"meshlab_quarantine_{step}")
        self.mgr.reload()


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text[:300]


def read_meta(directory: str | os.PathLike, step: int) -> dict:
    """The JSON meta of a step without touching the arrays (for tools and tests)."""
    path = Path(directory) / str(step) / "meta" / "metadata"
    if not path.exists():
        raise CheckpointError(f"{path} not found")
    return json.loads(path.read_text())


# -- serving: parameters only, and the run's tokenizer ------------------------------------------

def restore_params(directory: str | os.PathLike, abstract_params, step: Optional[int] = None):
    """(params, meta) of a run's checkpoint without the optimizer state, placed as `abstract_params`
    (ShapeDtypeStructs with shardings: one device, or a serving mesh) says, the layer stack in
    model order whatever order the run stored it in.

    Read-only: a damaged step is skipped (never moved), nothing is written. The params' part of the
    fingerprint written at save time is checked: the state's leaves are ordered opt, params, step
    (loss_scale first under fp16), so the params are the rows just before the last.
    """
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no checkpoint directory; train the run first (its checkpoints "
                              "are written at the end and every checkpoint.every steps)")
    steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / COMMIT_MARKER).exists())
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"no complete checkpoint for step {step} in {directory}; complete steps: "
                                  f"{steps or 'none'}")
        steps = [step]
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {directory}")
    with _absl_errors_only():      # orbax warns that a read-only manager saves nothing: true, and not news to a reader
        mgr = ocp.CheckpointManager(directory, item_names=("state", "meta"),
                                    options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    errors = []
    try:
        for s in reversed(steps):
            try:
                return _restore_params_one(mgr, s, abstract_params)
            except Exception as e:  # noqa: BLE001 - any failure means this step is unusable; try the previous
                errors.append(f"step {s}: {_short(e)}")
                _log(f"step {s} cannot be restored for serving ({_short(e)}); trying the previous one")
    finally:
        mgr.close()
    raise CheckpointError(f"no checkpoint in {directory} could be restored: {'; '.join(errors)}")


@contextlib.contextmanager
def _absl_errors_only():
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _restore_params_one(mgr, step: int, abstract_params):
    target = {"params": abstract_params}
    got = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                     partial_restore=True),
        meta=ocp.args.JsonRestore()))
    params, meta = got["state"]["params"], got["meta"]
    if meta is None or "fingerprint" not in meta:
        raise CheckpointError("its meta item is missing")
    n = len(jax.tree.leaves(params))
    _check_fingerprint(params, np.asarray(meta["fingerprint"], np.float64)[-n - 1:-1], "its parameters")
    return reorder_placed(params, meta.get(LAYER_ORDER), None, donate=True), meta


# Files of a tokenizer directory that serving reads (the vocabulary; the chat template and special tokens).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_META = "tokenizer_meta.json"


def corpus_tokenizer(corpus: str) -> Path | None:
    """The tokenizer.json a prepared corpus was tokenized with; None for byte tokens (the stdlib corpus,
    a corpus without meta.json, or one prepared with `byte`). meta.json's path is looked for relative to
    the corpus directory first (prepare_data copies the tokenizer there), then as written; a ValueError
    naming the fix when it is nowhere, since a run on it could be neither sampled nor served."""
    corpus_meta = Path(corpus) / "meta.json"
    if corpus == "stdlib" or not corpus_meta.is_file():
        return None
    spec = json.loads(corpus_meta.read_text()).get("tokenizer", "byte")
    if spec == "byte":
        return None
    for src in (Path(corpus) / spec, Path(spec)):   # an absolute spec makes both the same path
        src = src / "tokenizer.json" if src.is_dir() else src
        if src.is_file():
            return src
    raise ValueError(f"the corpus {corpus} was tokenized with {spec}, which is not there now (looked in {corpus} "
                     "and the current directory); a run on it could not decode its tokens. Copy that tokenizer.json "
                     f"to {Path(corpus) / spec} (or prepare the corpus again with scripts/prepare_data.py, which "
                     "keeps a copy in the corpus directory)")


def write_run_tokenizer(corpus: str, run_dir: str | os.PathLike) -> None:
    """Record the run's tokenizer in its directory, so serving needs only the run directory:
    `tokenizer_meta.json` ({"tokenizer": "byte" | "tokenizer.json", "eod_id", "vocab_size"}) and, for a
    corpus prepared with a tokenizer.json, a copy of it (and of its tokenizer_config.json, if any).
    A corpus without meta.json is taken as byte tokens, as the training data loader does; a corpus
    whose tokenizer.json cannot be found is a ValueError (corpus_tokenizer)."""
    run_dir = Path(run_dir)
    meta = {"tokenizer": "byte", "eod_id": 256, "vocab_size": 257}
    src = corpus_tokenizer(corpus)
    corpus_meta = Path(corpus) / "meta.json"
    if corpus != "stdlib" and corpus_meta.is_file():
        cm = json.loads(corpus_meta.read_text())
        meta.update({k: cm[k] for k in ("eod_id", "vocab_size") if k in cm})
    if src is not None:
        for name in TOKENIZER_FILES:
            f = src if name == "tokenizer.json" else src.with_name(name)
            if f.is_file():
                (run_dir / name).write_bytes(f.read_bytes())
        meta["tokenizer"] = "tokenizer.json"
    (run_dir / TOKENIZER_META).write_text(json.dumps(meta, indent=1))
