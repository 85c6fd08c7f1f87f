"""Compiled serving programs (prefill/decode over a KV cache) and the static-batch generator.

One program shape covers prefill and decode: a step feeds t tokens per row ([b, t], padding
marked invalid), writes their K/V, and samples the next token from the last valid position of
each row. Prefill is that step over prompt chunks of `chunk` tokens (so a long prompt costs
several steps of bounded size, never a program per length); decode is t = 1. `decode_loop` runs
n decode steps inside one device call (a `lax.scan`, sampling on device) so that host
round-trips do not set the speed. Compiled shapes (the buckets): t in {1, chunk}, decode n in
{steps_per_call}, and greedy-only or not (the host knows whether any row samples, so the decode
program holds no device-side branch); the batch is fixed per engine. Nothing recompiles per request.

Serving weights (`serving_params`, once at load): matrices in the compute dtype (a training
checkpoint's fp32 masters would otherwise be cast inside every step: 4 bytes read + 2 written + 2
read per weight per token), and with layers="split" (the default) the stacked [n_layers, ...]
weights become one buffer per layer, run by a Python loop over the layers. A decode step at small
batch reads every weight once and is limited by HBM bandwidth; XLA copies a slice of a stacked
weight into a temporary before the GEMM (the layer scan's dynamic slice, and the unrolled scan's
static slice alike), tripling those bytes. layers="fused" also concatenates wq|wk|wv and
w_gate|w_up per layer (two GEMM launches instead of five; XLA's own dot merger would concatenate
them at run time); it assumes those weights are not tensor-sharded. layers="kernels" is "fused"
whose decode tokens (batch <= 16, Pallas attention) run each layer as five Pallas launches
(models/llama.py Block.decode_step; slower than "fused" today, docs/benchmarks.md).
layers="scan" | "unroll" keep the stacked params.

`ContiguousGenerator` is the simple path: a fixed batch of prompts, a contiguous cache. The
continuous-batching engine over the paged cache is `meshlab.infer.scheduler.Engine`.
"""
from __future__ import annotations

import contextlib
import queue
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.infer import kv_cache
from meshlab.infer.sampler import SamplingParams, all_greedy, row_arrays, sample
from meshlab.infer.scheduler import AdmissionError, Request, Scheduler
from meshlab.rules import use_rules


LAYER_MODES = ("split", "fused", "kernels", "scan", "unroll")
CONCATENATED = ("fused", "kernels")     # modes whose layers carry wq|wk|wv and w_gate|w_up concatenated
FUSED = {("attn", "wqkv"): ("wq", "wk", "wv"), ("mlp", "w_gate_up"): ("w_gate", "w_up")}   # concat axis 1


def _fuse(layer: dict):
    """(params without the fused projections, {"wqkv", "w_gate_up"}) of one layer."""
    fused = {new: jnp.concatenate([layer[mod][n] for n in olds], axis=1) for (mod, new), olds in FUSED.items()}
    rest = {k: ({n: w for n, w in v.items() if n not in sum(FUSED.values(), ())} if isinstance(v, dict) else v)
            for k, v in layer.items()}
    return rest, fused


