"""What `--checkpoint` may name, turned into (cfg, md, params, tokenizer) for the engines.

  random:<preset>[:<seed>]   a randomly initialised model (tests, benchmarks), byte tokenizer
  <dir with config.json>     a Hugging Face checkpoint (meshlab.infer.hf); tokenizer.json if present
  <training run dir>         a meshlab run (config.yaml + checkpoints/): the latest complete step's params
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import models
from meshlab.infer.hf import CheckpointError, load_hf
from meshlab.train.data import ByteTokenizer


class HFTokenizer:
    """tokenizer.json through the `tokenizers` library, with the encode/decode the server uses."""

    def __init__(self, path):
        from tokenizers import Tokenizer
        self.tk = Tokenizer.from_file(str(path))
        self.vocab_size = self.tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tk.decode(list(ids))


def random_params(cfg, seed: int = 0, dtype=None):
    """Random params created on device in `dtype` (no fp32 copy of a big model on the host)."""
    md_dtype = jnp.dtype(dtype or cfg.dtype)
    make = lambda k: jax.tree.map(lambda x: x.astype(md_dtype),
                                  nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(k)), nnx.Param)))
    return jax.jit(make)(jax.random.key(seed))


def load_checkpoint(spec: str, *, dtype: str | None = None, rules=None, mesh=None, **cfg_overrides):
    """(cfg, md, params, tokenizer) for a --checkpoint value (see the module docstring)."""
    from meshlab.train.state import model_def
    if spec.startswith("random:"):
        _, name, *seed = spec.split(":")
        cfg = dataclasses.replace(models.preset(name), **({"dtype": dtype} if dtype else {}), **cfg_overrides)
        return cfg, model_def(cfg), random_params(cfg, int(seed[0]) if seed else 0), ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint {spec!r} does not exist; pass a Hugging Face directory, a meshlab run "
                              "directory, or random:<preset>")
    if (path / "config.json").is_file():
        over = dict(cfg_overrides, **({"dtype": dtype} if dtype else {}))
        cfg, md, params = load_hf(path, rules=rules, mesh=mesh, **over)
        tok = HFTokenizer(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else ByteTokenizer()
        return cfg, md, params, tok
    if (path / "config.yaml").is_file():
        return _load_run(path, dtype)
    raise CheckpointError(f"{path}: neither a Hugging Face checkpoint (config.json) nor a meshlab run (config.yaml)")


def _load_run(path: Path, dtype):
    """Params of a meshlab training run's latest checkpoint, restored onto this process's devices."""
    from meshlab.train.config import load_config
    from meshlab.train.loop import build_trainer
    from meshlab.train.checkpoint import Checkpointer
    from meshlab.train.state import abstract_state
    cfg = load_config(str(path / "config.yaml"), [])
    tr = build_trainer(cfg)
    ckpt = Checkpointer(cfg.checkpoint.dir or path / "checkpoints", async_save=False)
    fp16 = cfg.model.dtype == "float16"
    state, _ = ckpt.restore(abstract_state(tr.md, tr.tx, tr.shardings, fp16))
    ckpt.close()
    mcfg = dataclasses.replace(tr.md.cfg, **({"dtype": dtype} if dtype else {}))
    from meshlab.train.state import model_def
    return mcfg, model_def(mcfg), state["params"], ByteTokenizer()
