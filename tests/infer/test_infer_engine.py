"""Serving engine on CPU: cached greedy == uncached argmax; continuous batching, packed, chained and
overlapped steps == each request alone or read back step by step; abort, warmup, layer modes, sharding."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from meshlab.infer.engine import ContiguousGenerator, Engine
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.scheduler import AdmissionError
from models import model_def
from tests.helpers import assert_greedy_matches

# One xdist worker runs this file and test_engine_requests.py, which share one engine and its programs
# (tests/infer/conftest.py); the tests are compile-bound, so their programs' code is generated cheaply.
pytestmark = [pytest.mark.xdist_group("infer_engine"), pytest.mark.cheap_codegen]


def test_contiguous_greedy_equals_uncached(tiny):
    md, params, fwd = tiny
    gen = ContiguousGenerator(md, params, batch=2, max_len=64, chunk=16, steps_per_call=4)
    prompts = [[5, 6, 7], list(range(40, 60))]                      # second prompt spans two chunks
    outs = gen.generate(prompts, SamplingParams(max_tokens=9))
    for p, o in zip(prompts, outs):
        assert len(o) == 9
        assert_greedy_matches(fwd, params, p, o)


def test_auto_attention_is_xla_off_gpu_and_bad_impl_is_refused(tiny, engine):
    assert engine.impl == "xla"          # auto: the Pallas kernel only on one GPU (CPU would interpret it)
    md, params, _ = tiny
    with pytest.raises(ValueError, match="must be auto, xla or pallas"):
        Engine(md, params, max_len=64, max_seqs=1, page_size=4, impl="cudnn")
    with pytest.raises(ValueError, match="max_step_tokens=4 must exceed max_seqs=4"):
        Engine(md, params, max_len=64, max_seqs=4, page_size=4, max_step_tokens=4)
    with pytest.raises(ValueError, match="prefill='dense' must be auto"):
        Engine(md, params, max_len=64, max_seqs=1, page_size=4, prefill="dense")
    with pytest.raises(ValueError, match="guided_steps=0 must be >= 1"):
        Engine(md, params, max_len=64, max_seqs=1, page_size=4, guided_steps=0)
    for max_len, page_size in ((64, 0), (-4, 4), (0, 4)):      # was a ZeroDivisionError / a wrong message
        with pytest.raises(ValueError, match=f"max_len={max_len} must be a positive multiple of page_size={page_size}"):
            Engine(md, params, max_len=max_len, max_seqs=1, page_size=page_size)


@pytest.mark.parametrize("layers", ["split", "fused", "kernels"])
def test_batch_one_decode_equals_uncached(tiny, layers):
    """One sequence, one token per step: the q|k|v and wo GEMMs take models/serving._mm_decode's
    zero-second-row path (the shape the batch-1 GPU benchmark times)."""
    md, params, fwd = tiny
    prompt = [5, 6, 7]
    eng = Engine(md, params, max_len=64, max_seqs=1, page_size=4, chunk=8, steps_per_call=4, layers=layers)
    out = eng.generate([prompt], SamplingParams(max_tokens=9))[0].output
    assert len(out) == 9
    assert_greedy_matches(fwd, params, prompt, out)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_long_prompt_takes_several_rows_and_is_read_back_once(tiny, impl):
    """A 38-token prompt alone, two chunk rows of 8 per step (max_step_tokens): its chunks fill both
    rows of each step (3 packed steps, not 5), the first two steps keep no sampled token and are
    dispatched without a read-back (the next planned while the device runs); the tokens are the
    uncached model's. impl="pallas" (interpreted): the second row of a step reads the first row's keys
    through the paged prompt kernel, the GPU's path."""
    md, params, fwd = tiny
    prompt = list(range(40, 78))                                       # (8 + 8) + (8 + 8) + 6 tokens
    eng = Engine(md, params, max_len=64, max_seqs=1, page_size=4, chunk=8, steps_per_call=4, max_step_tokens=17,
                 impl=impl, interpret=impl == "pallas", layers="fused")
    out = eng.generate([prompt], SamplingParams(max_tokens=5))[0].output
    assert eng.stats["packed_calls"] == 3 and eng.stats["unread_calls"] == 2
    assert_greedy_matches(fwd, params, prompt, out)


def test_paged_greedy_equals_uncached(tiny, engine):
    _, params, fwd = tiny
    prompts = [[1, 2, 3], list(range(100, 119))]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=12))
    for r in reqs:
        assert r.finish_reason == "length" and len(r.output) == 12
        assert_greedy_matches(fwd, params, r.prompt, r.output)


