"""Prefix caching on the paged cache: shared full pages by chained content key, reference counts,
LRU eviction; the prefill tokens computed are counted and the tokens are those of no cache."""
import dataclasses

import numpy as np
import pytest
from flax import nnx

import models
from meshlab.infer.engine import Engine
from meshlab.infer.pages import PagePool, page_keys
from meshlab.infer.sampler import SamplingParams
from models import model_def

# One xdist worker builds the module fixture once per suite; its compiles are compile-bound, so
# cheap to generate.
pytestmark = [pytest.mark.xdist_group("prefix_cache"), pytest.mark.cheap_codegen]


def test_page_keys_chain_over_the_prefix():
    a = page_keys(list(range(12)), 4, [], 3)
    b = page_keys([99] + list(range(1, 12)), 4, [], 3)
    assert len(set(a)) == 3 and a[0] != b[0]
    assert a[1] != b[1] and a[2] != b[2]            # same block tokens, different prefix: different key
    assert page_keys(list(range(12)), 4, a[:1], 3) == a


def test_pool_refcounts_and_lru_eviction():
    pool = PagePool(6)                               # pages 1..5
    pages = pool.take(4)
    keys = [bytes([i]) * 32 for i in range(4)]
    pool.register(pages, keys)
    assert pool.lookup(keys) == pages and pool.available == 1 and pool.held == 0.8
    pool.acquire(pages[:2])                          # a second holder of the first two
    pool.give(pages)                                 # first holder leaves: pages 3, 4 free but cached
    assert pool.available == 3 and pool.lookup(keys) == pages and pool.held == pytest.approx(0.4)
    pool.give(pages[:2])
    assert pool.available == 5
    got = pool.take(2)                               # the fresh page, then the least recently freed cached one
    assert got[0] not in pages and got[1] == pages[2] and pool.evictions == 1
    assert pool.lookup(keys) == pages[:2]            # the chain stops at the evicted page
    with pytest.raises(MemoryError):
        pool.take(4)


def test_pool_evicts_in_the_order_freed_last_through_stale_entries():
    """The free cached pages' queue is read lazily (pages taken back by acquire, or freed again, leave
    stale entries; compaction drops them): over random takes, gives, registrations and acquires, the
    pages handed out, the free list and its order are those of an ordered map kept exactly."""
    import collections
    import itertools
    rng = np.random.default_rng(7)
    pool = PagePool(12)
    pool.stale_limit = 12                                     # compact often
    fresh, lru, ref, keyed = collections.deque(range(1, 12)), collections.OrderedDict(), collections.Counter(), set()
    held, names = [], itertools.count()
    for _ in range(3000):
        op = rng.choice(4, p=[0.1, 0.35, 0.2, 0.35])          # few takes: stale entries pile up
        if op == 0 and len(fresh) + len(lru):                 # a request takes pages
            n = int(rng.integers(1, len(fresh) + len(lru) + 1))
            expect = []
            for _ in range(n):
                page = fresh.popleft() if fresh else lru.popitem(last=False)[0]
                keyed.discard(page)
                ref[page] = 1
                expect.append(page)
            assert pool.take(n) == expect
            held.append(expect)
        elif op == 1 and held:                                # a request leaves
            pages = held.pop(int(rng.integers(len(held))))
            pool.give(pages)
            for page in pages:
                ref[page] -= 1
                if not ref[page]:
                    if page in keyed:
                        lru[page] = None
                    else:
                        fresh.append(page)
        elif op == 2 and held:                                # its pages become findable
            pages = [p for p in held[int(rng.integers(len(held)))] if p not in keyed]
            pool.register(pages, [b"k%d" % next(names) for _ in pages])
            keyed.update(pages)
        elif op == 3 and keyed:                               # a prefix hit takes cached pages back
            pages = sorted(rng.choice(sorted(keyed), size=int(rng.integers(1, len(keyed) + 1)), replace=False).tolist())
            pool.acquire(pages)
            for page in pages:
                lru.pop(page, None)
                ref[page] += 1
            held.append(pages)
        assert pool.free == list(fresh) + list(lru) and pool.available == len(fresh) + len(lru)
    assert len(pool.lru) <= 12 + pool.total                   # compaction kept the stale entries bounded


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    md = model_def(cfg)
    return md, nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))


