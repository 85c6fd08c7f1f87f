"""Typed run configuration: dataclasses, YAML files and `a.b=c` overrides (OmegaConf)."""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

import models
from meshlab.train.optimizer import SCHEDULE_KEYS, OptimConfig


class ConfigError(ValueError):
    pass


@dataclasses.dataclass
class DataConfig:
    corpus: str = "stdlib"        # stdlib (embedded: this interpreter's standard library) or a prepared dir
    data_dir: str = "data/stdlib" # where the token file lives (prepared on first use)
    max_bytes: int = 8_000_000    # cap on the embedded corpus, to keep preparation fast
    seq_len: int = 128
    global_batch: int = 32
    microbatches: int = 1
    seed: int = 0
    segment_docs: bool = False    # packed documents: segment ids + RoPE positions restart per document


@dataclasses.dataclass
class CheckpointConfig:
    dir: str = ""                 # default: RUN_DIR/checkpoints
    every: int = 0                # save every N steps (0: only at the end and on SIGTERM/Ctrl-C)
    keep: int = 3                 # keep the last K
    keep_every: int = 0           # and every M-th step for good (0: none)
    async_save: bool = True       # write in the background while training goes on
    resume: str = ""              # "" (fresh run), "latest", or a step number
    at_end: bool = True           # save after the last step (false: short measuring runs of big models)


@dataclasses.dataclass
class ValConfig:
    every: int = 0                # validation loss on the held-out split every N steps (0: off)
    batches: int = 4              # global batches of val.bin per evaluation (the same ones each time)


@dataclasses.dataclass
class ProfileConfig:
    start_step: int = -1          # first profiled step (-1: no profile)
    num_steps: int = 3
    dir: str = ""                 # default: RUN_DIR/profile (open with TensorBoard or Perfetto)


@dataclasses.dataclass
class TrainConfig:
    model: Any = None             # the architecture's config dataclass (models.preset(name))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    rules: str = "fsdp_tp"
    mesh: Optional[str] = None    # overrides the rule file's mesh, e.g. "data=2,fsdp=2,tensor=2"
    steps: int = 300
    log_every: int = 10
    seed: int = 0
    run_dir: str = "runs/default"
    sample_tokens: int = 200      # text sample at the end (0: none)
    sample_prompt: str = "def "
    loss_scale_growth: int = 200  # fp16: steps of finite grads before the loss scale doubles
    loss_scale_init: float = 32768.0  # fp16: the first loss scale (halved on every overflow)
    on_nonfinite: str = "stop"    # stop | skip: a NaN/Inf loss or gradient
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    val: ValConfig = dataclasses.field(default_factory=ValConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    heartbeat_timeout: int = 300  # multi-process: stop when a process makes no progress this long (s)
    # jax's persistent compile cache (meshlab/compile_cache.py): auto = $XDG_CACHE_HOME/meshlab/jax
    # (~/.cache/meshlab/jax); a directory; empty: off. JAX_COMPILATION_CACHE_DIR, when set, wins.
    compile_cache: Optional[str] = "auto"
    # Device memory the fit check and remat=auto budget against, GiB per device. 0: the device's own
    # (the allocator's bytes_limit); CPU devices report none, so there the check is off unless set.
    device_memory_gib: float = 0.0
    # MFU's denominator, dense TFLOP/s per device. 0: the datasheet figure of the device kind
    # (meshlab/peak.py); an unknown kind gets MFU "n/a" and a line saying to set this.
    peak_tflops: float = 0.0


def shipped_configs() -> list[str]:
    files = importlib.resources.files("meshlab") / "configs"
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".yaml"))


