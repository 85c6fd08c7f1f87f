"""A packed step's host inputs (calls.fill_packed) hold exactly what the program reads, and an
Engine whose programs take XLA compiler_options (command buffers off) or whose packed input goes
through pinned host memory gives the same tokens."""
import dataclasses

import numpy as np
import pytest
from flax import nnx

import models
from meshlab.bench.first_token import NO_CMDBUF
from meshlab.infer import calls
from meshlab.infer.engine import Engine
from meshlab.infer.sampler import SamplingParams, row_arrays
from meshlab.infer.scheduler import Request
from models import model_def


def request(prompt, slot, cached, output=(), hit=0, **sampling):
    r = Request(list(prompt), SamplingParams(max_tokens=8, **sampling), output=list(output), cached=cached, slot=slot)
    r.prefix_hit_tokens = hit
    return r


def test_fill_packed_lays_out_decodes_then_chunk_rows():
    ps, max_pages, max_seqs, num_pages = 4, 6, 4, 30
    table = np.arange(max_seqs * max_pages, dtype=np.int32).reshape(max_seqs, max_pages) + 1
    rows = row_arrays([SamplingParams(temperature=0.5 * i, top_k=i, seed=10 + i) for i in range(max_seqs)])
    dec = request(range(100, 106), slot=2, cached=7, output=[7, 42])               # feeds 42 at position 7
    part = request(range(200, 211), slot=0, cached=8, hit=8)                       # 3 uncached tokens
    full = request(range(300, 308), slot=3, cached=7, hit=8, seed=1)               # all cached: its last token
    slots = calls.packed_slots(4, 2, 8, max_pages, rows, max_seqs, num_pages)      # n_dec=4, k=2 rows of 8
    v = slots.fill()
    real = calls.fill_packed(v, [dec], [(part, 8, 3), (full, 7, 1)], table, ps, rows)

    assert real.tolist() == [2, 0, 3]
    tok, pos, slot = v["p.tokens"], v["p.positions"], v["p.slot"]
    assert (tok[0], pos[0], slot[0]) == (42, 7, 2)
    assert (v["p.write_page"][0], v["p.write_off"][0], v["p.dec_len"][0]) == (table[2, 1], 3, 8)
    assert (v["p.dec_table"][0] == table[2]).all() and not v["p.dec_len"][1:].any()  # padding decode rows
    assert tok[4:7].tolist() == [208, 209, 210] and pos[4:7].tolist() == [8, 9, 10] and (slot[4:7] == 0).all()
    assert v["p.write_page"][4:7].tolist() == [table[0, 2]] * 3 and v["p.write_off"][4:7].tolist() == [0, 1, 2]
    assert (slot[7:12] == max_seqs).all() and (v["p.write_page"][7:12] == num_pages).all()   # row padding
    # the fully cached prompt feeds its last token at position 7 in the shared page, its write dropped
    assert (tok[12], pos[12], v["p.write_page"][12], v["p.write_off"][12]) == (307, 7, table[3, 1], ps)
    assert v["p.out_idx"].tolist() == [0, 1, 2, 3, 6, 12]
    assert v["out_slot"][[0, 4, 5]].tolist() == [2, 0, 3] and v["counters"][[0, 4, 5]].tolist() == [2, 0, 0]
    assert (v["p.pre_table"] == table[[0, 3]]).all()
    for name in ("temperature", "top_k", "seed"):
        assert (v[f"rows.{name}"] == rows[name][v["out_slot"]]).all()
    buf = slots.take()                                     # the one array sent: the views' bytes, in order
    assert buf.dtype == np.int32 and buf.shape == (sum(int(np.prod(s)) for _, s, _ in slots.layout),)
    refill = slots.fill()                                  # back to padding for the next step
    assert not refill["p.tokens"].any() and (refill["p.slot"] == max_seqs).all()


@pytest.fixture(scope="module")
def tiny():
    cfg = dataclasses.replace(models.preset("tiny"), dtype="float32", init_std=0.2, n_layers=2)
    return model_def(cfg), nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(0)), nnx.Param))