def test_continuous_batching_equals_alone(tiny, engine):
    _, params, fwd = tiny
    rng = np.random.default_rng(1)
    lens, maxt = [3, 17, 9, 30, 5, 12, 2], [10, 5, 20, 7, 12, 9, 6]
    prompts = [rng.integers(0, 257, size=n).tolist() for n in lens]
    sps = [SamplingParams(max_tokens=m) for m in maxt]
    sps[2] = SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    sps[4] = SamplingParams(max_tokens=12, temperature=1.2, repetition_penalty=1.3, seed=3)
    alone = [engine.generate([p], sp)[0].output for p, sp in zip(prompts, sps)]
    try:
        for overlap in (False, True):      # steps read back at once (this workload preempts), then overlapped
            engine.overlap_steps = overlap
            reqs, arrive = [], {0: [0, 1], 1: [2], 3: [3, 4], 4: [5], 9: [6]}     # step -> requests arriving
            step = 0
            while step <= max(arrive) or engine.has_work():
                for i in arrive.get(step, []):
                    reqs.append(engine.add_request(prompts[i], sps[i]))
                engine.step()
                step += 1
            assert [r.output for r in reqs] == alone
            if not overlap:
                assert sum(r.preemptions for r in reqs) > 0, "the small page pool should have forced a preemption"
            assert not engine.sched.running() and engine.sched.pool.available == engine.sched.pool.total
    finally:
        engine.overlap_steps = True
    for r, sp in zip(reqs, sps):
        if sp.temperature == 0:
            assert_greedy_matches(fwd, params, r.prompt, r.output)


def test_a_draw_without_cuts_is_the_same_in_a_program_that_finds_them(engine, monkeypatch):
    """A request sampled at a temperature alone runs programs that skip min_p's floor and the top_k /
    top_p searches (cut CUT_NONE); beside one with min_p it runs those with the floor, beside one with
    top_p those that find top_p's cut, beside one with top_k those that find both, and draws the same
    tokens: cuts a row does not set keep its vocabulary."""
    from meshlab.infer.sampler import CUT_MIN_P, CUT_NONE, CUT_TOP_K, CUT_TOP_P
    keys, launch = [], engine._launch
    monkeypatch.setattr(engine, "_launch", lambda key, *a, **kw: keys.append(key) or launch(key, *a, **kw))
    warm = SamplingParams(max_tokens=14, temperature=1.1, seed=11)
    alone = engine.generate([[9, 8, 7, 6]], warm)[0].output
    for other, flag in ((SamplingParams(max_tokens=14, temperature=0.8, min_p=0.2, seed=2), CUT_MIN_P),
                        (SamplingParams(max_tokens=14, temperature=0.8, top_p=0.5, seed=2), CUT_TOP_P),
                        (SamplingParams(max_tokens=14, temperature=0.8, top_p=0.5, top_k=30, seed=2), CUT_TOP_K)):
        keys.clear()
        both = engine.generate([[9, 8, 7, 6], [1, 2, 3]], [warm, other])
        assert {k[-1] for k in keys} == {flag} and both[0].output == alone and len(both[1].output) == 14
    keys.clear()
    assert engine.generate([[9, 8, 7, 6]], warm)[0].output == alone and {k[-1] for k in keys} == {CUT_NONE}