def make(tiny, prefix_cache, num_pages=None, **kw):
    md, params = tiny
    return Engine(md, params, max_len=96, max_seqs=2, page_size=4, num_pages=num_pages, chunk=8,
                  steps_per_call=4, prefix_cache=prefix_cache, **kw)


def computed(engine, prompt, max_tokens=6):
    before = engine.stats["prefill_tokens"]
    req = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]
    return req, engine.stats["prefill_tokens"] - before


def test_shared_prefix_recomputes_only_the_tail(tiny):
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 257, size=24).tolist()                    # six full pages
    tails = [rng.integers(0, 257, size=3).tolist() for _ in range(2)]
    cached, plain = make(tiny, True), make(tiny, False)
    first, n1 = computed(cached, prefix + tails[0])
    second, n2 = computed(cached, prefix + tails[1])
    again, n3 = computed(cached, prefix + tails[0])
    aligned, n4 = computed(cached, prefix)          # fully cached up to a kept page end: the head alone
    assert (n1, n2, n3, n4) == (27, 3, 3, 0) and cached.stats["head_calls"] == 1
    assert (second.prefix_hit_tokens, again.prefix_hit_tokens, aligned.prefix_hit_tokens) == (24, 24, 24)
    assert cached.stats["prefix_hit_tokens"] == 72
    for req in (first, second, again, aligned):
        ref, n = computed(plain, req.prompt)
        assert req.output == ref.output and n == len(req.prompt)
    pool = cached.sched.pool
    assert pool.available == pool.total and not pool.ref.any()


def test_requests_sent_together_compute_a_shared_prefix_once(tiny):
    """Three prompts with a 24-token prefix (six pages) arrive together: the first computes it, the
    others wait for its pages (their rows stay free meanwhile), then compute only their tails; a
    request without the prefix is not held back. The tokens are those of no cache."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 257, size=24).tolist()
    prompts = [prefix + rng.integers(0, 257, size=3).tolist() for _ in range(3)]
    prompts.insert(1, rng.integers(0, 257, size=10).tolist())
    md, params = tiny
    eng = Engine(md, params, max_len=96, max_seqs=4, page_size=4, chunk=8, steps_per_call=4)
    before = eng.stats["prefill_tokens"]
    reqs = eng.generate(prompts, SamplingParams(max_tokens=4))
    assert [r.prefix_hit_tokens for r in reqs] == [0, 0, 24, 24]
    assert eng.stats["prefill_tokens"] - before == 27 + 10 + 2 * 3
    assert not eng.sched.computing and not eng.sched.scoring
    plain = make(tiny, False)
    for r in reqs:
        assert r.output == computed(plain, r.prompt, 4)[0].output
    # Under a repetition penalty nothing comes from the cache, so nothing waits.
    penal = eng.generate([prefix + [1, 2], prefix + [3, 4]], SamplingParams(max_tokens=2, repetition_penalty=1.2))
    assert [r.prefix_hit_tokens for r in penal] == [0, 0]


def test_waiting_for_pages_in_flight_survives_preemption_and_mixed_kinds(tiny):
    """A tight pool (preemptions), prompts sharing prefixes of several lengths, plain and scored and
    repetition-penalised requests all sent at once, in two waves: every greedy token is the one of no
    cache, every prompt logprob the one of a scored request alone, nothing is left in flight, and some
    requests did wait for a page in flight."""
    rng = np.random.default_rng(9)
    stems = [rng.integers(0, 257, size=n).tolist() for n in (9, 17, 26)]     # four prompts in a row on each
    md, params = tiny
    eng = Engine(md, params, max_len=48, max_seqs=4, page_size=4, num_pages=15, chunk=8, steps_per_call=2)
    alone = make(tiny, False)
    kinds = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=3, prompt_logprobs=1),
             SamplingParams(max_tokens=4, repetition_penalty=1.3)]
    for wave in range(2):
        prompts = [stems[i // 4][:len(stems[i // 4]) - wave] + rng.integers(0, 257, size=1 + i % 4).tolist()
                   for i in range(12)]
        params_of = [kinds[i % 5 % 3] for i in range(12)]
        reqs = eng.generate(prompts, params_of)
        for r, sp in zip(reqs, params_of):
            ref = alone.generate([r.prompt], sp)[0]
            assert r.output == ref.output
            if sp.prompt_logprobs is not None:
                np.testing.assert_allclose([x[0] for x in r.prompt_logprobs[1:]],
                                           [x[0] for x in ref.prompt_logprobs[1:]], atol=1e-5)
    assert eng.stats["preemptions"] > 0 and eng.sched.counts["prefix_waits"] > 0
    assert not eng.sched.computing and not eng.sched.scoring and not eng.sched.waiting


def test_copies_share_pages_and_eviction_keeps_tokens(tiny):
    """Two copies of a cached prompt hold the same pages at once; a small pool evicts the cache
    (least recently freed first) and the tokens stay those of no cache."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 257, size=21).tolist()
    eng = make(tiny, True, num_pages=16)                               # 15 pages: about two requests
    base, _ = computed(eng, prompt)
    a = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=1))
    b = eng.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=2))
    eng.step()
    assert a.pages[:5] == b.pages[:5] and eng.sched.pool.ref[a.pages[0]] == 2
    eng.run()
    assert a.prefix_hit_tokens == b.prefix_hit_tokens == 20
    other = rng.integers(0, 257, size=40).tolist()
    computed(eng, other, max_tokens=20)                                # needs 15 pages: evicts the prompt's
    assert eng.sched.pool.evictions > 0
    again, n = computed(eng, prompt)
    assert again.output == base.output and again.prefix_hit_tokens < 20 and n == 21 - again.prefix_hit_tokens


