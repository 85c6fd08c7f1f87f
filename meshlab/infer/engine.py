"""The serving engine: `Engine`, continuous batching over the paged KV cache.

The compiled programs and the serving weights live in `meshlab.infer.programs`, the scheduling
policy (rows, pages, prefix cache, token budget) in `meshlab.infer.scheduler`, the calls' host
inputs (one buffer per call, a packed step's filled in place) in `meshlab.infer.calls`; `Engine`
turns each scheduled step into one device call: a token-packed step when some row prefills
(decode tokens and prompt-chunk rows in one stream, no padding rows), else `steps_per_call`
decode steps in one call over the decode rows only, the next such call dispatched before the
host reads back the last (Engine says when). Host work per step is numpy over the rows of that
step; the page table is kept by the scheduler and changed only where pages change; the only
device-to-host transfer is the sampled tokens (and logprobs when asked). `Engine` inherits its
packed steps (each dispatched before the one before is read back) from `meshlab.infer.packed`, its
decode calls and their chaining from `meshlab.infer.decode_calls`, its one-step first-token paths
from `meshlab.infer.first_tokens`, `warmup` (every bucket's program compiled before the first
request) from `meshlab.infer.warmup` and prompt logprobs from `meshlab.infer.scoring`.

`ContiguousGenerator` (a fixed batch over a contiguous cache) lives in `meshlab.infer.contiguous`
and is importable from here too.
"""
from __future__ import annotations

import contextlib
import queue
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.infer import calls, kv_cache
from meshlab.infer.contiguous import ContiguousGenerator  # noqa: F401  (its callers import it from here)
from meshlab.infer.calls import logprob_rows
from meshlab.infer.first_tokens import FirstTokens
from meshlab.infer.decode_calls import DecodeCalls
from meshlab.infer.packed import Flight, PackedSteps
from meshlab.infer.guided import Guided, mask_words
from meshlab.infer.programs import (BIAS, COUNTS, TOP_LOGPROBS, add_own_entries, check_layers, check_quantize,
                                    default_impl, default_layers, engine_rules, head_params, make_engine_programs,
                                    make_head_program, placement, serving_params)
from meshlab.infer.sampler import SamplingParams, bias_row, cuts, penalised_row, row_arrays
from meshlab.infer.scheduler import AdmissionError, Request, Scheduler, output_decoder
from meshlab.infer.scoring import ScoreStore, Scoring
from meshlab.infer.speculative import Speculation, check_speculation, make_spec_loop, spec_program
from meshlab.infer.warmup import Warmup

NARROW = (16, 64)   # the narrow chunk-row widths (see Engine.WIDTHS)
# A quantized engine's packed programs (FP8 GEMMs on prompt chunks) compile with these XLA options under
# its own: its GEMM autotuner at level 1, no buffer reinitialisation or check of each candidate against
# a reference. At the default level (4) a llama3_1b fp8 engine's first 2k prompt compiled for 30 s on an
# H100 (bf16: 5 s); at level 1 for 7 s, its TTFT the same (10.8 against 11.2 ms uncached).
FP8_PACKED_OPTIONS = {"xla_gpu_autotune_level": 1}

# Engine.stats: counts since the engine was made ("_s": seconds), read by /metrics and the benchmarks
STATS = ("requests_finished", "prompt_tokens", "generated_tokens", "steps", "device_calls", "preemptions", "busy_s",
         "prefill_tokens", "prefix_hit_tokens", "decode_calls", "packed_calls", "compiles", "compile_s", "host_s",
         "device_wait_s", "aborted", "chained_calls", "dispatch_s", "first_token_calls", "head_calls", "unread_calls",
         "overlapped_calls", "scored_tokens", "guided_requests", "spec_calls", "spec_drafted", "spec_accepted")