def test_stop_token_and_bad_requests(tiny, engine):
    first = engine.generate([[9, 9, 9]], SamplingParams(max_tokens=8))[0].output
    stopped = engine.generate([[9, 9, 9]], SamplingParams(max_tokens=8, stop_token_ids=[first[2]]))[0]
    assert stopped.output == first[:first.index(first[2]) + 1] and stopped.finish_reason == "stop"
    with pytest.raises(AdmissionError, match="exceeds the context of 64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request([1], SamplingParams(top_p=0.0))
    with pytest.raises(AdmissionError, match="empty"):
        engine.add_request([], SamplingParams())


def test_sharded_cache_and_params_give_the_same_tokens(tiny):
    """fsdp_tp on 8 devices: params and cache placed by the rule file; same greedy tokens as one device."""
    from jax.sharding import NamedSharding
    from meshlab.mesh import make_mesh
    from meshlab.rules import load_rules
    from meshlab.layout import leaf_specs
    md, params, _ = tiny
    rules, mesh = load_rules("fsdp_tp"), make_mesh("data=1,fsdp=4,tensor=2")
    specs = leaf_specs(md, rules, mesh, "params")
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs,
                           is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    sp = SamplingParams(max_tokens=5)
    gen = ContiguousGenerator(md, sharded, batch=4, max_len=32, chunk=8, steps_per_call=4, rules=rules, mesh=mesh)
    assert gen.cache["k"].sharding.spec[1:4] == ("fsdp", None, "tensor")     # cache_batch, cache_seq, cache_kv_heads
    alone = ContiguousGenerator(md, params, batch=4, max_len=32, chunk=8, steps_per_call=4)
    assert gen.generate(prompts, sp) == alone.generate(prompts, sp)
    # One prompt (scripts/generate.py's usual batch), which the batch split over fsdp=4 cannot divide: kept whole.
    one = ContiguousGenerator(md, sharded, batch=1, max_len=32, chunk=8, steps_per_call=4, rules=rules, mesh=mesh)
    assert one.cache["k"].sharding.spec[1] is None
    assert one.generate(prompts[3:], sp) == alone.generate(prompts[3:], sp)
    # The paged engine over an fp8 cache placed by the same rules: the one-device fp8 engine's tokens.
    kw = dict(max_len=32, max_seqs=4, page_size=4, chunk=8, steps_per_call=4, kv_cache_dtype="fp8")
    paged = Engine(md, sharded, rules=rules, mesh=mesh, **kw)
    assert paged.cache["k"].dtype == jnp.float8_e4m3fn and len(paged.cache["k"].sharding.device_set) == 8
    assert [r.output for r in paged.generate(prompts, sp)] == [r.output for r in Engine(md, params, **kw).generate(prompts, sp)]


LAYER_PROMPTS = [[5, 6, 7], list(range(40, 60))]
# one greedy and one sampled + penalised row (the all-greedy program is exercised by the other tests)
LAYER_SAMPLING = [[SamplingParams(max_tokens=9),
                   SamplingParams(max_tokens=9, temperature=0.8, repetition_penalty=1.2, seed=5)]]


def layer_mode_outputs(md, params, layers):
    """Tokens of the contiguous generator and the paged engine with `layers`."""
    gen = ContiguousGenerator(md, params, batch=2, max_len=64, chunk=16, steps_per_call=4, layers=layers)
    eng = Engine(md, params, max_len=64, max_seqs=2, page_size=4, chunk=8, steps_per_call=4, layers=layers)
    return ([gen.generate(LAYER_PROMPTS, sp) for sp in LAYER_SAMPLING],
            [[r.output for r in eng.generate(LAYER_PROMPTS, sp)] for sp in LAYER_SAMPLING])


@pytest.fixture(scope="module")
def split_outputs(tiny):
    md, params, _ = tiny
    return layer_mode_outputs(md, params, "split")


@pytest.mark.parametrize("layers", ["scan", "unroll", "fused", "kernels"])
def test_layer_modes_give_the_same_tokens(tiny, split_outputs, layers):
    """The default per-layer split (no weight slicing) against the stacked scan, the unrolled scan,
    the split with concatenated projections and the one with [n, k] matrices (XLA's GEMMs here:
    the Pallas decode kernels are tests/kernels/test_paged_attention.py's)."""
    md, params, _ = tiny
    assert layer_mode_outputs(md, params, layers) == split_outputs


def test_serving_params_cast_once_split_per_layer(tiny):
    """fp32 masters served in bf16: matrices stored in bf16 once (not cast per step), per-layer buffers,
    and the same tokens as a model handed bf16 matrices up front."""
    from meshlab.infer.engine import serving_params
    md, params, _ = tiny
    bf = dataclasses.replace(md.cfg, dtype="bfloat16")
    md_bf = model_def(bf)
    served = serving_params(md_bf, params)
    assert len(served["layers"]) == bf.n_layers
    assert served["layers"][1]["mlp"]["w_up"].dtype == jnp.bfloat16
    assert served["layers"][1]["mlp"]["w_up"].shape == params["layers"]["mlp"]["w_up"].shape[1:]
    assert served["final_norm"]["scale"].dtype == jnp.float32        # norm scales read in fp32, kept
    np.testing.assert_array_equal(np.asarray(served["layers"][1]["attn"]["wq"], np.float32),
                                  np.asarray(params["layers"]["attn"]["wq"][1].astype(jnp.bfloat16), np.float32))
    pre = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim >= 2 else a, params)
    prompts = [[5, 6, 7], list(range(40, 60))]
    a = Engine(md_bf, params, max_len=64, max_seqs=2, page_size=4, chunk=8, layers="scan").generate(prompts)
    b = Engine(md_bf, pre, max_len=64, max_seqs=2, page_size=4, chunk=8).generate(prompts)
    assert [r.output for r in a] == [r.output for r in b]