def test_first_token_step_takes_decoding_rows_along(tiny, monkeypatch):
    """A prompt met before (all cached) arriving while another request decodes: both feed one token
    in one decode step of the b=2 bucket (the decoding row's next token, the prompt's first), then
    decode together; every token equals that request's alone, and the prompt's K/V pages stay."""
    rng = np.random.default_rng(8)
    a, b = rng.integers(0, 257, size=10).tolist(), rng.integers(0, 257, size=12).tolist()   # b: three full pages
    eng = make(tiny, True)
    alone_b = [computed(eng, b, max_tokens=6)[0].output for _ in range(2)]     # the second: all cached
    alone_a = computed(eng, a, max_tokens=12)[0].output
    assert alone_b[0] == alone_b[1]
    pages = eng.sched.pool.lookup(page_keys(b, 4, [], 3))
    kept = {name: np.asarray(eng.cache[name])[:, pages] for name in ("k", "v")}
    keys, launch = [], eng._launch
    monkeypatch.setattr(eng, "_launch", lambda key, *x, **kw: keys.append(key) or launch(key, *x, **kw))
    ra = eng.add_request(a, SamplingParams(max_tokens=12))
    while not ra.output or eng._flight is None:                        # a decodes (a call in flight)
        eng.step()
    rb = eng.add_request(b, SamplingParams(max_tokens=6))
    eng.run()
    assert ("first", 2, 1, True, None, False) in keys and rb.prefix_hit_tokens == 12
    assert ra.output == alone_a and rb.output == alone_b[0]
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(eng.cache[name])[:, pages], kept[name])


def argmax_of_uncached(md, params, req) -> list:
    """The greedy tokens the uncached forward gives after req's prompt (its output's length)."""
    import jax.numpy as jnp
    seq = req.prompt + req.output
    logits = np.asarray(md.bind(params)(jnp.asarray([seq])))[0, :, :md.cfg.vocab_size]
    return logits[len(req.prompt) - 1:-1].argmax(-1).tolist()