class Engine(PackedSteps, DecodeCalls, FirstTokens, Warmup, Scoring, Guided, Speculation):
    """Continuous batching over a paged KV cache (see `meshlab.infer.scheduler` for the policy).

    Thread use: `add_request` and `abort` may be called from any thread (they go through queues
    the engine thread drains); `step`/`run` belong to one engine thread, which also calls
    `on_event(req, new_tokens, finished)`.

    Device calls and their compiled shapes (nothing compiles per request):
      every row decodes  decode_loop over the decode rows, b in DECODE buckets (1, 4, 16, 32, 64,
                         ... capped at max_seqs), n = steps_per_call steps per call (1 when pages
                         for n are short);
      some row prefills  packed_step with n_dec in MIXED_DECODE buckets {0, max_seqs} decode
                         tokens and k in PREFILL_ROWS buckets (1, 2, 4, ... capped at
                         max_prefill_rows) chunk rows `chunk` wide (or one row 16 or 64 wide
                         when the step has one piece that fits: a cached prefix's tail);
      every prompt row has   one decode step (n = 1) over the rows, b in DECODE, read back at once
      one token left         (a prompt met before: its last token, read from its shared page and
                             not written; or one uncached token): a decode step's device time (the
                             fused RoPE + write + attention kernel, told which rows not to write);
      ... and each is a      with no row decoding and reuse_hidden: the LM head alone over the
      prompt met before      hidden states kept for those pages (programs.HIDDEN), b in DECODE:
      up to a kept page end  a prompt seen before samples its first token without any layer;
    each with static greedy / logprobs flags (from the rows in the step).

    Decode calls chain (chain_decode): while one runs, the next is dispatched from its last tokens
    on the device, and the host reads back and emits the first meanwhile, as long as the rows stay
    the same (no arrival, abort, free row wanted, or row at max_tokens). A row that meets a stop
    token inside a call loses the chained call's samples (dropped, as a call's samples past a stop
    always are). chain_decode=False reads every decode call back before the next (the A/B for the
    benchmark; overlap_steps then overlaps packed steps only).
    overlap_steps: a step is dispatched before the one before it is read back (a packed step, or a
    decode call that cannot chain because the rows change): rows whose tokens are still on the
    device are fed from it, rows those tokens end give up their slot first (meshlab.infer.packed).
    False: each read back before the next is planned (the A/B).

    pinned_inputs: a packed step's input buffer is put into pinned host memory and copied to the
    device by the program itself, instead of by the runtime before it (one device only; the
    benchmark's first-token profile times both).

    first_token_decode: a step whose prompt rows each have one token left runs one decode step
    (False: a packed row, the benchmark's A/B). compiler_options: jax.jit's per program kind (packed,
    decode, head, spec; "first": the first tokens' one-step decode calls compiled apart), e.g. {"packed":
    {"xla_gpu_enable_command_buffer": ""}}: without CUDA graphs, which the first-token profile times
    (H200: a prompt met before took 2.5 ms to its first token against 2.2 with them; docs/benchmarks.md).

    guided_steps: the steps of a decode call while a request held to a grammar runs (meshlab.infer.guided):
    a guided row is fed at the first only (its next mask needs its token on the host), the others at
    every one. 1 (the default): every row advances one token a call and a guided row every other call;
    more: the free rows advance that many, and a guided row still one every other call, which lasts
    longer. Values other than 1 and steps_per_call compile decode programs of their own.

    reuse_hidden (with the prefix cache): packed steps keep the final hidden state of each token that
    ends a page ([num_pages, d] in the cache: 4 KB a page for llama3_1b, 0.8% of its K/V), so a
    prompt met before up to such a page (the same prompt again: n copies, retries, evaluations)
    samples its first token from the head alone (H200, 2k prompt: 0.9-1.2 ms against 1.8 feeding
    its last token again). Its tokens are those of the call that computed the page; a recomputation
    through the decode kernels may round differently in bf16. False: such prompts feed their last
    token again (the benchmark's A/B).

    quantize="fp8": the layers' matrices in float8_e4m3fn, a scale per output row (the embedding and
    tied head stay), layers "kernels" on one device (programs.serving_params); steps of
    models.serving.FP8_GEMM_ROWS tokens or more quantize their activations too (FP8 GEMMs), fewer
    read the matrices widened; its packed programs compile with FP8_PACKED_OPTIONS under the caller's.
    kv_cache_dtype="fp8": the KV cache in float8_e4m3fn (meshlab.infer.kv_cache says how): half its
    bytes, so num_pages can double in the same memory; any layers, impl and mesh. With the Pallas
    kernels, pages are added where it would be 2-4 GiB per K/V (kv_cache.pages_past_wrap says why).

    speculative_tokens=k > 0: speculative decoding by prompt lookup (k drafts a step, looked up by the row's last
    prompt_lookup_max down to prompt_lookup_min tokens) for decode calls of at most speculative_max_batch
    rows, none held to a token mask; meshlab.infer.speculative says how.
    """

    def __init__(self, md, params, *, max_len: int, max_seqs: int = 8, page_size: int = 16,
                 num_pages: int | None = None, chunk: int = 64, steps_per_call: int = 8,
                 max_step_tokens: int | None = None, impl: str = "auto", interpret: bool = False,
                 detokenize: Callable[[list], str] | None = None, rules=None, mesh=None, layers: str = "auto",
                 prefix_cache: bool = True, prefill: str = "auto", chain_decode: bool = True,
                 compiler_options: dict | None = None, pinned_inputs: bool = False, first_token_decode: bool = True,
                 reuse_hidden: bool = True, overlap_steps: bool = True, guided_steps: int = 1,
                 quantize: str | None = None, kv_cache_dtype: str = "auto", speculative_tokens: int = 0,
                 prompt_lookup_max: int = 3, prompt_lookup_min: int = 1, speculative_max_batch: int = 4):
        if page_size < 1 or max_len < page_size or max_len % page_size:
            raise ValueError(f"max_len={max_len} must be a positive multiple of page_size={page_size} (>= 1)")
        if chunk < 1 or steps_per_call < 1 or max_seqs < 1:
            raise ValueError(f"chunk={chunk}, steps_per_call={steps_per_call} and max_seqs={max_seqs} must be >= 1")
        rules = engine_rules(rules, md=md, mesh=mesh)
        self.md, self.rules, self.mesh, self.chain_decode, self.overlap_steps = md, rules, mesh, chain_decode, overlap_steps
        self.first_token_decode, self.reuse_hidden = first_token_decode, reuse_hidden and prefix_cache
        self.chunk, self.steps_per_call, self.detokenize = min(chunk, max_len), steps_per_call, detokenize
        if guided_steps < 1:
            raise ValueError(f"{guided_steps=} must be >= 1")
        check_speculation(speculative_tokens, prompt_lookup_min, prompt_lookup_max, speculative_max_batch, max_len)
        self.speculative_tokens, self.speculative_max_batch = speculative_tokens, speculative_max_batch
        self.prompt_lookup = (prompt_lookup_min, prompt_lookup_max)     # the suffix lengths a draft is looked up by
        self.guided_steps = guided_steps
        impl = default_impl(mesh, interpret) if impl == "auto" else impl
        if impl not in ("xla", "pallas"):
            raise ValueError(f"impl={impl!r} must be auto, xla or pallas")
        kv_dtype = kv_cache.cache_dtype(md.cfg, kv_cache_dtype)
        num_pages = num_pages or max_seqs * (max_len // page_size) + 1
        if impl == "pallas" and not interpret:
            num_pages = kv_cache.pages_past_wrap(md.cfg, num_pages, page_size, kv_dtype)
        kv_cache.check_fits(md.cfg, num_pages * page_size, kv_dtype, mesh, f"{max_seqs=}, {max_len=}, {num_pages=}, {page_size=}")
        self.sched = Scheduler(max_seqs, num_pages, page_size, max_len, self.chunk, max_step_tokens, prefix_cache)
        if prefix_cache:                      # scored prompt pages (~2.6 KB each at 20 alternatives a token)
            self.sched.scores = ScoreStore(page_size, capacity=max(1024, num_pages))
        check_quantize(md, quantize, mesh)
        layers = ("kernels" if quantize else default_layers(md, impl, mesh)) if layers == "auto" else layers
        check_layers(md, layers, mesh)
        self.impl, self.layers = impl, layers
        if prefill not in ("auto", "paged", "flash", "xla"):
            raise ValueError(f"prefill={prefill!r} must be auto (the paged prompt kernel with impl=pallas), paged, "
                             "flash or xla")
        self.prefill = prefill
        self.packed_fn, self.loop_fn = make_engine_programs(md, impl, interpret, layers, prefill)
        with placement(rules, mesh):
            self.params = serving_params(md, params, layers, quantize)
            self._mask_width = mask_words(md.cfg.vocab_size)
            self.cache = add_own_entries(
                kv_cache.init_paged(md.cfg, num_pages, page_size, kv_dtype, rules=rules, mesh=mesh), md, max_seqs, max_len,
                free_bias=bias_row(SamplingParams(), md.cfg.vocab_size), mask_width=self._mask_width,
                reuse_hidden=self.reuse_hidden, speculative=speculative_tokens > 0)
            self.seen = jnp.zeros((max_seqs, md.cfg.vocab_size), bool)
        # the same programs taking the weights as a flat list and the host inputs as one buffer (calls.py)
        self.weights, treedef = jax.tree.flatten(self.params)
        opts = compiler_options or {}
        if set(opts) - {"packed", "decode", "first", "head", "spec"}:
            raise ValueError(f"compiler_options={compiler_options!r}: give XLA options per program kind, "
                             "e.g. {'packed': {'xla_gpu_enable_command_buffer': ''}} (kinds: packed, decode, first, "
                             "head, spec)")
        if quantize:
            opts = {**opts, "packed": {**FP8_PACKED_OPTIONS, **opts.get("packed", {})}}
        self._pinned = calls.pinned_shardings(self.cache["k"]) if pinned_inputs else None
        self.packed_call = calls.packed_program(self.packed_fn, treedef, opts.get("packed"),
                                                self._pinned[1] if pinned_inputs else None)
        self.decode_call = calls.decode_program(self.loop_fn, treedef, opts.get("decode"))
        self.first_call = calls.decode_program(self.loop_fn, treedef, opts["first"]) if "first" in opts else self.decode_call
        if speculative_tokens:
            self.spec_call = spec_program(make_spec_loop(md, impl, interpret, layers), treedef, opts.get("spec"))
        self.head_weights, head_treedef = jax.tree.flatten(head_params(self.params))
        self.head_call = calls.head_program(make_head_program(md), head_treedef, opts.get("head"))
        self._forget = jax.jit(lambda seen, slot: seen.at[slot].set(False), donate_argnums=0)
        # a slot's generated-token counts set to a request's output so far (ids padded with the vocab size)
        self._recount = jax.jit(lambda counts, slot, ids: counts.at[slot].set(0).at[slot, ids].add(1, mode="drop"),
                                donate_argnums=0)
        # rows [n, ...] of a per-slot cache entry set at slots [n] (slot max_seqs: padding, dropped)
        self._set_rows = jax.jit(lambda entry, slots, rows: entry.at[slots].set(rows, mode="drop"), donate_argnums=0)
        self.slot_biased = np.zeros(max_seqs, bool)              # the slot's bias rows hold a logit_bias or held stops
        self.slot_guide = [None] * max_seqs          # the Guide whose mask the slot's MASK row holds (None: every token)
        self._mask_executor = None                               # llguidance's, made at the first guided step
        self.masked: set = set()            # requests with a token mask (a grammar, allowed or banned tokens), queued or running
        self.guided: set = set()            # those whose mask follows each token (Guide.per_step)
        # meshlab.infer.guided.Grammars of the served tokenizer (the server sets it): requests with a
        # grammar (SamplingParams.grammar) are refused without one
        self.grammars = None
        # Few shapes, each compiled once (a llama3_1b program takes seconds to compile): decode rows
        # in powers of 4 up to 16 (a decode step at small batch reads the weights once whatever its
        # rows, and padding rows attend to nothing), then of 2: past 16 the attention's grid follows
        # the bucket, and a half-full one ran its rows slower (H200, ctx 2k: 32 rows in the 64-row
        # program 13,883-14,042 tokens/s against 17,163-17,753 in their own; 128 in 256: 29,368-30,519
        # against 31,669-32,402; 8 in 16 level). Chunk rows in powers of 2, and a mixed step carries
        # either no decode rows or all max_seqs (at most one step in a few pays for idle rows).
        powers = lambda base, top: sorted({min(base ** i, top) for i in range(top.bit_length() + 1)})
        self.DECODE = sorted({b for b in powers(4, max_seqs) if b <= 16} | {b for b in powers(2, max_seqs) if b >= 16})
        self.PREFILL_ROWS = powers(2, self.sched.max_prefill_rows)
        self.MIXED_DECODE = [0, max_seqs] if max_seqs > 1 else [0]          # one row cannot do both
        # Chunk rows are `chunk` wide, or the narrowest of NARROW for a step with one prompt piece that
        # fits: a cached prefix's tail (at most a page of 16 when the prompt was met before up to its
        # last page) or a short prompt then costs a 16- or 64-token row, not a 512-token one. Each
        # width is one more packed program per MIXED_DECODE bucket (k = 1 only) for warmup to compile.
        self.WIDTHS = sorted({min(w, self.chunk) for w in NARROW} | {self.chunk})
        self.slot_rows = row_arrays([None] * max_seqs)           # sampler settings per slot
        self.slot_logprobs = np.full(max_seqs, -1, np.int32)     # top-k asked per slot (-1: none)
        self.slot_sampled = np.zeros(max_seqs, bool)             # slot samples or penalises (not argmax)
        self.slot_cut = np.zeros(max_seqs, np.int8)              # slot's draw's cuts (sampler.cuts)
        self.inbox: queue.Queue = queue.Queue()
        self.aborts: queue.Queue = queue.Queue()
        self._programs: set = set()
        self._slots: dict = {}                   # (n_dec, k, width) -> calls.Slots of a packed step
        self._flight: Flight | None = None       # a decode call not read back yet (step says why)
        self._pflight = None                     # a packed step not read back yet (meshlab.infer.packed)
        self._waited = 0.0                       # this step's seconds waiting for the device
        # entered around each wait for the device: a server lets its other threads run only then
        self.device_wait: Callable = contextlib.nullcontext
        self.stats = {name: 0.0 if name.endswith("_s") else 0 for name in STATS}

    # -- requests -------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams, on_event=None):
        """Validate and queue a request (any thread). Raises ValueError/AdmissionError on bad input."""
        params.validate(self.md.cfg.vocab_size)
        try:        # one pass in numpy: a 2k-id list in ~0.07 ms here (np.asarray: ~0.14, a Python loop: ~0.3)
            ids = np.fromiter(prompt, np.int64, len(prompt))
        except (TypeError, ValueError):                   # not a flat sequence of ids: its shape is named below
            ids = np.asarray(prompt, dtype=np.int64)
        if ids.ndim != 1:
            raise AdmissionError(f"the prompt must be a flat list of token ids, not an array of shape {ids.shape}")
        if not ids.size:
            raise AdmissionError("the prompt is empty; send at least one token")
        if ids.min() < 0 or ids.max() >= self.md.cfg.vocab_size:
            raise AdmissionError(f"prompt token ids must lie in [0, {self.md.cfg.vocab_size})")
        prompt = ids.tolist()
        s = self.sched
        need = len(prompt) + params.max_tokens - 1          # Request.end: its last output token is never fed
        if need > s.max_len or -(-need // s.page_size) > s.pool.total:
            s.add(Request(prompt, params))            # raises the precise AdmissionError
        req = Request(prompt, params, on_event=on_event, t_arrival=time.perf_counter(), ids=ids.astype(np.int32),
                      guide=self._guide_of(params))
        self.inbox.put(req)
        return req

    def abort(self, req: Request) -> None:
        """Cancel a queued or running request (any thread): the engine thread frees its row and
        pages at its next step and calls on_event(req, [], True) with finish_reason "abort"."""
        self.aborts.put(req)

    def has_work(self) -> bool:
        return (self.sched.has_work() or not self.inbox.empty() or not self.aborts.empty()
                or self._flight is not None or self._pflight is not None)

    def _finish(self, req) -> None:
        req.t_done = time.perf_counter()
        self.sched.release(req)
        self.stats["requests_finished"] += 1
        self.stats["preemptions"] += req.preemptions
        self.guided.discard(req)
        self.masked.discard(req)

    def _emit(self, req, tokens, logprobs=None) -> bool:
        """Append sampled tokens until a stop (Request.append); True when the request finished."""
        if req.detokenize is None and self.detokenize is not None:
            req.detokenize = output_decoder(self.detokenize, req.params)
        if not req.output:
            req.t_first = time.perf_counter()
            if req.params.prompt_logprobs is not None and req.prompt_logprobs is None:
                req.prompt_logprobs = self._put_together(req)
        new = req.append(tokens, logprobs)
        self.stats["generated_tokens"] += len(new)
        if req.finish_reason:
            self._finish(req)
        if req.on_event:
            req.on_event(req, new, bool(req.finish_reason))
        return bool(req.finish_reason)

    # -- one step -------------------------------------------------------------------------
    def _admit(self):
        while not self.inbox.empty():
            self._hold_mask(self.sched.add(self.inbox.get_nowait()))
        while not self.aborts.empty():
            req = self.aborts.get_nowait()
            if req.finish_reason is None and (self.sched.remove_waiting(req) or req.slot >= 0):
                req.finish_reason = "abort"
                self._finish(req)
                self.stats["aborted"] += 1
                if req.on_event:
                    req.on_event(req, [], True)
        for r in self.sched.admit():
            p = r.params
            for key, value in (("temperature", p.temperature), ("top_k", p.top_k), ("top_p", p.top_p), ("min_p", p.min_p),
                               ("penalty", p.repetition_penalty), ("seed", p.seed),
                               ("presence", p.presence_penalty), ("frequency", p.frequency_penalty)):
                self.slot_rows[key][r.slot] = value
            self.slot_logprobs[r.slot] = -1 if p.logprobs is None else p.logprobs
            self.slot_sampled[r.slot] = p.temperature > 0 or penalised_row(p)
            self.slot_cut[r.slot] = cuts(p)
            if p.repetition_penalty != 1.0:
                self.seen = self._forget(self.seen, r.slot)
            if p.presence_penalty or p.frequency_penalty:        # a preempted request's output counts again
                ids = np.full(self.sched.max_len, self.md.cfg.vocab_size, np.int32)
                ids[:len(r.output)] = r.output
                self.cache[COUNTS] = self._recount(self.cache[COUNTS], r.slot, ids)
            biased = bool(p.logit_bias) or p.min_tokens > 0
            if biased or self.slot_biased[r.slot]:               # set, or cleared of the slot's last request's
                self.cache[BIAS] = self._set_rows(self.cache[BIAS], np.array([r.slot], np.int32),
                                                  bias_row(p, self.md.cfg.vocab_size)[None])
                self.slot_biased[r.slot] = biased
            self.stats["prompt_tokens"] += 0 if r.preemptions else len(r.prompt)
            self.stats["prefix_hit_tokens"] += r.prefix_hit_tokens

    def _flags(self, slots) -> tuple[bool, int | None, int]:
        """(greedy, logprobs, cut) for the rows in a step: argmax suffices; None (no row wants logprobs),
        0 (only the chosen tokens') or TOP_LOGPROBS (some row wants alternatives); the cuts its rows'
        draws need, sampler.CUT_* (finding top_k and top_p costs ~1.4 ms a step at 128 rows on the
        H200, top_p alone half of it; a draw without them ~0.15)."""
        most = self.slot_logprobs[slots].max()           # three numpy reductions (two were ~7 us)
        logprobs = None if most < 0 else (TOP_LOGPROBS if most > 0 else 0)
        greedy = not self.slot_sampled[slots].any()
        return greedy, logprobs, 0 if greedy else int(self.slot_cut[slots].max())

    def step(self) -> None:
        """Admit, feed one planned step (or n decode steps in one call), emit tokens, free finished rows.

        A decode call is left running when launched. The next step either chains the next decode
        call behind it (the same rows and nothing else to schedule: it starts from the device's own
        last tokens, so the host reads back and emits one call while the device runs the next, and
        the device never waits for the host) or, when the rows change, is read back after the next
        step is planned and dispatched (overlap_steps), as a packed step is; before a first-token
        step, whose tokens come from the host."""
        t0, self._waited = time.perf_counter(), 0.0
        prev, self._pflight = self._pflight, None
        if self._flight is not None:
            flight, self._flight = self._flight, None
            with placement(self.rules, self.mesh):
                self._flight = self._chain(flight)
            if self._flight is not None or not (self.overlap_steps and self.chain_decode) or flight.spec:
                self._land(flight)
            else:                 # the rows change: plan the next step while it runs
                prev = flight
        if self._flight is None:
            while self._plan_and_dispatch(prev):       # read back first: plan again with its tokens
                prev = None
        busy = time.perf_counter() - t0
        self.stats["busy_s"] += busy
        self.stats["host_s"] += busy - self._waited

    def _plan_and_dispatch(self, prev) -> bool:
        """Admit, plan and dispatch the step's calls, then read back `prev` (a call in flight, or None):
        rows whose samples in flight end them free their slots first (Scheduler.release_finishing), and
        rows whose tokens are still on the device are fed from it. True when it read `prev` back
        first instead, for a first-token step (fed from the host): the caller plans again."""
        if prev is not None:
            self.sched.release_finishing()
        self._admit()
        self._refresh_masks()
        if self.sched.running():
            decodes, prefills = self.sched.plan()
            one_left = bool(prefills) and self.first_token_decode and all(r.n_tokens - r.cached == 1
                                                                          for r, *_ in prefills)
            if one_left and prev is not None:
                self._land(prev)
                return True
            with placement(self.rules, self.mesh):
                if prefills and not one_left:
                    flight = self._packed(decodes, prefills)
                    if prev is not None:           # read back while this one runs
                        self._land(prev)
                        self.stats["overlapped_calls"] += 1
                        prev = None
                    # left running unless only prompts end here and no prompt work follows: a lone prompt's
                    # first token then waits for no planning of the step after it
                    if flight.rows and self.overlap_steps and (decodes or self.sched.prompts_left()):
                        self._pflight = flight
                    else:
                        self._land(flight)
                elif one_left:
                    firsts = [r for r, *_ in prefills]
                    if not decodes and self._hidden_kept(firsts):
                        self._head_tokens(firsts)
                    else:
                        self._first_tokens(decodes, firsts)
                elif decodes and self._speculates(decodes):
                    if prev is not None:       # its tokens first: the drafts read each row's tokens on the host
                        self._land(prev)
                        return True
                    self._flight = self._speculate(decodes) or self._launch_decode(decodes, 1)
                elif decodes:
                    n = self.guided_steps if self._guides_running() else self.steps_per_call
                    if n > 1 and not self.sched.reserve_ahead(decodes, n):
                        n = 1
                    self._flight = self._launch_decode(decodes, n)
                    if prev is not None:
                        self.stats["overlapped_calls"] += 1
        if prev is not None:
            self._land(prev)
        return False

    def _launch(self, key, fn, *args, weights=None, **kw):
        """Dispatch one device call (its outputs stay on the device); compiles counted. weights: the
        leaves fn takes (default: every serving weight)."""
        first = key not in self._programs
        t_call = time.perf_counter()
        self.cache, self.seen, out = fn(self.weights if weights is None else weights, self.cache, self.seen, *args, **kw)
        if first:                       # the dispatch compiled (and waited for) the program
            jax.block_until_ready(out)
            self._programs.add(key)
            self.stats["compiles"] += 1
            self.stats["compile_s"] += time.perf_counter() - t_call
            self._waited += time.perf_counter() - t_call
        else:                           # host time handing the call over (host_s includes it)
            self.stats["dispatch_s"] += time.perf_counter() - t_call
        self.stats["device_calls"] += 1
        return out

    def _fetch(self, out):
        """A call's outputs on the host (waits for the device); the wait counted."""
        t = time.perf_counter()
        with self.device_wait():
            out = calls.fetch(out)
        self.stats["device_wait_s"] += time.perf_counter() - t
        self._waited += time.perf_counter() - t
        return out

    def _call(self, key, fn, *args, **kw):
        """One device call, its outputs on the host; (outputs, launch time, time read back)."""
        t_call = time.perf_counter()
        out = self._fetch(self._launch(key, fn, *args, **kw))
        return out, t_call, time.perf_counter()

    def _row_inputs(self, slots):
        """Sampler settings and counters of the rows at `slots` (padding rows: slot 0's, ignored)."""
        return {k: v[slots] for k, v in self.slot_rows.items()}

    def _land(self, f: Flight) -> None:
        """Read back a call in flight and emit its rows' tokens. Rows ended by an earlier call (a call
        ran on for them) or preempted since (they recompute these tokens) are skipped; a prompt fed to
        its end offers its pages to the prefix cache after its first token goes out (hashing them is
        ~15-200 us per 2k-token prompt)."""
        if f.spec:
            return self._land_spec(f)
        if not f.rows:                    # no row samples a token it keeps: nothing to read
            return
        out = self._fetch(f.out)
        toks = out["tokens"] if f.decodes is not None else out["tokens"][None]            # [n, rows]
        lps = logprob_rows(out, 1 if f.decodes is not None else 0) if f.logprobs is not None else None
        for r, i, kept, preemptions, prompt_end in f.rows:
            if r.preemptions != preemptions:       # its pending count was reset when it was preempted
                continue
            r.pending -= kept
            if r.finish_reason is not None:
                continue
            if self._emit(r, toks[:kept, i], lps[i] if lps else None) or not prompt_end:
                continue
            self.sched.register(r)

    def _slots_for(self, key, make) -> calls.Slots:
        """The host-input layout of a call's shape (calls.Slots), made once per shape and kept."""
        if key not in self._slots:
            self._slots[key] = make()
        return self._slots[key]

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
