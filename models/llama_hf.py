"""Hugging Face Llama <-> meshlab Llama: config fields and the parameter key map.

HF stores a linear layer as weight [out, in] (y = x W^T); meshlab stores [in, out] with the head
axes split out, stacked over layers. RoPE: HF's Llama applies rotate-half to q/k as produced by
q_proj/k_proj (the Meta->HF conversion already permuted the weights into that layout), and
meshlab's `apply_rope` is the same rotate-half, so q/k need no permutation here. The vocabulary
is padded to `padded_vocab` rows in meshlab (zeros), cut back on export.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from models.llama import LlamaConfig


_MISSING = object()


def _hf_number(d: dict, key: str, default, integer: bool):
    value = d.get(key)
    if value is None:                     # absent or null
        if default is _MISSING:
            raise KeyError(key)
        return default
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (integer and value != int(value)):       # NaN / Infinity: Python's json reads them
        raise ValueError(f"{key}={value!r} must be {'an integer' if integer else 'a finite number'}")
    return int(value) if integer else float(value)


def hf_int(d: dict, key: str, default=_MISSING) -> int:
    """d[key] as an int (KeyError when absent or null without a default); a fraction, a string, a bool or
    a non-finite number is a ValueError naming the key."""
    return _hf_number(d, key, default, integer=True)


def hf_float(d: dict, key: str, default=_MISSING) -> float:
    """d[key] as a float, under hf_int's rules less the whole-number one."""
    return _hf_number(d, key, default, integer=False)


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
    """A LlamaConfig from HF config.json (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r}: only Llama-family checkpoints load here")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json rope type {rope_type!r} is not supported (default and llama3 are)")
    heads = hf_int(hf, "num_attention_heads")
    fields = dict(
        name=hf.get("_name_or_path") or "hf", vocab_size=hf_int(hf, "vocab_size"), d_model=hf_int(hf, "hidden_size"),
        n_layers=hf_int(hf, "num_hidden_layers"), n_heads=heads, n_kv_heads=hf_int(hf, "num_key_value_heads", heads),
        head_dim=hf_int(hf, "head_dim", hf_int(hf, "hidden_size") // max(heads, 1)), mlp_dim=hf_int(hf, "intermediate_size"),
        rope_theta=hf_float(rope, "rope_theta", hf_float(hf, "rope_theta", 10000.0)),
        norm_eps=hf_float(hf, "rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    if rope_type == "llama3":
        fields.update(rope_scaling_factor=hf_float(rope, "factor"), rope_low_freq_factor=hf_float(rope, "low_freq_factor"),
                      rope_high_freq_factor=hf_float(rope, "high_freq_factor"),
                      rope_original_max_position=hf_int(rope, "original_max_position_embeddings"))
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    fields["dtype"] = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    fields.update(overrides)
    cfg = LlamaConfig(**fields)
    cfg.validate()
    return cfg


def config_to_hf(cfg: LlamaConfig, max_position: int = 8192, *, dtype: str | None = None,
                 eos_token_id: int | None = None, bos_token_id: int | None = None) -> dict:
    """HF config.json for cfg; dtype: the stored tensors' (default cfg.dtype); the special token ids
    are written when known."""
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
          "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.mlp_dim,
          "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
          "hidden_act": "silu", "max_position_embeddings": max_position, "torch_dtype": dtype or cfg.dtype,
          "attention_bias": False, "mlp_bias": False}
    if cfg.rope_scaling_factor:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                              "low_freq_factor": cfg.rope_low_freq_factor,
                              "high_freq_factor": cfg.rope_high_freq_factor,
                              "original_max_position_embeddings": cfg.rope_original_max_position}
    hf.update({k: v for k, v in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)) if v is not None})
    return hf


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """One meshlab leaf: its HF name (with {i} per layer when stacked) and the layout change both ways."""
    path: tuple
    hf: str
    to_meshlab: callable        # (hf array, cfg) -> meshlab array (one layer)
    to_hf: callable             # (meshlab array of one layer, cfg) -> hf array

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf


def _pad_rows(w, cfg):
    """[vocab_size, d] -> [padded_vocab, d], zero rows below. Rows other than config.json's vocab_size are
    returned as stored, for the loader's shape check to name (a table of 257 rows under vocab_size 5000
    would otherwise load, its other ids embedded as zeros)."""
    if w.shape[0] != cfg.vocab_size:
        return w
    out = np.zeros((cfg.padded_vocab, w.shape[1]), w.dtype)
    out[:w.shape[0]] = w
    return out


def key_map(cfg: LlamaConfig) -> list[KeyMap]:
    d, h, kvh, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pre = "model.layers.{i}."
    heads_in = lambda n: (lambda w, c: w.T.reshape(d, n, hd), lambda w, c: w.reshape(d, n * hd).T)
    plain_t = (lambda w, c: w.T, lambda w, c: w.T)
    same = (lambda w, c: w, lambda w, c: w)
    maps = [
        KeyMap(("embed",), "model.embed_tokens.weight", _pad_rows, lambda w, c: w[:c.vocab_size]),
        KeyMap(("final_norm", "scale"), "model.norm.weight", *same),
        KeyMap(("layers", "attn", "wq"), pre + "self_attn.q_proj.weight", *heads_in(h)),
        KeyMap(("layers", "attn", "wk"), pre + "self_attn.k_proj.weight", *heads_in(kvh)),
        KeyMap(("layers", "attn", "wv"), pre + "self_attn.v_proj.weight", *heads_in(kvh)),
        KeyMap(("layers", "attn", "wo"), pre + "self_attn.o_proj.weight",
               lambda w, c: w.T.reshape(h, hd, d), lambda w, c: w.reshape(h * hd, d).T),
        KeyMap(("layers", "attn_norm", "scale"), pre + "input_layernorm.weight", *same),
        KeyMap(("layers", "mlp_norm", "scale"), pre + "post_attention_layernorm.weight", *same),
        KeyMap(("layers", "mlp", "w_gate"), pre + "mlp.gate_proj.weight", *plain_t),
        KeyMap(("layers", "mlp", "w_up"), pre + "mlp.up_proj.weight", *plain_t),
        KeyMap(("layers", "mlp", "w_down"), pre + "mlp.down_proj.weight", *plain_t),
    ]
    if not cfg.tie_embeddings:
        maps.append(KeyMap(("lm_head",), "lm_head.weight", lambda w, c: _pad_rows(w, c).T,
                           lambda w, c: w.T[:c.vocab_size]))
    return maps