def test_cached_tail_runs_in_the_narrowest_row_that_fits(tiny, monkeypatch):
    """A prompt whose prefix is cached computes only its uncached tokens, in the narrowest packed row
    that fits (16 up to a page, 64 beyond), its first token never from a call of several decode steps;
    a prompt with one token left to feed (fully cached: its last token; or one uncached token) takes
    a one-step decode call, and a fully cached one leaves the shared pages as they were. Tokens equal
    the uncached forward's argmax, and the first token's log-probabilities those of an engine without
    prefix cache, whose chunk-wide rows compute the whole prompt (float32)."""
    md, params = tiny
    make_one = lambda **kw: Engine(md, params, max_len=256, max_seqs=2, page_size=16, chunk=128,  # noqa: E731
                                   steps_per_call=4, **kw)
    eng, wide = make_one(), make_one(prefix_cache=False)
    assert eng.WIDTHS == [16, 64, 128]
    wide.WIDTHS = [wide.chunk]                                          # every piece in a chunk-wide row
    shared = np.random.default_rng(2).integers(0, 257, size=96).tolist()   # six pages
    for e in (eng, wide):
        e.generate([shared + [1, 2, 3]], SamplingParams(max_tokens=2))
    pages = eng.sched.pool.lookup(page_keys(shared, 16, [], 6))
    assert len(pages) == 6
    before = {name: np.asarray(eng.cache[name])[:, pages] for name in ("k", "v")}
    keys, launch = [], eng._launch
    monkeypatch.setattr(eng, "_launch", lambda key, *a, **kw: keys.append(key) or launch(key, *a, **kw))
    sp = SamplingParams(max_tokens=1, logprobs=5)                      # the packed call alone
    first = ("first", 1, 1, True)                 # one token to feed, no output yet: one decode step, b=1
    cases = ((shared + [4, 5, 6, 7], ("packed", 0, 1, 16), 4), (shared + list(range(10, 50)), ("packed", 0, 1, 64), 40),
             (shared, ("head", 1, True), 0), (shared + [9], first, 1))   # all cached: the kept hidden state
    for prompt, program, fed in cases:
        keys.clear()
        req, n = computed(eng, prompt, max_tokens=3)
        assert req.prefix_hit_tokens == 96 and n == fed
        assert keys[0][:len(program)] == program and all(k[0] == "decode" for k in keys[1:])
        assert req.output == argmax_of_uncached(md, params, req)
        mine = eng.generate([prompt], sp)[0].logprobs[0]
        ref = wide.generate([prompt], sp)[0].logprobs[0]
        assert sorted(mine[1]) == sorted(ref[1])
        np.testing.assert_allclose([mine[0], *(mine[1][t] for t in ref[1])], [ref[0], *ref[1].values()],
                                   rtol=1e-5, atol=1e-5)
    eng.reuse_hidden = False                                           # the A/Bs: its last token fed again,
    keys.clear()                                                       # in a decode step, then in a packed row
    again, n = computed(eng, shared, max_tokens=3)
    assert keys[0][:4] == first and n == 1 and again.output == computed(wide, shared, 3)[0].output
    eng.first_token_decode = False
    keys.clear()
    again, n = computed(eng, shared, max_tokens=3)
    assert keys[0][:4] == ("packed", 0, 1, 16) and n == 1 and again.output == computed(wide, shared, 3)[0].output
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(eng.cache[name])[:, pages], before[name])


