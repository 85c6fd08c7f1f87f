"""A short text sample from a trained model without a KV cache (the end of `make train`).

One compiled program: the prompt is written into a fixed [1, max_len] buffer and each step
reads the logits at the last filled position; causal attention makes the unfilled tail harmless.
The serving engine (KV cache, batching) is meshlab/infer/; this needs only the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sample_tokens(md, params, prompt_ids, num_tokens: int, max_len: int, *, temperature: float = 0.8,
                  top_k: int = 40, seed: int = 0, vocab_size: int | None = None) -> list[int]:
    vocab_size = vocab_size or md.cfg.vocab_size
    if len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {max_len}")

    @jax.jit
    def next_token(params, buf, pos, key):
        logits = md.bind(params)(buf)[0, pos - 1, :vocab_size]               # [V]
        if temperature <= 0:
            return jnp.argmax(logits).astype(jnp.int32)
        top_vals, top_idx = jax.lax.top_k(logits / temperature, top_k)      # [k]
        return top_idx[jax.random.categorical(key, top_vals)].astype(jnp.int32)

    buf = np.zeros((1, max_len), np.int32)
    buf[0, :len(prompt_ids)] = prompt_ids
    pos, out = len(prompt_ids), []
    key = jax.random.key(seed)
    buf_dev = jnp.asarray(buf)
    for _ in range(min(num_tokens, max_len - len(prompt_ids))):
        key, sub = jax.random.split(key)
        tok = next_token(params, buf_dev, pos, sub)
        buf_dev = buf_dev.at[0, pos].set(tok)
        out.append(int(tok))
        pos += 1
    return out