def _unfused_placeholders(md, rest: dict) -> dict:
    """Fill the fused-away leaves with abstract values: nnx.merge needs every parameter, none is read."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), md.abstract["layers"])
    return {k: ({**abstract[k], **v} if isinstance(v, dict) else v) for k, v in rest.items()}


def serving_params(md, params, layers: str = "split"):
    """Params as the programs of `make_programs(..., layers=layers)` take them (see the module doc).

    Matrices (ndim >= 2) are cast to the compute dtype, which the model would do per step anyway:
    the tokens are the same. 1-D leaves (norm scales, read in fp32) stay as stored. Under a rule
    file, each slice keeps its weight's sharding (propagated from the stacked array). The caller
    may drop its own `params` afterwards: split weights are new buffers.
    """
    if layers not in LAYER_MODES:
        raise ValueError(f"layers={layers!r} must be one of {LAYER_MODES}")
    dt = jnp.dtype(md.cfg.dtype)
    cast = lambda a: a.astype(dt) if a.ndim >= 2 and jnp.issubdtype(a.dtype, jnp.floating) else a

    def prepare(p):
        p = jax.tree.map(cast, p)
        if layers in ("split",) + CONCATENATED:
            p = dict(p, layers=[jax.tree.map(lambda a: a[i], p["layers"]) for i in range(md.cfg.n_layers)])
        if layers in CONCATENATED:
            p["layers"] = [_fuse(one) for one in p["layers"]]
        return p
    return jax.jit(prepare)(params)


def _step_fn(md, layout: str, impl: str = "xla", interpret: bool = False, layers: str = "split"):
    """The un-jitted step: (params, cache, seen, tokens, positions, valid, last, table, rows, counters,
    greedy) -> (next token [b], cache, seen). `seen` marks every fed token for the repetition penalty;
    params come from `serving_params(md, ., layers)`."""
    vocab = md.cfg.vocab_size

    def step(params, cache, seen, tokens, positions, valid, last, table, rows, counters, greedy=None):
        if layers in ("split",) + CONCATENATED:   # the stacked layers are only a structure here: bind abstract ones
            model, per_layer = md.bind(dict(params, layers=md.abstract["layers"])), params["layers"]
            if layers in CONCATENATED:
                per_layer = [(_unfused_placeholders(md, rest), fused) for rest, fused in per_layer]
        else:
            model, per_layer = md.bind(params), None
        if layout == "contiguous":
            attend = kv_cache.contiguous_attend(positions, valid)
        else:
            attend = kv_cache.paged_attend(positions, valid, table, impl, interpret)
        h, cache = model.cached(tokens, positions, cache, attend, unroll=layers == "unroll",
                                layers=per_layer, kernels=layers == "kernels")   # [b, t, d]
        h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)               # [b, 1, d]
        logits = model.logits(h_last)[:, 0, :vocab]                                 # [b, V]
        b = tokens.shape[0]
        seen = seen.at[jnp.arange(b)[:, None], jnp.where(valid, tokens, vocab)].set(True, mode="drop")
        return sample(logits, rows, counters, seen, greedy), cache, seen
    return step


def make_programs(md, layout: str, impl: str = "xla", interpret: bool = False, layers: str = "split"):
    """(step, decode_loop) jitted, cache and seen donated (updated in place). Both take a static
    `greedy=all_greedy(rows)` (None: decide on device)."""
    step = _step_fn(md, layout, impl, interpret, layers)

    def decode_loop(params, cache, seen, tok, pos, active, table, rows, counters, n, greedy=None):
        def body(carry, _):
            cache, seen, tok, pos, counters = carry
            nxt, cache, seen = step(params, cache, seen, tok[:, None], pos[:, None], active[:, None],
                                    jnp.zeros_like(pos), table, rows, counters, greedy)
            return (cache, seen, nxt, pos + 1, counters + 1), nxt
        (cache, seen, *_), toks = jax.lax.scan(body, (cache, seen, tok, pos, counters), None, length=n)
        return toks, cache, seen                                                    # toks [n, b]

    return (jax.jit(step, donate_argnums=(1, 2), static_argnames=("greedy",)),
            jax.jit(decode_loop, donate_argnums=(1, 2), static_argnames=("n", "greedy")))


def reset_rows(seen, rows_mask):
    """Forget the seen tokens of rows that get a new request."""
    return jnp.where(jnp.asarray(rows_mask)[:, None], False, seen)


def placement(rules, mesh):
    """The context programs run in: the rule file's constraints when given, else nothing."""
    return use_rules(rules, mesh) if rules is not None and mesh is not None else contextlib.nullcontext()


class ContiguousGenerator:
    """Generate for a fixed batch of prompts with a contiguous KV cache [layers, batch, max_len, ...]."""

    def __init__(self, md, params, batch: int, max_len: int, chunk: int = 256, steps_per_call: int = 8,
                 rules=None, mesh=None, layers: str = "split"):
        if max_len % chunk and chunk < max_len:
            raise ValueError(f"max_len={max_len} must be a multiple of chunk={chunk}")
        self.md, self.batch, self.max_len = md, batch, max_len
        self.chunk, self.steps_per_call, self.rules, self.mesh = min(chunk, max_len), steps_per_call, rules, mesh
        self.step, self.decode_loop = make_programs(md, "contiguous", layers=layers)
        with placement(rules, mesh):
            self.params = serving_params(md, params, layers)
            self.cache = kv_cache.init_contiguous(md.cfg, batch, max_len, rules=rules, mesh=mesh)

    def _check(self, prompts, params):
        if not 0 < len(prompts) <= self.batch:
            raise ValueError(f"got {len(prompts)} prompts for a generator of batch {self.batch}")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sp.validate(self.md.cfg.vocab_size)
            if not p:
                raise ValueError(f"prompt {i} is empty")
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