def test_cached_request_computes_its_tail_in_the_small_bucket(tiny, monkeypatch):
    """With the paged kernels (interpreted here, as on the GPU): a request whose 96-token prefix
    is cached computes exactly its 4-token tail, in one call of the narrow (16-wide) packed
    program whose attention is the paged prompt kernel (it reads the cached pages in place, no
    window of the table's width), then decodes; its tokens equal the uncached forward's argmax.
    So do those of the fully cached prefix, which feeds only its last token in a one-step decode call
    (the fused RoPE + write + attention kernel; its kept hidden state left unused), and its shared
    pages stay as they were."""
    from pallas_kernels import paged_prefill as pa
    md, params = tiny
    eng = Engine(md, params, max_len=256, max_seqs=1, page_size=16, chunk=128, steps_per_call=2, impl="pallas",
                 interpret=True, layers="fused", reuse_hidden=False)
    shared = np.random.default_rng(3).integers(0, 257, size=96).tolist()
    eng.generate([shared + [1, 2, 3]], SamplingParams(max_tokens=2))
    widths, keys = [], []
    real = pa.paged_prefill_attention
    monkeypatch.setattr(pa, "paged_prefill_attention", lambda q, *a, **kw: widths.append(q.shape[1]) or real(q, *a, **kw))
    launch = eng._launch
    monkeypatch.setattr(eng, "_launch", lambda key, *a, **kw: keys.append(key) or launch(key, *a, **kw))
    before = eng.stats["prefill_tokens"]
    req = eng.generate([shared + [4, 5, 6, 7]], SamplingParams(max_tokens=3))[0]
    assert req.prefix_hit_tokens == 96 and eng.stats["prefill_tokens"] - before == 4
    assert [k[:4] for k in keys] == [("packed", 0, 1, 16), ("decode", 1, 2, True)]
    assert widths == [16, 16]                         # traced once per layer, 16 queries wide
    assert req.output == argmax_of_uncached(md, params, req)
    keys.clear()
    pages = eng.sched.pool.lookup(page_keys(shared, 16, [], 6))
    kept = {name: np.asarray(eng.cache[name])[:, pages] for name in ("k", "v")}
    req = eng.generate([shared], SamplingParams(max_tokens=3))[0]
    assert req.prefix_hit_tokens == 96 and eng.stats["prefill_tokens"] - before == 4 + 1
    assert [k[:4] for k in keys] == [("first", 1, 1, True), ("decode", 1, 2, True)]
    assert req.output == argmax_of_uncached(md, params, req)
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(eng.cache[name])[:, pages], kept[name])


def test_each_call_sends_one_host_buffer_and_each_page_is_offered_once(tiny, monkeypatch):
    """Host work per request and call stays flat: a device call gets the weights as one flat list
    and its host inputs as one int32 buffer (one host-to-device copy, not one per array; a chained
    decode call's tokens come from its rows' LAST entries on the device), and a request's full pages
    are offered to the prefix cache once each over its life, not again after every chunk and at release."""
    import jax
    eng = make(tiny, True, max_step_tokens=10)                        # one chunk row per step
    seen = {"packed": [], "decode": []}
    for name in seen:
        real = getattr(eng, f"{name}_call")
        record = lambda *a, real=real, name=name, **kw: seen[name].append(a) or real(*a, **kw)
        monkeypatch.setattr(eng, f"{name}_call", record)
    offered, register = [], eng.sched.pool.register
    monkeypatch.setattr(eng.sched.pool, "register", lambda pages, *a: offered.extend(pages) or register(pages, *a))
    prompt = np.random.default_rng(4).integers(0, 257, size=27).tolist()
    req, n = computed(eng, prompt, max_tokens=6)                       # 4 chunks of <= 8, then decode calls
    assert n == 27 and len(seen["packed"]) == 4 and seen["decode"]
    assert len(seen["decode"]) > 1                                     # chained calls among them
    for weights, cache, state, *rest in seen["packed"] + seen["decode"]:
        assert isinstance(weights, list) and all(isinstance(w, jax.Array) for w in weights)
        (buf,) = rest                                                 # the host buffer and nothing else
        assert isinstance(buf, np.ndarray) and buf.dtype == np.int32 and buf.ndim == 1
    assert sorted(offered) == sorted(set(offered)) and len(offered) == (27 + 6 - 1) // 4
    again, n2 = computed(eng, prompt, max_tokens=6)
    assert n2 == 3 and again.output == req.output                     # the offered pages serve the repeat