def test_concurrent_greedy_equals_sequential(tiny, engine):
    """Requests submitted together (packed steps mixing decode tokens and up to four prompt-chunk
    rows, rows finishing inside multi-step decode calls, preemption in the small page pool) give
    the same greedy tokens as each request alone, in float32."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 257, size=n).tolist() for n in (3, 29, 11, 17, 8, 25)]
    sps = [SamplingParams(max_tokens=m) for m in (7, 10, 13, 5, 9, 6)]
    alone = [engine.generate([p], sp)[0].output for p, sp in zip(prompts, sps)]
    together = engine.generate(prompts, sps)
    assert [r.output for r in together] == alone
    assert any(key[0] == "packed" and key[2] > 1 for key in engine._programs), "no step packed several chunks"


def test_abort_running_and_queued(tiny, engine):
    """abort() from another thread: a running and a queued request end with finish_reason abort
    and one final event; their pages come back; the others are unaffected."""
    import threading
    prompts = [[7, 8, 9, 10], [1, 2], [3, 4, 5], [6] * 9, [11, 12]]
    sps = SamplingParams(max_tokens=12)
    alone = {i: engine.generate([prompts[i]], sps)[0].output for i in (1, 2, 3)}
    events = []
    reqs = [engine.add_request(p, sps, on_event=lambda r, new, done: events.append((r.id, len(new), done)))
            for p in prompts]
    engine.step()
    # 0 running with its first token sampled (read back, or on the device while the next step runs), 4 waiting
    assert reqs[0].slot >= 0 and reqs[4].slot < 0 and (reqs[0].output or reqs[0].pending)
    threads = [threading.Thread(target=engine.abort, args=(reqs[i],)) for i in (0, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.run()
    for i in (0, 4):
        assert reqs[i].finish_reason == "abort" and len(reqs[i].output) < 12
        assert [e for e in events if e[0] == reqs[i].id][-1] == (reqs[i].id, 0, True)
        assert sum(e[2] for e in events if e[0] == reqs[i].id) == 1
    assert not reqs[4].output
    assert {i: reqs[i].output for i in (1, 2, 3)} == alone
    engine.abort(reqs[1])                                             # already finished: nothing happens
    engine.run()
    assert reqs[1].finish_reason == "length"
    assert not engine.sched.running() and engine.sched.pool.available == engine.sched.pool.total


def test_warmup_compiles_every_bucket_without_touching_the_cache(tiny):
    md, params, fwd = tiny
    eng = Engine(md, params, max_len=32, max_seqs=4, page_size=4, chunk=8, steps_per_call=2, max_step_tokens=20)
    assert (eng.DECODE, eng.MIXED_DECODE, eng.PREFILL_ROWS, eng.WIDTHS) == ([1, 4], [0, 4], [1, 2], [8])
    # decode buckets: powers of 4 up to 16, then of 2 (nothing compiles at construction)
    wide = Engine(md, params, max_len=32, max_seqs=256, page_size=4, chunk=8, steps_per_call=2)
    assert wide.DECODE == [1, 4, 16, 32, 64, 128, 256]
    cache = jax.tree.map(np.asarray, eng.cache)
    assert eng.warmup() == 2 * 4 + 2 * 2           # per decode bucket: n steps, one step, the first-token step, the head
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, eng.cache), cache)
    prompts = [[5, 6, 7], list(range(40, 52)), [9] * 10]
    reqs = eng.generate(prompts, SamplingParams(max_tokens=5))
    reqs += eng.generate([[4]], SamplingParams(max_tokens=5))        # one token to feed: a first-token step
    assert eng.stats["first_token_calls"] == 1
    assert eng.stats["compiles"] == 12, sorted(eng._programs)       # every step found its program compiled
    # and so did jax: a static argument left to its default in one call and passed in another keys a second
    # program (traced and compiled at the step's first use, ~0.5 s a program at llama3_1b on a GPU)
    def jax_compiled_only_these():
        kinds = collections.Counter(key[0] for key in eng._programs)
        assert (eng.decode_call._cache_size(), eng.packed_call._cache_size(), eng.head_call._cache_size()) == (
            kinds["decode"] + kinds["first"], kinds["packed"], kinds["head"])
    jax_compiled_only_these()
    for r in reqs:
        assert_greedy_matches(fwd, params, r.prompt, r.output)
    # The other kinds a server may warm (scripts/serve.py --warmup-kinds): their requests compile nothing
    # (each kind alone: steps that mix kinds combine their flags, a program of its own).
    from meshlab.infer.warmup import WARMUP_KINDS
    assert eng.warmup(**WARMUP_KINDS["sampled"]) == 12 and eng.warmup(**WARMUP_KINDS["scoring"]) == 12
    assert eng.warmup(**WARMUP_KINDS["logprobs"]) == 4          # its packed shapes; scoring compiled the rest
    before = set(eng._programs)
    for sp in (SamplingParams(max_tokens=5, temperature=0.9, seed=1), SamplingParams(max_tokens=4, logprobs=3),
               SamplingParams(max_tokens=1, logprobs=1, prompt_logprobs=1)):
        eng.generate(prompts, sp)
    assert set(eng._programs) == before, set(eng._programs) - before
    jax_compiled_only_these()
    # Without the first-token route its programs are not compiled at start-up.
    off = Engine(md, params, max_len=32, max_seqs=4, page_size=4, chunk=8, steps_per_call=2, max_step_tokens=20,
                 first_token_decode=False)
    assert off.warmup() == 2 * 2 + 2 * 2 and not [k for k in off._programs if k[0] == "first"]


def test_chained_decode_calls_equal_unchained(tiny):
    """Decode calls chained on the device (the next dispatched from the last one's device tokens
    before the host reads it back) give the tokens of calls read back one by one, greedy and
    seeded sampling alike; a stop token met inside a call while the next one already runs ends
    the request there, and every page comes back."""
    md, params, fwd = tiny
    prompts = [[5, 6, 7], list(range(30, 41))]
    sps = [SamplingParams(max_tokens=13), SamplingParams(max_tokens=11, temperature=0.8, seed=4)]
    eng = Engine(md, params, max_len=64, max_seqs=2, page_size=4, chunk=8, steps_per_call=3, prefix_cache=False)
    outs = {}
    for chain in (False, True):                       # one engine, its programs compiled once
        eng.chain_decode, before, overlapped = chain, eng.stats["chained_calls"], eng.stats["overlapped_calls"]
        outs[chain] = [r.output for r in eng.generate(prompts, sps)]
        assert (eng.stats["chained_calls"] > before) == chain
        if not chain:      # no decode call is dispatched before the one before is read back, overlapped or not
            assert eng.stats["overlapped_calls"] == overlapped
    assert outs[True] == outs[False] and [len(o) for o in outs[True]] == [13, 11]
    assert_greedy_matches(fwd, params, prompts[0], outs[True][0])
    first = outs[True][0]
    stop = first[4]                                   # sampled by the second decode call (tokens 4..6)
    before = eng.stats["chained_calls"]
    req = eng.generate([prompts[0]], SamplingParams(max_tokens=13, stop_token_ids=[stop]))[0]
    assert req.output == first[:first.index(stop) + 1] and req.finish_reason == "stop"
    assert eng.stats["chained_calls"] - before >= 2   # a third call was chained before the stop was read
    assert not eng.has_work() and eng.sched.pool.available == eng.sched.pool.total


def test_auto_layers_pick_kernels_only_with_the_pallas_kernels_on_one_device(tiny):
    # kernels with the Pallas attention on one device (the decode GEMVs need its fused kernel), fused
    # on one device otherwise, split on a mesh
    from meshlab.infer.engine import default_impl, default_layers
    from meshlab.infer.programs import check_layers
    md = tiny[0]
    assert default_layers(md, "pallas") == "kernels" and default_layers(md, "xla") == "fused"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tensor",))
    assert default_layers(md, "pallas", mesh) == "split"
    moe = model_def(models.preset("moe_tiny"))
    # a mixture of experts: kernels with the Pallas attention on one device, split otherwise (fused is slower
    # there); kernels on a mesh is refused in one line
    assert default_layers(moe, "pallas") == "kernels" and default_layers(moe, "xla") == "split"
    assert default_layers(moe, "pallas", mesh) == "split"
    with pytest.raises(ValueError, match="layers='kernels' serves a mixture of experts on one device"):
        check_layers(moe, "kernels", mesh)
    check_layers(md, "kernels", mesh)
    assert default_impl() == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert default_impl(interpret=True) == "xla"


def test_overlapped_packed_steps_equal_read_back_ones(tiny):
    """Steps dispatched before the one before is read back (overlap_steps: rows that sampled there are
    fed from the device, rows that end there give up their slot first) give the tokens and logprobs
    of steps read back one by one: greedy, seeded, penalised; through preemptions (a small page pool)
    and a stop token sampled as a first token while the next step already feeds it; every page
    comes back."""
    md, params, fwd = tiny
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 257, size=n).tolist() for n in (21, 4, 30, 13, 9, 26, 3, 17)]
    sps = [SamplingParams(max_tokens=m) for m in (9, 12, 6, 10, 7, 11, 8, 5)]
    sps[1] = SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=11)
    sps[3] = SamplingParams(max_tokens=10, temperature=1.1, repetition_penalty=1.3, seed=2)
    sps[5] = SamplingParams(max_tokens=11, logprobs=3)
    eng = Engine(md, params, max_len=64, max_seqs=3, page_size=4, num_pages=14, chunk=8, steps_per_call=2, max_step_tokens=12,
                 prefix_cache=False)
    runs = {}
    for overlap in (False, True, False, True):        # one engine, its programs compiled once
        eng.overlap_steps, before = overlap, dict(eng.stats)
        reqs = eng.generate(prompts, sps)
        runs[overlap] = ([r.output for r in reqs], [r.logprobs for r in reqs])
        assert (eng.stats["overlapped_calls"] > before["overlapped_calls"]) == overlap
        assert eng.stats["preemptions"] > before["preemptions"], "the small page pool should have forced a preemption"
        assert not eng.has_work() and eng.sched.pool.available == eng.sched.pool.total
    assert runs[True][0] == runs[False][0]
    # a token's log-probabilities come from a decode call or a packed step, as the schedule falls: equal
    # up to float32 rounding (the two programs sum in different orders)
    for ours, theirs in zip(*(runs[k][1] for k in (True, False))):
        assert len(ours) == len(theirs)
        for (lp, top), (lp_ref, top_ref) in zip(ours, theirs):
            assert sorted(top) == sorted(top_ref)
            np.testing.assert_allclose([lp, *(top[t] for t in top_ref)], [lp_ref, *top_ref.values()], rtol=1e-5,
                                       atol=1e-5)
    assert [len(o) for o in runs[True][0]] == [sp.max_tokens for sp in sps]
    assert_greedy_matches(fwd, params, prompts[0], runs[True][0][0])
    # a first token that stops its request, sampled while later prompts still need packed steps
    stop = runs[True][0][2][0]
    stopped = list(sps)
    stopped[2] = SamplingParams(max_tokens=6, stop_token_ids=[stop])
    before = eng.stats["overlapped_calls"]
    reqs = eng.generate(prompts, stopped)
    assert reqs[2].output == [stop] and reqs[2].finish_reason == "stop"
    assert [r.output for i, r in enumerate(reqs) if i != 2] == [o for i, o in enumerate(runs[True][0]) if i != 2]
    assert eng.stats["overlapped_calls"] > before
    assert not eng.has_work() and eng.sched.pool.available == eng.sched.pool.total


def test_a_finishing_row_gives_its_slot_to_a_waiting_request_before_it_is_read_back(tiny):
    """One row, two requests: overlapped, the second request's prompt step is dispatched while the
    first one's last decode call is still running (its pending tokens end it, so its slot is free),
    and the first request's output pages still reach the prefix cache once it is read back."""
    md, params, fwd = tiny
    rng = np.random.default_rng(8)
    sp = SamplingParams(max_tokens=10)
    eng = Engine(md, params, max_len=64, max_seqs=1, page_size=4, chunk=8, steps_per_call=4)
    for overlap in (True, False):          # fresh prompts each time: nothing from the prefix cache
        prompts = [rng.integers(0, 257, size=n).tolist() for n in (6, 8)]
        eng.overlap_steps, before = overlap, dict(eng.stats)
        reqs = eng.generate(prompts, [sp, sp])
        assert (eng.stats["overlapped_calls"] > before["overlapped_calls"]) == overlap
        for r in reqs:
            assert_greedy_matches(fwd, params, r.prompt, r.output)
        if overlap:
            first = reqs[0]
    # the first request's prompt and 6 of its output tokens: three full pages, offered when it was read back
    again = eng.generate([first.prompt + first.output[:6]], SamplingParams(max_tokens=2))[0]
    assert again.prefix_hit_tokens == 12