class Engine:
    """Continuous batching over a paged KV cache (see `meshlab.infer.scheduler` for the policy).

    Thread use: `add_request` may be called from any thread (it validates, then queues into an
    inbox); `step`/`run` belong to one engine thread. `on_event(req, new_tokens, finished)` is
    called on the engine thread.
    """

    def __init__(self, md, params, *, max_len: int, max_seqs: int = 8, page_size: int = 16,
                 num_pages: int | None = None, chunk: int = 64, steps_per_call: int = 8,
                 max_step_tokens: int | None = None, impl: str = "auto", interpret: bool = False,
                 detokenize: Callable[[list], str] | None = None, rules=None, mesh=None, layers: str = "auto"):
        if max_len % page_size:
            raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
        self.md, self.rules, self.mesh = md, rules, mesh
        self.chunk, self.steps_per_call, self.detokenize = chunk, steps_per_call, detokenize
        num_pages = num_pages or max_seqs * (max_len // page_size) + 1
        self.sched = Scheduler(max_seqs, num_pages, page_size, max_len, chunk, max_step_tokens)
        if impl == "auto":
            # The Pallas paged kernel on one GPU: 862 vs 720 tokens/s at batch 1 and 21.5k vs 12.2k at
            # batch 64 on the H200 (docs/benchmarks.md, Decode). A custom call does not shard, and on
            # CPU it would run interpreted: XLA's gather there.
            one_device = mesh is None or mesh.size == 1
            impl = "pallas" if jax.default_backend() == "gpu" and one_device and not interpret else "xla"
        if impl not in ("xla", "pallas"):
            raise ValueError(f"impl={impl!r} must be auto, xla or pallas")
        if layers == "auto":
            # fused: one q|k|v GEMM and, with the Pallas kernel at batch <= 16, RoPE + cache write
            # inside the attention kernel (921 vs 873 tokens/s at batch 1, H200). It concatenates
            # weights, so a tensor-sharded mesh keeps split.
            layers = "fused" if mesh is None or mesh.size == 1 else "split"
        self.impl = impl
        self.step_fn, self.loop_fn = make_programs(md, "paged", impl, interpret, layers)
        with placement(rules, mesh):
            self.params = serving_params(md, params, layers)
            self.cache = kv_cache.init_paged(md.cfg, num_pages, page_size, rules=rules, mesh=mesh)
            self.seen = jnp.zeros((max_seqs, md.cfg.vocab_size), bool)
        self.inbox: queue.Queue = queue.Queue()
        self.stats = {"requests_finished": 0, "prompt_tokens": 0, "generated_tokens": 0, "steps": 0,
                      "device_calls": 0, "preemptions": 0, "busy_s": 0.0}

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams, on_event=None):
        """Validate and queue a request (any thread). Raises ValueError/AdmissionError on bad input."""
        params.validate(self.md.cfg.vocab_size)
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise AdmissionError("the prompt is empty; send at least one token")
        if any(not 0 <= t < self.md.cfg.vocab_size for t in prompt):
            raise AdmissionError(f"prompt token ids must lie in [0, {self.md.cfg.vocab_size})")
        s = self.sched
        need = len(prompt) + params.max_tokens
        if need > s.max_len or -(-need // s.page_size) > s.pool.total:
            s.add(Request(prompt, params))            # raises the precise AdmissionError
        req = Request(prompt, params, on_event=on_event, t_arrival=time.perf_counter())
        self.inbox.put(req)
        return req

    def has_work(self) -> bool:
        return self.sched.has_work() or not self.inbox.empty()

    def _emit(self, req, tokens) -> bool:
        """Append sampled tokens until a stop; True when the request finished."""
        new, cut = [], False
        for t in tokens:
            if not req.output:
                req.t_first = time.perf_counter()
            req.output.append(int(t))
            new.append(int(t))
            if int(t) in req.params.stop_token_ids:
                req.finish_reason = "stop"
            elif self.detokenize and req.params.stop:
                text = self.detokenize(req.output)
                hits = [text.index(s) for s in req.params.stop if s in text]
                if hits:
                    req.text, req.finish_reason, cut = text[:min(hits)], "stop", True
            if not req.finish_reason and len(req.output) >= req.params.max_tokens:
                req.finish_reason = "length"
            if req.finish_reason:
                break
        if self.detokenize and not cut:
            req.text = self.detokenize(req.output)
        self.stats["generated_tokens"] += len(new)
        if req.finish_reason:
            req.t_done = time.perf_counter()
            self.sched.release(req)
            self.stats["requests_finished"] += 1
            self.stats["preemptions"] += req.preemptions
        if req.on_event:
            req.on_event(req, new, bool(req.finish_reason))
        return bool(req.finish_reason)

    # -- one step -------------------------------------------------------------------------
    def _admit(self):
        while not self.inbox.empty():
            self.sched.add(self.inbox.get_nowait())
        admitted = self.sched.admit()
        if admitted:
            mask = np.zeros(self.sched.max_seqs, bool)
            mask[[r.slot for r in admitted]] = True
            self.seen = reset_rows(self.seen, mask)
            self.stats["prompt_tokens"] += sum(len(r.prompt) for r in admitted if not r.preemptions)

    def _rows(self):
        reqs = self.sched.rows
        counters = np.array([len(r.output) if r else 0 for r in reqs], np.int32)
        return row_arrays([r.params if r else None for r in reqs]), counters

    def _multi_step(self) -> int:
        """Decode steps to run in one call: >1 only when every row decodes and pages are free for all."""
        s, running = self.sched, self.sched.running()
        if self.steps_per_call <= 1 or any(len(r.tokens) - r.cached != 1 for r in running):
            return 1
        if s.waiting and None in s.rows:
            return 1                                   # admit the waiting request at the next step
        n = min([self.steps_per_call] + [r.params.max_tokens - len(r.output) for r in running])
        if n < self.steps_per_call:
            return 1
        need = sum(s._pages_for(r, r.cached + n) for r in running)
        if need > len(s.pool.free):
            return 1
        for r in running:
            r.pages += s.pool.take(s._pages_for(r, r.cached + n))
        return n

    def step(self) -> None:
        """Admit, feed one planned step (or n decode steps in one call), emit tokens, free finished rows."""
        t0 = time.perf_counter()
        self._admit()
        if not self.sched.running():
            return
        n = self._multi_step()
        with placement(self.rules, self.mesh):
            if n > 1:
                self._run_decode_loop(n)
            else:
                self._run_step()
        self.stats["busy_s"] += time.perf_counter() - t0

    def _run_decode_loop(self, n: int):
        s = self.sched
        b = s.max_seqs
        tok = np.array([r.tokens[-1] if r else 0 for r in s.rows], np.int32)
        pos = np.array([r.cached if r else 0 for r in s.rows], np.int32)
        active = np.array([r is not None for r in s.rows])
        rows, counters = self._rows()
        toks, self.cache, self.seen = self.loop_fn(self.params, self.cache, self.seen, tok, pos, active,
                                                   s.page_table(), rows, counters, n=n, greedy=all_greedy(rows))
        toks = np.asarray(toks)
        self.stats["steps"] += n
        self.stats["device_calls"] += 1
        for r in list(s.running()):
            r.cached += n
            self._emit(r, toks[:, r.slot])
        assert b == toks.shape[1]

    def _run_step(self):
        s = self.sched
        feed = s.plan()
        if not feed:
            return
        b = s.max_seqs
        t = 1 if all(v == 1 for v in feed.values()) else self.chunk
        tokens, positions = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
        valid, last = np.zeros((b, t), bool), np.zeros(b, np.int32)
        for slot, n in feed.items():
            r = s.rows[slot]
            tokens[slot, :n] = r.tokens[r.cached:r.cached + n]
            positions[slot, :n] = np.arange(r.cached, r.cached + n)
            valid[slot, :n], last[slot] = True, n - 1
        rows, counters = self._rows()
        tok, self.cache, self.seen = self.step_fn(self.params, self.cache, self.seen, tokens, positions, valid,
                                                  last, s.page_table(), rows, counters, greedy=all_greedy(rows))
        tok = np.asarray(tok)
        self.stats["steps"] += 1
        self.stats["device_calls"] += 1
        for slot, n in feed.items():
            r = s.rows[slot]
            r.cached += n
            if r.cached == len(r.tokens):
                self._emit(r, [tok[slot]])

    # -- convenience ----------------------------------------------------------------------
    def run(self) -> None:
        while self.has_work():
            self.step()

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()):
        """Run these prompts to completion; returns the finished Request objects in order."""
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run()
        return reqs