def test_lookup_bisects_and_falls_back_when_a_page_before_was_evicted(monkeypatch):
    """The longest cached prefix of a 128-page prompt is found with a few hash calls, not one per
    page: two when all of it is cached or only its last page is new (the keys of the whole prompt and
    of all but its last page come from one pass), about log2(128) more
    (one per bisection probe) for a prompt that parts from it after 50 pages; when a page inside the prefix was evicted, the
    answer stops before it (every page hashed)."""
    import hashlib
    import types
    from meshlab.infer import pages as pg
    ps, n = 16, 128
    toks = np.random.default_rng(6).integers(0, 128000, ps * n + 5)
    pool = PagePool(n + 10)
    held = pool.take(n)
    pool.register(held, page_keys(toks, ps, [], n))
    calls = []
    monkeypatch.setattr(pg, "hashlib", types.SimpleNamespace(sha256=lambda *a: calls.append(1) or hashlib.sha256(*a)))
    keys = []
    assert pool.longest(toks, ps, n, keys) == held and len(calls) == 2
    tail, calls[:] = np.concatenate([toks[:(n - 1) * ps], toks[(n - 1) * ps:] + 1]), []
    assert pool.longest(tail, ps, n, []) == held[:-1] and len(calls) == 2     # a new last page: no bisection
    assert keys == page_keys(toks, ps, [], n)
    other, calls[:] = np.concatenate([toks[:50 * ps], toks[50 * ps:] + 1]), []
    assert pool.longest(other, ps, n, []) == held[:50] and len(calls) <= 3 + 8
    pool.give([held[40]])
    pool.take(10)                                   # 9 fresh pages, then the cached page 40 is evicted
    assert pool.longest(toks, ps, n, []) == held[:40] and pool.evictions == 1


def test_a_prompt_met_before_samples_from_its_kept_hidden_state(tiny, monkeypatch):
    """A prompt met before up to a page end whose hidden state a packed step kept takes the LM head
    alone (no layer, nothing written): its tokens and log-probabilities equal those of feeding its
    last token again. A page handed out again loses its kept state: here the pool evicts a kept page
    and a decoding request refills it, and a prompt ending on that page feeds its last token."""
    md, params = tiny
    rng = np.random.default_rng(11)
    eng, plain = make(tiny, True, num_pages=6), make(tiny, True, num_pages=6)    # 5 pages: evictions
    plain.reuse_hidden = False
    keys, launch = [], eng._launch
    monkeypatch.setattr(eng, "_launch", lambda key, *a, **kw: keys.append(key) or launch(key, *a, **kw))
    p = rng.integers(0, 257, size=8).tolist()                          # two pages, both ends kept
    sp = SamplingParams(max_tokens=4, logprobs=3)
    for e in (eng, plain):
        e.generate([p], SamplingParams(max_tokens=1))
    keys.clear()
    mine, ref = eng.generate([p], sp)[0], plain.generate([p], sp)[0]
    assert keys[0][:4] == ("head", 1, True, 20) and mine.prefix_hit_tokens == 8
    assert mine.output == ref.output == argmax_of_uncached(md, params, mine)
    for (lp, top), (lp_ref, top_ref) in zip(mine.logprobs, ref.logprobs):
        assert sorted(top) == sorted(top_ref)
        np.testing.assert_allclose([lp, *(top[t] for t in top_ref)], [lp_ref, *top_ref.values()], rtol=1e-5, atol=1e-5)
    kept = np.flatnonzero(eng.sched.hidden_ok)
    a = eng.generate([rng.integers(0, 257, size=10).tolist()], SamplingParams(max_tokens=7))[0]   # 16 fed: 4 pages
    a_pages = eng.sched.pool.lookup(page_keys(a.prompt + a.output[:6], 4, [], 4))
    assert eng.sched.pool.evictions > 0 and len(a_pages) == 4 and a_pages[3] in kept   # p's page, refilled
    keys.clear()
    b = eng.generate([a.prompt + a.output[:6]], SamplingParams(max_tokens=3))[0]
    assert b.prefix_hit_tokens == 16 and keys[0][0] == "first"
    assert b.output == argmax_of_uncached(md, params, b)
