"""Prompt logprobs: each prompt token's log-probability given the tokens before it, and its most
likely alternatives (OpenAI completions' `echo` with `logprobs`: how evaluation harnesses such as
lm-evaluation-harness score a continuation).

The engine's packed steps run the LM head on each row's last token only, and a prefix-cache hit
computes nothing for its cached tokens, so a prompt's logprobs come from a pass of their own: the
prompt in `chunk`-token pieces through a one-row contiguous cache (kv_cache.contiguous_attend,
the layout's dense attention), the head over every position, the log-softmax at the next prompt
token and the top TOP_LOGPROBS. What it costs: a prefill of the prompt with the head over every
token ([chunk, vocab] fp32 logits per piece) and each piece's dense attention over the cache ([kv
heads, group, chunk, L] fp32 scores). The cache is L tokens, the prompt's length rounded up to chunk
times a power of two (at most max_len rounded up to chunks), made per request: memory and attention follow the prompt, not the engine's
max_len, and one program is compiled per L met (at most log2(max_len / chunk) + 1). A greedy one-token
request (what a harness sends to score) takes its token from the same pass's last position
(Scoring._scored); any other request asking for prompt logprobs is then prefilled again
by the engine's own steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshlab.infer import kv_cache
from meshlab.infer.programs import TOP_LOGPROBS, _bind
from meshlab.infer.sampler import penalised_row
from models import serving


def make_score_program(md, layers: str):
    """score(params, cache, tokens [C], positions [C], valid [C], targets [C]) -> (cache, logprob [C],
    top_logprob [C, K], top_id [C, K]): the log-softmax of targets[i] after tokens[..i], jitted,
    cache donated. params from programs.serving_params(md, ., layers)."""
    vocab = md.cfg.vocab_size

    def score(params, cache, tokens, positions, valid, targets):
        model, per_layer = _bind(md, params, layers)
        attend = kv_cache.contiguous_attend(positions[None], valid[None])
        h, cache = serving.forward(model, tokens[None], positions[None], cache, attend, unroll=layers == "unroll",
                                   layers=per_layer)                                   # [1, C, d]
        lp = jax.nn.log_softmax(model.logits(h)[0, :, :vocab], axis=-1)                 # [C, V] fp32
        top_lp, top_id = jax.lax.top_k(lp, min(TOP_LOGPROBS, vocab))                    # [C, K]
        return cache, jnp.take_along_axis(lp, targets[:, None], axis=1)[:, 0], top_lp, top_id
    return jax.jit(score, donate_argnums=(1,))


class PromptScorer:
    """Prompt logprobs for an engine: shares its serving params (read only); a one-row cache per
    request. It runs outside the engine's rule file: a rule that shards the cache's batch (fsdp_tp's
    cache_batch) cannot split one row, so XLA places the cache and activations from the params'
    own shardings."""

    def __init__(self, md, params, layers: str, max_len: int, chunk: int):
        self.md, self.params, self.max_len, self.chunk = md, params, max_len, min(chunk, max_len)
        self.fn = make_score_program(md, layers)

    def __call__(self, prompt, top: int) -> tuple[list, tuple]:
        """([None, then per token i >= 1: (logprob of prompt[i] after prompt[:i], {id: logprob} of the
        `top` most likely)], (ids, logprobs) of the TOP_LOGPROBS most likely tokens after the whole
        prompt). The first token has no context, as OpenAI reports it (null)."""
        if not 0 <= top <= TOP_LOGPROBS:
            raise ValueError(f"top={top} alternatives must be in [0, {TOP_LOGPROBS}]")
        n, c = len(prompt), self.chunk
        if not 0 < n <= self.max_len:
            raise ValueError(f"a prompt of {n} tokens cannot be scored in a context of {self.max_len}")
        chunks = -(-n // c)
        ids = np.zeros(chunks * c + 1, np.int32)
        ids[:n] = prompt
        length = c * min(1 << (chunks - 1).bit_length(), -(-self.max_len // c))   # L: chunks in a power of two
        cache = kv_cache.init_contiguous(self.md.cfg, 1, length)                   # [layers, 1, L, kvh, hd]
        pieces = []
        for start in range(0, n, c):               # position i scores token i + 1 (the last: what follows)
            pos = np.arange(start, start + c, dtype=np.int32)
            cache, *outs = self.fn(self.params, cache, ids[start:start + c], pos, pos < n, ids[start + 1:start + c + 1])
            pieces.append(outs)
        lp, top_lp, top_id = (np.concatenate(x)[:n] for x in zip(*jax.device_get(pieces)))   # [n], [n, K] x2
        following = top_id[n - 1].tolist(), top_lp[n - 1].tolist()
        lp, top_lp, top_id = lp.tolist(), top_lp[:, :top].tolist(), top_id[:, :top].tolist()
        return [None] + [(lp[i], dict(zip(top_id[i], top_lp[i]))) for i in range(n - 1)], following


class Scoring:
    """Engine's prompt logprobs (a mixin, as meshlab.infer.packed's PackedSteps is): the scorer, built
    at the first request for them, and their admission."""

    def prompt_logprobs(self, prompt, top: int = 0) -> list:
        """Each prompt token's logprob given the ones before it and its `top` best alternatives
        ([None, (logprob, {id: logprob}), ...]); a pass of its own over the prompt, on the engine's
        weights. Call it from the thread that runs the engine."""
        return self._score(prompt, top)[0]

    def _score(self, prompt, top: int) -> tuple[list, tuple]:
        if self._scorer is None:
            self._scorer = PromptScorer(self.md, self.params, self.layers, self.sched.max_len, self.chunk)
        return self._scorer(prompt, top)

    def _scored(self, req) -> bool:
        """Score req's prompt when it asks (admission, engine thread). A greedy one-token request (how
        evaluation harnesses score) then takes its token from the pass's last position, the argmax of
        the same model's logits, instead of a second prefill: True when it did (req is finished)."""
        p = req.params
        if p.prompt_logprobs is None or req.prompt_logprobs is not None:
            return False
        req.prompt_logprobs, (ids, values) = self._score(req.prompt, p.prompt_logprobs)
        if p.max_tokens != 1 or p.temperature > 0 or penalised_row(p):
            return False
        self.stats["prompt_tokens"] += len(req.prompt)
        self._emit(req, [ids[0]], None if p.logprobs is None else [(values[0], ids, values)])
        return True