def test_compiler_options_and_pinned_inputs_keep_tokens_and_prefix_counts(tiny):
    md, params = tiny
    rng = np.random.default_rng(4)
    prefix = rng.integers(0, 257, 24).tolist()
    prompts = [prefix + rng.integers(0, 257, 3).tolist(), prefix + rng.integers(0, 257, 5).tolist(), prefix]
    outs = []
    for kw in ({}, {"compiler_options": {"packed": NO_CMDBUF, "decode": NO_CMDBUF}}, {"pinned_inputs": True},
               {"compiler_options": {"first": NO_CMDBUF}}):
        eng = Engine(md, params, max_len=64, max_seqs=2, page_size=4, chunk=8, steps_per_call=4, reuse_hidden=False,
                     **kw)
        run = []
        for p in prompts:
            before = eng.stats["prefill_tokens"]
            r = eng.generate([p], SamplingParams(max_tokens=6))[0]
            run.append((r.output, eng.stats["prefill_tokens"] - before))
        outs.append(run)
        # the prompt met before (all cached) took a first-token call: through its own program when asked
        assert eng.stats["first_token_calls"] == 1
        assert (eng.first_call is eng.decode_call) == ("first" not in kw.get("compiler_options", {}))
        if eng.first_call is not eng.decode_call:
            assert eng.first_call._cache_size() == 1
    assert outs[0] == outs[1] == outs[2] == outs[3]
    assert [n for _, n in outs[0]] == [27, 5, 1]          # the prefix computed once, then only what is new
    with pytest.raises(ValueError, match="per program kind"):
        Engine(md, params, max_len=64, max_seqs=2, page_size=4, compiler_options=NO_CMDBUF)


def test_a_cached_prompts_first_token_sends_one_array(tiny, capfd):
    """The first token of a prompt whose prefix is cached costs one host-to-device transfer per request
    (the packed step's buffer): a GPU copy costs tens of microseconds of host time whatever its size."""
    import jax
    md, params = tiny
    eng = Engine(md, params, max_len=64, max_seqs=1, page_size=4, chunk=8, steps_per_call=4)
    prefix = list(range(30, 54))
    for tail in ([1, 2], [3, 4]):                          # caches the prefix, compiles the tail's program
        eng.generate([prefix + tail], SamplingParams(max_tokens=1))
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log"):
        reqs = [eng.generate([prefix + tail], SamplingParams(max_tokens=1))[0] for tail in ([5, 6], [7, 8])]
    assert [r.prefix_hit_tokens for r in reqs] == [24, 24]
    assert capfd.readouterr().err.count("host-to-device transfer") == 2


def test_every_call_updates_the_donated_cache_in_place(tiny):
    """Each packed, decode, head and first-token call writes the cache and `seen` into the buffers it was
    given (donation aliased), with two rows so that a call's sampled tokens [2] have the shape of the
    LAST entry [max_seqs]: a state buffer that moves puts the next call's input at a new device
    address, which costs the GPU's command buffer an update in that call's dispatch (~0.5-1 ms)."""
    md, params = tiny
    eng = Engine(md, params, max_len=64, max_seqs=2, page_size=4, chunk=8, steps_per_call=4)
    addresses = lambda: {k: v.unsafe_buffer_pointer() for k, v in {**eng.cache, "seen": eng.seen}.items()}  # noqa: E731
    launch, moved, kinds = eng._launch, [], set()

    def checked(key, fn, *args, **kw):
        before = addresses()
        out = launch(key, fn, *args, **kw)
        kinds.add(key[0])
        moved.extend((key, name) for name, ptr in addresses().items() if ptr != before[name])
        return out
    eng._launch = checked
    prefix = list(range(40, 56))
    eng.generate([prefix + [1, 2], prefix + [3]], SamplingParams(max_tokens=6))     # packed, then decode b=2
    eng.generate([prefix + [1, 2], prefix + [3]], SamplingParams(max_tokens=3, temperature=0.8, seed=1))
    eng.generate([prefix + [7], prefix + [8]], SamplingParams(max_tokens=2))        # one token left each: first-token call
    eng.generate([prefix, prefix], SamplingParams(max_tokens=1))                     # all cached: head call
    assert {"packed", "decode", "first", "head"} <= kinds
    assert not moved
