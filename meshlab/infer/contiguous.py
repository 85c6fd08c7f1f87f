"""`ContiguousGenerator`: a fixed batch of prompts over a contiguous KV cache [layers, batch, max_len,
...], the simple path (scripts/generate.py, the decode microbenchmark's reference).

One program shape covers prefill and decode: a step feeds t tokens per row ([b, t], padding
marked invalid), prefill in chunks of `chunk` tokens, decode t = 1 with `decode_loop` running n
steps per call; compiled shapes t in {1, chunk}, n in {steps_per_call}.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from meshlab.infer import kv_cache
from meshlab.infer.programs import check_quantize, engine_rules, make_programs, placement, serving_params
from meshlab.infer.sampler import SamplingParams, all_greedy, row_arrays


class ContiguousGenerator:
    """Generate for a fixed batch of prompts with a contiguous KV cache [layers, batch, max_len, ...]
    (kv_cache_dtype "fp8": float8_e4m3fn, as Engine's). quantize="fp8": the layers' matrices in fp8, as
    Engine's (layers "auto" then picks kernels; else split)."""

    def __init__(self, md, params, batch: int, max_len: int, chunk: int = 256, steps_per_call: int = 8,
                 rules=None, mesh=None, layers: str = "auto", kv_cache_dtype: str = "auto", quantize: str | None = None):
        if max_len % chunk and chunk < max_len:
            raise ValueError(f"max_len={max_len} must be a multiple of chunk={chunk}")
        check_quantize(md, quantize, mesh)
        layers = ("kernels" if quantize else "split") if layers == "auto" else layers
        if rules is not None and mesh is not None and batch % math.prod(mesh.shape[a] for a in rules.axes("cache_batch", mesh)):
            # a batch the rule file's batch split cannot divide (one prompt under fsdp_tp) stays whole
            rules = engine_rules(rules, ("act_batch", "cache_batch"))
        kv_dtype = kv_cache.cache_dtype(md.cfg, kv_cache_dtype)
        kv_cache.check_fits(md.cfg, batch * max_len, kv_dtype, mesh, f"{batch=}, {max_len=}")
        self.md, self.batch, self.max_len = md, batch, max_len
        self.chunk, self.steps_per_call, self.rules, self.mesh = min(chunk, max_len), steps_per_call, rules, mesh
        self.step, self.decode_loop = make_programs(md, "contiguous", layers=layers)
        with placement(rules, mesh):
            self.params = serving_params(md, params, layers, quantize)
            self.cache = kv_cache.init_contiguous(md.cfg, batch, max_len, kv_dtype, rules=rules, mesh=mesh)

    def _check(self, prompts, params):
        if not 0 < len(prompts) <= self.batch:
            raise ValueError(f"got {len(prompts)} prompts for a generator of batch {self.batch}")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sp.validate(self.md.cfg.vocab_size)
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if sp.presence_penalty or sp.frequency_penalty or sp.logit_bias or sp.grammar is not None:
                raise ValueError(f"prompt {i}: presence and frequency penalties, logit_bias and grammars are served by Engine "
                                 "(it keeps them per request); use Engine, or leave them out")
            if len(p) + sp.max_tokens > self.max_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_tokens={sp.max_tokens} exceed the context "
                                 f"of {self.max_len}; shorten the prompt or lower max_tokens")

    def prefill(self, prompts: Sequence[Sequence[int]], rows: dict, seen, greedy: bool | None = None):
        """Prompts through the cache in chunks; returns (first sampled token per row [b], seen)."""
        b, c = self.batch, self.chunk
        lens = np.array([len(p) for p in prompts] + [1] * (b - len(prompts)), np.int32)
        padded = np.zeros((b, -(-lens.max() // c) * c), np.int32)
        for i, p in enumerate(prompts):
            padded[i, :len(p)] = p
        first = np.zeros(b, np.int32)
        for start in range(0, padded.shape[1], c):
            pos = np.broadcast_to(np.arange(start, start + c, dtype=np.int32), (b, c))
            last = np.clip(lens - 1 - start, 0, c - 1).astype(np.int32)
            tok, self.cache, seen = self.step(self.params, self.cache, seen, padded[:, start:start + c], pos,
                                              pos < lens[:, None], last, None, rows, np.zeros(b, np.int32),
                                              greedy=greedy)
            done_here = (lens - 1 >= start) & (lens - 1 < start + c)
            first = np.where(done_here, np.asarray(tok), first)
        return first, seen

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Tokens generated per prompt (stop token included when hit); `on_token(row, token)` streams."""
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        self._check(prompts, params)
        b, n = self.batch, len(prompts)
        rows = row_arrays(params + [None] * (b - n))
        greedy = all_greedy(rows)
        out: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n

        def emit(i, t):
            if done[i]:
                return
            out[i].append(int(t))
            if on_token:
                on_token(i, int(t))
            done[i] = int(t) in params[i].stop_token_ids or len(out[i]) >= params[i].max_tokens

        with placement(self.rules, self.mesh):
            seen = jnp.zeros((b, self.md.cfg.vocab_size), bool)
            tok, seen = self.prefill(prompts, rows, seen, greedy)
            for i in range(n):
                emit(i, tok[i])
            pos = np.array([len(p) for p in prompts] + [0] * (b - n), np.int32)
            active = np.arange(b) < n
            while not all(done):
                left = max(params[i].max_tokens - len(out[i]) for i in range(n) if not done[i])
                steps = self.steps_per_call if left >= self.steps_per_call else 1
                counters = np.array([len(o) for o in out] + [0] * (b - n), np.int32)
                toks, self.cache, seen = self.decode_loop(self.params, self.cache, seen, tok, pos, active, None,
                                                          rows, counters, n=steps, greedy=greedy)
                toks = np.asarray(toks)
                for s in range(steps):
                    for i in range(n):
                        emit(i, toks[s, i])
                tok, pos = toks[-1], pos + steps
        return out
