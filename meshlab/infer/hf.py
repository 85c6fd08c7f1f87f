"""Load and save Hugging Face Llama checkpoints (config.json + *.safetensors [+ tokenizer.json]).

Loading never materialises the model on one device: each meshlab leaf is built with
`jax.make_array_from_callback` in the rule file's sharding, and each device's callback converts
only the HF tensors (layers) its shard covers, read through a memory map of the safetensors
file. Host memory peaks at about one leaf (the converted layers of one stacked weight).
The safetensors format is read and written here directly (an 8-byte header length, a JSON
header, raw little-endian bytes) because numpy has no bfloat16 and safetensors' numpy API refuses it.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from models import llama_hf, moe_hf

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32, "I64": np.int64}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    pass


class SafetensorsDir:
    """name -> lazily memory-mapped array over every *.safetensors file in a directory."""

    def __init__(self, path: Path):
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files; expected a Hugging Face checkpoint directory")
        self.entries = {}
        for f in files:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                try:
                    header = json.loads(fh.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise CheckpointError(f"{f}: corrupt safetensors header ({e})") from None
            for name, meta in header.items():
                if name != "__metadata__":
                    self.entries[name] = (f, 8 + n, meta)

    def __contains__(self, name):
        return name in self.entries

    def get(self, name: str) -> np.ndarray:
        if name not in self.entries:
            raise CheckpointError(f"checkpoint has no tensor {name!r} (it has {len(self.entries)} tensors)")
        f, base, meta = self.entries[name]
        if meta["dtype"] not in DTYPES:
            raise CheckpointError(f"{f}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        dtype = np.dtype(DTYPES[meta["dtype"]])
        if end - start != math.prod(meta["shape"]) * dtype.itemsize:
            raise CheckpointError(f"{f}: tensor {name!r} size does not match its shape {meta['shape']}")
        return np.memmap(f, dtype=dtype, mode="r", offset=base + start, shape=tuple(meta["shape"]))


def write_safetensors(path: Path, tensors: dict) -> None:
    header, offset = {}, 0
    for name, arr in tensors.items():
        nbytes = arr.size * arr.dtype.itemsize
        header[name] = {"dtype": CODES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                      # align the data start to 8 bytes
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for arr in tensors.values():
            fh.write(np.ascontiguousarray(arr).tobytes())


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _leaf(km, cfg, st, shape, dtype, sharding):
    """One meshlab leaf as a sharded jax.Array; each shard converts only the layers it covers."""
    converted = {}                                      # layer -> converted array, shared by the shards

    def layer(i):
        if i not in converted:
            name = km.hf.format(i=i, e="*")   # {e}: an expert bank, one tensor per expert (models/moe_hf.py)
            raw = km.read(st.get, i) if hasattr(km, "read") else st.get(name)
            w = km.to_meshlab(np.asarray(raw, np.float32), cfg)
            if w.shape != tuple(shape[1:] if km.stacked else shape):
                raise CheckpointError(f"{name}: shape {np.shape(raw)} does not convert to meshlab "
                                      f"{km.path} {tuple(shape)}; config.json and weights disagree")
            converted[i] = w.astype(dtype)
        return converted[i]

    def shard(index):
        if not km.stacked:
            return layer(None)[index]
        layers = range(cfg.n_layers)[index[0]]
        return np.stack([layer(i)[index[1:]] for i in layers])

    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def load_hf(path, *, rules=None, mesh=None, param_dtype=None, **cfg_overrides):
    """(cfg, md, params) from a HF checkpoint directory; params sharded by `rules` on `mesh` when given.

    param_dtype: storage dtype of the params (default: the compute dtype, as serving needs no fp32 master).
    """
    from meshlab.layout import leaf_specs
    from models import model_def
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; expected a Hugging Face checkpoint directory")
    try:
        hf_cfg = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'} is not JSON: {e}") from None
    if not isinstance(hf_cfg, dict):
        raise CheckpointError(f"{path / 'config.json'} must hold a JSON object, not {type(hf_cfg).__name__}")
    arch = moe_hf if hf_cfg.get("model_type") == "mixtral" else llama_hf    # Mixtral: the MoE model
    try:
        cfg = arch.config_from_hf(hf_cfg, **cfg_overrides)
    except KeyError as e:
        raise CheckpointError(f"{path / 'config.json'} has no {e.args[0]!r}, which a {hf_cfg.get('model_type', 'llama')} "
                              "config needs") from None
    except (TypeError, ValueError) as e:       # a field of the wrong type (e.g. a string size) or range
        raise CheckpointError(f"{path / 'config.json'}: {e}") from None
    md = model_def(cfg)
    st = SafetensorsDir(path)
    dtype_name = str(param_dtype or cfg.dtype)
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    specs = leaf_specs(md, rules, mesh, "params") if rules is not None else None
    default = NamedSharding(mesh, P()) if mesh is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params: dict = {}
    for km in arch.key_map(cfg):
        shape = _get(md.abstract, km.path).shape
        sharding = NamedSharding(mesh, _get(specs, km.path)) if specs is not None else default
        _set(params, km.path, _leaf(km, cfg, st, shape, dtype, sharding))
    return cfg, md, params


def save_hf(path, cfg, params, tokenizer_json: str | Path | None = None, dtype=None, *,
            eos_token_id: int | None = None, bos_token_id: int | None = None) -> None:
    """Write a HF Llama directory (a mixture of experts: Mixtral's): model.safetensors (one file),
    config.json, generation_config.json and, with `tokenizer_json`, tokenizer.json + tokenizer_config.json.

    dtype: the stored tensors' (default: the params' own); config.json's torch_dtype names it.
    eos_token_id: the token that ends a sequence, written to config.json and generation_config.json (where
    transformers and meshlab's loader look) and as tokenizer_config.json's eos_token. Default: the run's
    own (`default_eos`): the eod_id of tokenizer_meta.json or the eos_token of tokenizer_config.json
    beside `tokenizer_json`, or the byte tokenizer's end-of-document id without one. bos_token_id: the
    same, from tokenizer_config.json's bos_token (the byte tokenizer has none).
    """
    path = Path(path)
    tk = None
    if tokenizer_json is not None:
        from tokenizers import Tokenizer
        tokenizer_json = Path(tokenizer_json)
        tk = Tokenizer.from_file(str(tokenizer_json))
    if eos_token_id is None:
        eos_token_id = default_eos(tokenizer_json, tk, cfg)
    if bos_token_id is None and tk is not None:
        bos_token_id = _special_id(tokenizer_json, tk, "bos_token")
    for name, t in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
        if t is not None and not 0 <= t < cfg.vocab_size:
            raise CheckpointError(f"save_hf: {name}={t} is not a token id of the model (vocab_size {cfg.vocab_size})")
    arch = moe_hf if hasattr(cfg, "n_experts") else llama_hf        # a mixture of experts: Mixtral's format
    special = {k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)) if v is not None}
    maps = arch.key_map(cfg)
    stored = np.dtype(dtype) if dtype is not None else np.dtype(_get(params, maps[0].path).dtype)
    try:                                                               # refuses what the format cannot hold
        hf_config = arch.config_to_hf(cfg, dtype={"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(
            CODES.get(stored)), **special)
    except ValueError as e:
        raise CheckpointError(f"save_hf: {e}") from None
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for km in maps:
        leaf = np.asarray(jax.device_get(_get(params, km.path)))
        leaf = leaf.astype(dtype) if dtype is not None else leaf
        for i in (range(cfg.n_layers) if km.stacked else [None]):
            one = leaf[i] if km.stacked else leaf
            named = km.write(one, cfg, i) if hasattr(km, "write") else {km.hf.format(i=i): km.to_hf(one, cfg)}
            tensors.update({name: np.ascontiguousarray(w) for name, w in named.items()})
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(special, indent=2))
    if tk is not None:
        (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
        src = tokenizer_json.with_name("tokenizer_config.json")
        tc = json.loads(src.read_text()) if src.is_file() else {"tokenizer_class": "PreTrainedTokenizerFast"}
        for key, t in (("eos_token", eos_token_id), ("bos_token", bos_token_id)):
            if t is not None and tk.id_to_token(t) is not None:
                tc[key] = tk.id_to_token(t)
        (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))


def default_eos(tokenizer_json: Path | None, tk, cfg) -> int | None:
    """The end-of-sequence id a run trained with: beside its tokenizer.json, tokenizer_meta.json's eod_id
    (meshlab/checkpoint.py:write_run_tokenizer) or tokenizer_config.json's eos_token; None when neither
    names one. Without a tokenizer.json the run used byte tokens: their end-of-document id."""
    if tokenizer_json is None:
        from meshlab.tokenizer import EOD
        return EOD if cfg.vocab_size > EOD else None
    meta = tokenizer_json.with_name("tokenizer_meta.json")
    if meta.is_file() and json.loads(meta.read_text()).get("eod_id") is not None:
        return int(json.loads(meta.read_text())["eod_id"])
    return _special_id(tokenizer_json, tk, "eos_token")


def _special_id(tokenizer_json: Path, tk, key: str) -> int | None:
    """The id of tokenizer_config.json's `key` token (a string or {"content": ...}) beside tokenizer_json."""
    f = tokenizer_json.with_name("tokenizer_config.json")
    tok = json.loads(f.read_text()).get(key) if f.is_file() else None
    tok = tok.get("content") if isinstance(tok, dict) else tok
    return tk.token_to_id(tok) if tok else None