def _config_file(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.exists():
            raise ConfigError(f"config file {name_or_path!r} does not exist")
        return path
    candidate = importlib.resources.files("meshlab") / "configs" / f"{name_or_path}.yaml"
    if not candidate.is_file():
        close = difflib.get_close_matches(name_or_path, shipped_configs(), n=3)
        raise ConfigError(f"no shipped config {name_or_path!r}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
                          + f"; shipped: {', '.join(shipped_configs())}, or pass a path")
    return Path(str(candidate))


def _all_keys(node, prefix="") -> list[str]:
    """The settable keys: leaves, not their sections (`optim.lr`, not `optim`)."""
    out = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        out += _all_keys(v, key + ".") if OmegaConf.is_dict(v) else [key]
    return out


INT_MAX = 2**31 - 1        # steps, sizes and counts reach the device as int32
SEED_MAX = 2**32 - 1       # jax's and the data order's seeds are uint32
SWITCH_WORDS = "true or false (yes / no, on / off, 1 / 0)"


def _leaves(obj, prefix: str = ""):
    """(dotted key, value) of each field of a config's dataclass tree, as _all_keys names them."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _check_numbers(cfg: TrainConfig, dotted: dict) -> None:
    """Every number finite and in the range its use takes; a switch given a count other than 1 or 0
    (OmegaConf reads any integer as true) is refused rather than read as on."""
    leaves = dict(_leaves(cfg))
    for key, value in dotted.items():
        if isinstance(leaves.get(key), bool) and re.fullmatch(r"\s*[-+]?\d+\s*", value) and int(value) not in (0, 1):
            raise ConfigError(f"{key}={value.strip()} is a switch: {SWITCH_WORDS}")
    for key, value in leaves.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        if isinstance(value, int) and key in ("seed", "data.seed"):
            if not 0 <= value <= SEED_MAX:
                raise ConfigError(f"{key}={value} must be a whole number in [0, 2**32 - 1]")
        elif isinstance(value, int) and key != "data.max_bytes" and abs(value) > INT_MAX:
            raise ConfigError(f"{key}={value} is out of range: at most 2**31 - 1 = {INT_MAX:,}")
    m = cfg.model
    if not m.rope_theta > 0:
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be > 0 (RoPE's base wavelength)")
    if m.rope_scaling_factor < 0:
        raise ConfigError(f"model.rope_scaling_factor={m.rope_scaling_factor} must be >= 0 (0: off)")
    if m.rope_scaling_factor and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
                          f"{m.rope_high_freq_factor} must satisfy 0 < low < high (RoPE scaling is on: "
                          f"model.rope_scaling_factor={m.rope_scaling_factor})")
    if m.rope_scaling_factor and m.rope_original_max_position < 1:
        raise ConfigError(f"model.rope_original_max_position={m.rope_original_max_position} must be >= 1 "
                          f"(RoPE scaling is on: model.rope_scaling_factor={m.rope_scaling_factor})")
    for key in ("aux_loss_weight", "z_loss_weight"):          # a mixture of experts' router losses
        if getattr(m, key, 0.0) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be >= 0 (0: off)")
    if not cfg.loss_scale_init > 0:
        raise ConfigError(f"loss_scale_init={cfg.loss_scale_init} must be > 0 (fp16's first loss scale)")
    for key, value, low, zero in (("loss_scale_growth", cfg.loss_scale_growth, 1, ""),
                                  ("checkpoint.keep", cfg.checkpoint.keep, 0, " (0: keep every checkpoint)"),
                                  ("checkpoint.keep_every", cfg.checkpoint.keep_every, 0, " (0: none)"),
                                  ("profile.start_step", cfg.profile.start_step, -1, " (-1: no profile)")):
        if value < low:
            raise ConfigError(f"{key}={value} must be >= {low}{zero}")


def load_config(name_or_path: Optional[str] = None, overrides: Sequence[str] = (), resolve: bool = True) -> TrainConfig:
    """Shipped name or path, then `key=value` overrides; unknown keys list their near matches.
    resolve=False leaves remat/loss_impl "auto" unresolved: nothing touches a device (a torch peer can
    still take the whole GPU after this process read the config's shape)."""
    raw = {}
    if name_or_path:
        path = _config_file(name_or_path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold sections of key: value (model:, optim:, ...), "
                              f"not a {type(raw).__name__}")
        if not isinstance(raw.get("model") or {}, dict):
            raise ConfigError(f"config file {path}: model must be a section of key: value, not {raw['model']!r}")
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not key=value (e.g. optim.lr=1e-3)")
    dotted = dict(o.split("=", 1) for o in overrides)
    model_name = dotted.get("model.name") or (raw.get("model") or {}).get("name") or "tiny"
    try:
        model_cfg = models.preset(model_name)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    # Training's own model defaults: the engine picks remat and the loss implementation (fit.py);
    # a config file or override that names them wins.
    model_cfg.remat, model_cfg.loss_impl = "auto", "auto"
    base = OmegaConf.structured(TrainConfig(model=model_cfg))
    for o in overrides:       # each value is read as YAML: one that is not names its override, not the parser's internals
        try:
            OmegaConf.from_dotlist([o])
        except yaml.YAMLError as e:
            key, value = o.split("=", 1)
            problem = str(getattr(e, "problem", None) or e).splitlines()[0]
            raise ConfigError(f"override {o!r}: the value {value!r} is not valid YAML ({problem}); put it in single "
                              f"quotes inside the override, e.g. \"{key}='{value}'\"") from None
    try:
        merged = OmegaConf.merge(base, raw, OmegaConf.from_dotlist(list(overrides)))
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        close = difflib.get_close_matches(str(key), _all_keys(base), n=3, cutoff=0.5)
        raise ConfigError(f"unknown config key {key!r}" + (f"; did you mean {', '.join(close)}?" if close else "")) from None
    except ValidationError as e:
        # OmegaConf's message goes on with its internals (full_key, reference_type): the first line says it
        raise ConfigError(f"bad config value for {getattr(e, 'full_key', '?')!r}: {str(e.msg).splitlines()[0]}") from None
    cfg: TrainConfig = OmegaConf.to_object(merged)
    try:
        cfg.model.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # Counts the loop divides by or counts down with: a bad one would otherwise fail mid-run as a
    # ZeroDivisionError, or after the first compile.
    for key, value, low in (("data.microbatches", cfg.data.microbatches, 1), ("data.global_batch", cfg.data.global_batch, 1),
                            ("data.seq_len", cfg.data.seq_len, 1), ("log_every", cfg.log_every, 1),
                            ("val.every", cfg.val.every, 0), ("val.batches", cfg.val.batches, 1),
                            ("sample_tokens", cfg.sample_tokens, 0), ("checkpoint.every", cfg.checkpoint.every, 0),
                            ("heartbeat_timeout", cfg.heartbeat_timeout, 1)):
        if value < low:
            raise ConfigError(f"{key}={value} must be >= {low}" + (" (0: off)" if low == 0 else ""))
    o = cfg.optim
    for key, ok, want in (("lr", o.lr > 0, "> 0"), ("warmup_steps", o.warmup_steps >= 0, ">= 0"),
                          ("decay_steps", o.decay_steps >= 0, ">= 0 (0: the run's steps)"),
                          ("min_lr_ratio", 0 <= o.min_lr_ratio <= 1, "in [0, 1] (the final LR over the peak)"),
                          ("b1", 0 <= o.b1 < 1, "in [0, 1)"), ("b2", 0 <= o.b2 < 1, "in [0, 1)"), ("eps", o.eps >= 0, ">= 0"),
                          ("weight_decay", o.weight_decay >= 0, ">= 0"), ("grad_clip", o.grad_clip >= 0, ">= 0 (0: off)")):
        if not ok:       # NaN fails every test too
            raise ConfigError(f"optim.{key}={getattr(o, key)} must be {want}")
    if cfg.data.max_bytes < 1:
        raise ConfigError(f"data.max_bytes={cfg.data.max_bytes} must be >= 1 (the embedded corpus's size)")
    if cfg.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"on_nonfinite={cfg.on_nonfinite!r} must be stop or skip")
    r = cfg.checkpoint.resume
    if r not in ("", "latest") and not (r.isdigit()):
        raise ConfigError(f"checkpoint.resume={r!r} must be empty, 'latest' or a step number")
    if cfg.steps < 1:
        raise ConfigError(f"steps={cfg.steps}: a run trains at least one step; pass --steps N with N >= 1 "
                          "(steps is the run's total, the learning-rate schedule's length)")
    if r.isdigit() and int(r) > cfg.steps:   # == steps: refused after the restore (a damaged step errs first)
        raise ConfigError(f"--resume {r} is past steps={cfg.steps}: nothing would be trained; pass --steps "
                          f"greater than {r} (the run's total, not the steps to add)")
    if cfg.profile.start_step >= cfg.steps:   # the window would never open: nothing written, nothing said
        raise ConfigError(f"profile.start_step={cfg.profile.start_step} is not a step of this run (steps 0.."
                          f"{cfg.steps - 1}): no profile would be written; lower it or raise --steps")
    if cfg.profile.start_step >= 0 and cfg.profile.num_steps < 1:
        raise ConfigError(f"profile.num_steps={cfg.profile.num_steps} must be >= 1")
    if cfg.device_memory_gib < 0 or cfg.peak_tflops < 0:
        raise ConfigError("device_memory_gib and peak_tflops must be >= 0 (0: the device's own figure)")
    _check_numbers(cfg, dotted)
    # the end-of-run sample continues the prompt within 2 x seq_len tokens (byte tokens on the stdlib corpus;
    # another corpus's tokenizer is read only at the end of the run)
    prompt_tokens = len(cfg.sample_prompt.encode())
    if cfg.sample_tokens and cfg.data.corpus == "stdlib" and prompt_tokens >= 2 * cfg.data.seq_len:
        raise ConfigError(f"sample_prompt={cfg.sample_prompt!r} is {prompt_tokens} tokens, which leaves no room in the "
                          f"end-of-run sample's context of 2 x data.seq_len = {2 * cfg.data.seq_len}; shorten it, raise "
                          "data.seq_len, or set sample_tokens=0")
    if not resolve:
        return cfg
    from meshlab.train import fit   # model.remat=auto / loss_impl=auto -> concrete choices for this device
    try:
        fit.resolve_auto(cfg)
    except fit.FitError as e:
        raise ConfigError(str(e)) from None
    return cfg


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def schedule_changes(saved_config: str | None, cfg: TrainConfig) -> str:
    """The learning-rate schedule's settings (steps, optim's SCHEDULE_KEYS) that differ between a
    checkpoint's config and this run's, as "key: old -> new" ('' when none, or no config was saved)."""
    if not saved_config:
        return ""
    old = yaml.safe_load(saved_config)
    keys = [("steps", old.get("steps"), cfg.steps)]
    keys += [(f"optim.{k}", (old.get("optim") or {}).get(k), getattr(cfg.optim, k)) for k in SCHEDULE_KEYS]
    return ", ".join(f"{k}: {a} -> {b}" for k, a, b in keys if a != b)
