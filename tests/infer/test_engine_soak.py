"""A soak of the engine under random traffic: arrivals between steps, aborts, stop tokens, prompts sharing
prefixes (the prefix cache and its waits), a page pool tight enough to preempt, and random engine
settings (steps per call, chunk width, overlapped and chained calls, the first-token paths, speculation).
Every request's tokens are those it gets alone in an engine without a cache (float32), an aborted one's
a prefix of them, and every page comes back.

Marked slow (each episode's engine compiles its own programs: about a minute on 2 cores); the default
run covers each behaviour on its own: tests/infer/test_infer_engine.py (batching equals alone, aborts),
test_prefix_cache.py (preemption with shared prefixes and mixed kinds), test_speculative.py.
`pytest -m slow tests/infer/test_engine_soak.py` runs it; SOAK_EPISODES=N runs more episodes."""
import os

import numpy as np
import pytest

from meshlab.infer.engine import Engine
from meshlab.infer.sampler import SamplingParams
from tests.helpers import tiny_served_model

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("engine_soak"), pytest.mark.cheap_codegen]

MAX_LEN, PAGE = 96, 4


@pytest.fixture(scope="module")
def tiny():
    md, params, _ = tiny_served_model()
    return md, params


@pytest.fixture(scope="module")
def alone(tiny):
    """Each request alone, without a cache: (prompt, params) -> output tokens, computed once."""
    eng = Engine(*tiny, max_len=MAX_LEN, max_seqs=1, page_size=PAGE, chunk=8, steps_per_call=4, prefix_cache=False)
    memo = {}

    def run(prompt, sp):
        key = (tuple(prompt), repr(sp))
        if key not in memo:
            memo[key] = eng.generate([prompt], sp)[0]
        return memo[key]
    return run


def random_params(rng) -> SamplingParams:
    """Greedy, or seeded sampling with cuts, penalties and bias; some rows ask for logprobs; random stops."""
    kind = [{}, {}, dict(temperature=0.8, seed=int(rng.integers(100))),
            dict(temperature=1.0, top_k=int(rng.integers(1, 20)), top_p=0.9, seed=int(rng.integers(100))),
            dict(repetition_penalty=1.3, logprobs=2),
            dict(temperature=0.7, min_p=0.05, frequency_penalty=0.5, logit_bias={5: 3.0}, seed=3)][rng.integers(6)]
    max_tokens = int(rng.integers(1, 20))
    return SamplingParams(max_tokens=max_tokens, min_tokens=int(rng.integers(0, min(3, max_tokens + 1))),
                          stop_token_ids=tuple(rng.integers(0, 257, size=int(rng.integers(0, 3))).tolist()), **kind)


def random_engine(tiny, rng) -> Engine:
    """Random settings; a pool from one request's pages (any request fits alone) to a few requests'."""
    return Engine(*tiny, max_len=MAX_LEN, page_size=PAGE, prefix_cache=True, max_seqs=int(rng.choice([2, 3, 4])),
                  num_pages=int(rng.integers(MAX_LEN // PAGE + 1, 40)), steps_per_call=int(rng.choice([1, 2, 4])),
                  chunk=int(rng.choice([4, 8, 16])), overlap_steps=bool(rng.integers(2)),
                  chain_decode=bool(rng.integers(2)), first_token_decode=bool(rng.integers(2)),
                  reuse_hidden=bool(rng.integers(2)), speculative_tokens=int(rng.choice([0, 0, 2])))


def traffic(eng, rng):
    """Requests arriving between steps (some repeating their tail, for prompt lookup) and a few aborts;
    returns [(request, prompt, params)] and the ids of those aborted."""
    stems = [rng.integers(0, 257, size=int(n)).tolist() for n in rng.integers(1, 30, 3)]
    sent, aborted = [], set()
    for _ in range(int(rng.integers(20, 60))):
        for _ in range(int(rng.poisson(0.6))):
            stem = stems[rng.integers(3)]
            prompt = stem[:int(rng.integers(1, len(stem) + 1))] + rng.integers(0, 257, size=int(rng.integers(0, 6))).tolist()
            if rng.random() < 0.3:
                prompt += prompt[-4:] * 2
            sp = random_params(rng)
            if len(prompt) + sp.max_tokens <= MAX_LEN:
                sent.append((eng.add_request(prompt, sp), prompt, sp))
        if sent and rng.random() < 0.08:
            req = sent[int(rng.integers(len(sent)))][0]
            eng.abort(req)
            aborted.add(id(req))
        if eng.has_work():
            eng.step()
    for _ in range(5000):              # bounded: a leak that starves a request must fail, not hang
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work(), "the engine did not drain"
    return sent, aborted


@pytest.mark.parametrize("episode", range(int(os.environ.get("SOAK_EPISODES", 4))))
def test_random_traffic_gives_each_request_its_tokens_alone(tiny, alone, episode):
    rng = np.random.default_rng(episode)
    eng = random_engine(tiny, rng)
    sent, aborted = traffic(eng, rng)
    for req, prompt, sp in sent:
        assert req.finish_reason is not None
        if sp.temperature > 0 and eng.speculative_tokens:
            continue            # speculative sampling: plain sampling's distribution, not its draws (speculative.py)
        ref = alone(prompt, sp)
        if id(req) in aborted and req.finish_reason == "abort":
            assert req.output == ref.output[:len(req.output)]
            continue
        assert req.output == ref.output, (prompt, sp)
        for got, want in zip(req.logprobs, ref.logprobs):
            assert abs(got[0] - want[0]) < 1e-5 and got[1].keys() == want[1].keys()
    s = eng.sched
    assert not s.computing and not s.waiting and not s.running()
    assert s.pool.available == s.pool.total
    assert eng.stats["requests_finished"] == len(sent)
    assert eng.stats["aborted"] == sum(req.finish_reason == "abort" for req, *_ in sent) <= len(aborted)
