"""Serving engine on CPU, per-request features: logprobs, penalties, logit bias, prompt scoring, grammars
and allowed / banned tokens, checked against the no-cache forward; bench_serve's jobs that time them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshlab.infer.engine import ContiguousGenerator, Engine
from meshlab.infer.sampler import SamplingParams
from meshlab.infer.scheduler import AdmissionError
from tests.helpers import assert_greedy_matches, check_prompt_logprobs

# On test_infer_engine.py's xdist worker, with its engine and programs (tests/infer/conftest.py); compile-bound,
# so their code is generated cheaply.
pytestmark = [pytest.mark.xdist_group("infer_engine"), pytest.mark.cheap_codegen]


def test_logprobs_are_the_models_log_softmax(tiny, engine):
    md, params, fwd = tiny
    prompt = [5, 9, 14, 2]
    req = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=3))[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    assert plain.logprobs == [] and plain.output == req.output
    logits = np.asarray(fwd(params, jnp.asarray([prompt + req.output])))[0, len(prompt) - 1:-1]
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    assert len(req.logprobs) == 6
    for i, (chosen, top) in enumerate(req.logprobs):
        tok = req.output[i]
        np.testing.assert_allclose(chosen, ref[i, tok], rtol=1e-4, atol=1e-4)
        best = np.argsort(-ref[i])[:3].tolist()
        assert list(top) == best and best[0] == tok                 # greedy: the chosen one is the best
        np.testing.assert_allclose([top[t] for t in best], ref[i, best], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([1], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request([1], SamplingParams(prompt_logprobs=-1))


def _penalised_greedy(fwd, params, prompt, n, presence, frequency):
    """Greedy decoding over the no-cache forward with OpenAI's presence and frequency penalties (counts
    of the tokens generated so far, the prompt's not counted)."""
    out = []
    for _ in range(n):
        logits = np.asarray(fwd(params, jnp.asarray([prompt + out], jnp.int32)))[0, -1]
        counts = np.bincount(np.asarray(out, np.int64), minlength=logits.shape[0])
        out.append(int(np.argmax(logits - frequency * counts - presence * (counts > 0))))
    return out


def test_presence_and_frequency_penalties_count_generated_tokens(tiny, engine):
    """Four penalised greedy requests at once on 13 pages (preemption: a readmitted row's counts are
    rebuilt from its output) give what the penalised no-cache reference gives, which differs from
    plain greedy; the contiguous generator refuses them."""
    md, params, fwd = tiny
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(40, 48)), [9] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]
    settings = [(2.0, 0.0), (0.0, 2.0), (1.5, -0.5), (0.5, 1.0)]          # (presence, frequency)
    before = engine.stats["preemptions"]
    reqs = engine.generate(prompts, [SamplingParams(max_tokens=16, presence_penalty=p, frequency_penalty=f)
                                     for p, f in settings])
    assert engine.stats["preemptions"] > before
    for r, (p, f) in zip(reqs, settings):
        assert r.output == _penalised_greedy(fwd, params, r.prompt, 16, p, f)
    plain = engine.generate(prompts[1:2], SamplingParams(max_tokens=16))[0]
    assert plain.output != reqs[1].output
    with pytest.raises(ValueError, match="presence_penalty"):
        engine.add_request([1], SamplingParams(presence_penalty=2.5))


def test_logit_bias_moves_greedy_choices_and_leaves_the_slot(tiny, engine):
    """A logit bias bans plain greedy's first choice (-100) and favours another token (+5): the engine
    follows the biased no-cache reference; a plain request taking the same slot next is unbiased."""
    md, params, fwd = tiny
    prompt = list(range(40, 48))
    plain = engine.generate([prompt], SamplingParams(max_tokens=8))[0]
    bias = {plain.output[0]: -100.0, 7: 5.0}
    biased = engine.generate([prompt], SamplingParams(max_tokens=8, logit_bias=bias))[0]
    out = []
    for _ in range(8):
        logits = np.asarray(fwd(params, jnp.asarray([prompt + out], jnp.int32)))[0, -1].copy()
        for t, b in bias.items():
            logits[t] += b
        out.append(int(np.argmax(logits)))
    assert biased.output == out and plain.output[0] not in out
    assert engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.5, seed=1))[0].output \
        == ContiguousGenerator(md, params, batch=1, max_len=64, chunk=8).generate([prompt], SamplingParams(
            max_tokens=8, temperature=0.5, seed=1))[0]
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1], SamplingParams(logit_bias={md.cfg.vocab_size: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1], SamplingParams(logit_bias={1: 101.0}))
    with pytest.raises(ValueError, match="served by Engine"):
        ContiguousGenerator(md, params, batch=1, max_len=32, chunk=8).generate([[1]], SamplingParams(frequency_penalty=1))


def test_prompt_logprobs_equal_the_full_forward(tiny, engine, monkeypatch):
    """Prompt logprobs come from the packed steps (chunks of 8): each prompt token's log-softmax given
    the ones before it and its best alternatives as the no-cache forward computes them, at lengths
    around the chunk up to the whole cache; several requests scored in the same steps, preempted
    (13 pages of 4 for four rows), a prompt met before (its pages' scores stored: the tail computed)
    and a greedy one-token request (an evaluation harness's: its token from the same steps)."""
    md, params, fwd = tiny
    ref_of = lambda p: np.asarray(jax.nn.log_softmax(fwd(params, jnp.asarray([p], jnp.int32))[0], axis=-1))  # noqa: E731
    rng = np.random.default_rng(3)
    for n in (1, 2, 8, 9, 17, 52):       # 52: the whole cache (13 pages of 4; its one token is sampled, never fed)
        prompt = rng.integers(0, md.cfg.vocab_size, n).tolist()
        check_prompt_logprobs(engine.prompt_logprobs(prompt, top=2, ranks=n % 2 == 1), prompt, ref_of(prompt), 2,
                               ranked=n % 2 == 1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.prompt_logprobs([1, 2], top=21)
    with pytest.raises(AdmissionError):
        engine.prompt_logprobs(list(range(53)))        # 14 pages
    # Four at once, two tops and a plain request among them: they share steps and preempt each other.
    prompts = [rng.integers(0, md.cfg.vocab_size, n).tolist() for n in (21, 14, 30, 9)]
    tops = [2, 0, 3, None]
    before, together, keep = engine.stats["preemptions"], [], engine._keep_scores
    scored = engine.stats["scored_tokens"]
    monkeypatch.setattr(engine, "_keep_scores", lambda out, scored, c: together.append(
        len({id(r) for _, r, _, _ in scored})) or keep(out, scored, c))
    reqs = engine.generate(prompts, [SamplingParams(max_tokens=12, prompt_logprobs=t) for t in tops])
    assert engine.stats["preemptions"] > before and max(together) > 1      # requests scored in one step
    assert engine.stats["scored_tokens"] - scored >= sum(len(p) - 1 for p, t in zip(prompts, tops) if t is not None)
    for r, prompt, top in zip(reqs, prompts, tops):
        assert_greedy_matches(fwd, params, prompt, r.output)
        if top is None:
            assert r.prompt_logprobs is None
        else:
            check_prompt_logprobs(r.prompt_logprobs, prompt, ref_of(prompt), top)
    # Met before: its pages are cached and their scores stored with 2 alternatives. Asking for 3, the
    # request computes every position; asking for 1, it is served its 5 full pages' scores and feeds
    # again only the last (whose last position scores the next page's first token) and the tail.
    prompt = prompts[0]
    plain = [engine.generate([prompt], SamplingParams(max_tokens=1))[0] for _ in range(2)][1]
    assert plain.prefix_hit_tokens > 0 and plain.prompt_logprobs is None
    fed = engine.stats["prefill_tokens"]
    more = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    assert more.prefix_hit_tokens == 0 and engine.stats["prefill_tokens"] - fed == len(prompt)
    check_prompt_logprobs(more.prompt_logprobs, prompt, ref_of(prompt), 3)
    fed = engine.stats["prefill_tokens"]
    again = engine.generate([prompt], SamplingParams(max_tokens=1, logprobs=2, prompt_logprobs=1))[0]
    assert again.prefix_hit_tokens == 16 and engine.stats["prefill_tokens"] - fed == len(prompt) - 16
    check_prompt_logprobs(again.prompt_logprobs, prompt, ref_of(prompt), 1)
    # Asking for ranks, it is served no stored page without them: every position computed, then stored
    # with ranks, which the next such request is served.
    for served in (0, 16):
        fed = engine.stats["prefill_tokens"]
        ranked = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_ranks=True))[0]
        assert engine.stats["prefill_tokens"] - fed == len(prompt) - served
        check_prompt_logprobs(ranked.prompt_logprobs, prompt, ref_of(prompt), 1, ranked=True)
    ref = ref_of(prompt)[-1]
    best = np.argsort(-ref)[:2].tolist()
    assert again.output == reqs[0].output[:1] and again.finish_reason == "length"
    assert list(again.logprobs[0][1]) == best and again.logprobs[0][0] == pytest.approx(ref[best[0]], abs=1e-4)


def test_prompt_logprobs_under_a_rule_that_shards_the_cache_batch(tiny, engine):
    """Under fsdp_tp (batch over 4 devices, heads and vocabulary over 2) the engine runs its packed
    stream ([1, T, d]) and decode buckets with the activations whole (programs.engine_rules): the
    one-device tokens and prompt logprobs."""
    from meshlab.infer.loading import serving_placement, _shardings
    md, params, _ = tiny
    rules, mesh = serving_placement("fsdp_tp", "data=1,fsdp=4,tensor=2")
    sharded = Engine(md, jax.device_put(params, _shardings(md, rules, mesh)), max_len=64, max_seqs=4, page_size=4,
                     chunk=8, rules=rules, mesh=mesh)
    prompt = list(range(3, 40))
    got, want = sharded.prompt_logprobs(prompt, top=2), engine.prompt_logprobs(prompt, top=2)
    np.testing.assert_allclose([e[0] for e in got[1:]], [e[0] for e in want[1:]], rtol=1e-4, atol=1e-4)
    assert [list(e[1]) for e in got[1:]] == [list(e[1]) for e in want[1:]]
    prompts, sp = [prompt, [5, 6, 7]], SamplingParams(max_tokens=6)
    assert [r.output for r in sharded.generate(prompts, sp)] == [r.output for r in engine.generate(prompts, sp)]


def test_a_shared_context_is_scored_once(tiny, engine):
    """An evaluation harness's multiple choice: a context of 18 tokens (4 full pages of 4) and four
    3-token choices, scored. The first computes every position; the next three, together, are served
    the context's first 3 pages with their stored scores and feed the rest, with the full forward's
    values; sent all at once, three wait for the first's scores; a plain request leaves no scores, so
    a scored one after it computes everything."""
    md, params, fwd = tiny
    ref_of = lambda p: np.asarray(jax.nn.log_softmax(fwd(params, jnp.asarray([p], jnp.int32))[0], axis=-1))  # noqa: E731
    rng = np.random.default_rng(11)
    context = rng.integers(0, md.cfg.vocab_size, 18).tolist()
    choices = [context + rng.integers(0, md.cfg.vocab_size, 3).tolist() for _ in range(4)]
    score = SamplingParams(max_tokens=1, prompt_logprobs=1)
    fed = engine.stats["prefill_tokens"]
    first = engine.generate(choices[:1], score)[0]
    assert first.prefix_hit_tokens == 0 and engine.stats["prefill_tokens"] - fed == 21
    fed = engine.stats["prefill_tokens"]
    rest = engine.generate(choices[1:], score)
    assert [r.prefix_hit_tokens for r in rest] == [12] * 3 and engine.stats["prefill_tokens"] - fed == 3 * 9
    for r, prompt in zip([first] + rest, choices):
        check_prompt_logprobs(r.prompt_logprobs, prompt, ref_of(prompt), 1)
    # All four of a new context at once: the first computes it, the others wait for its scores.
    context = rng.integers(0, md.cfg.vocab_size, 18).tolist()
    choices = [context + rng.integers(0, md.cfg.vocab_size, 3).tolist() for _ in range(4)]
    fed = engine.stats["prefill_tokens"]
    together = engine.generate(choices, score)
    assert [r.prefix_hit_tokens for r in together] == [0, 12, 12, 12]
    assert engine.stats["prefill_tokens"] - fed == 21 + 3 * 9
    for r, prompt in zip(together, choices):
        check_prompt_logprobs(r.prompt_logprobs, prompt, ref_of(prompt), 1)
    other = [rng.integers(0, md.cfg.vocab_size, 9).tolist() + choices[0][9:]]      # plain first, then scored
    engine.generate(other, SamplingParams(max_tokens=1))
    scored = engine.generate(other, score)[0]
    assert scored.prefix_hit_tokens == 0
    check_prompt_logprobs(scored.prompt_logprobs, other[0], ref_of(other[0]), 1)


def test_grammar_holds_every_token_and_leaves_free_rows_alone(tiny, engine, monkeypatch):
    """Requests held to a JSON schema (meshlab.infer.guided) among free ones, preempting each other (13
    pages of 4): every greedy guided token is the argmax of the full forward's logits over the tokens
    its grammar allowed at that point (a matcher replayed alongside), the sampled one stays inside
    the grammar, both parse as the schema asks and end with "stop"; free requests, in the same steps
    (decode calls of several steps, of which a guided row takes the first) and then in the slots the
    guided ones left, are the plain greedy ones."""
    import json
    from meshlab.infer.guided import Grammars, json_grammar
    from meshlab.infer.sampler import allowed_bits
    from meshlab.tokenizer import ByteTokenizer
    md, params, fwd = tiny
    vocab = md.cfg.vocab_size
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 999}},
              "required": ["ok", "n"], "additionalProperties": False}
    grammar = json_grammar(schema)
    with pytest.raises(AdmissionError, match="grammars"):
        engine.add_request([1, 2], SamplingParams(grammar=grammar))
    monkeypatch.setattr(engine, "grammars", Grammars(ByteTokenizer(), vocab))
    with pytest.raises(ValueError, match="grammar"):
        engine.add_request([1, 2], SamplingParams(grammar="start: nowhere"))
    prompts = [list(range(3, 20)), list(range(40, 52)), list(range(60, 81)), [7, 8, 9]]
    sp = [SamplingParams(max_tokens=30, grammar=grammar), SamplingParams(max_tokens=10),
          SamplingParams(max_tokens=30, grammar=grammar, temperature=1.0, seed=2), SamplingParams(max_tokens=10)]
    monkeypatch.setattr(engine, "guided_steps", engine.steps_per_call)
    before, launches, launch = engine.stats["preemptions"], [], engine._launch
    monkeypatch.setattr(engine, "_launch", lambda key, *a, **kw: launches.append((key, engine._guides_running()))
                        or launch(key, *a, **kw))
    reqs = engine.generate(prompts, sp)
    assert engine.stats["preemptions"] > before
    # decode calls beside guided rows run guided_steps (here steps_per_call, 4) steps, the guided rows fed once
    assert any(k[0] == "decode" and k[2] == 4 and g for k, g in launches)
    for r in reqs[::2]:
        assert r.finish_reason == "stop"
        value = json.loads(bytes(r.output).decode())
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] <= 999
    replay = engine.grammars.guide(grammar)
    seq = list(prompts[0]) + reqs[0].output
    logits = np.asarray(fwd(params, jnp.asarray([seq], jnp.int32)))[0]
    for i, t in enumerate(reqs[0].output):
        row = np.empty((1, (vocab + 31) // 32), np.int32)
        replay.mask(row[0])
        allowed = np.asarray(allowed_bits(jnp.asarray(row), vocab))[0]
        assert allowed.sum() < vocab and t == np.where(allowed, logits[len(prompts[0]) - 1 + i], -np.inf).argmax()
        replay.consume(t)
    for r in reqs[1::2] + engine.generate(prompts, SamplingParams(max_tokens=10)):
        assert_greedy_matches(fwd, params, r.prompt, r.output)


@pytest.mark.gpu
def test_gpu_engine_scores_and_guides_on_its_shipped_paths(tiny):
    """On one GPU, the engine's defaults (Pallas attention, kernels layers, the paged prompt kernel):
    prompt logprobs near the full forward's (fp32; XLA's GPU dots may round through TF32, hence 2e-2)
    and a request held to a JSON schema parses."""
    import json
    from meshlab.infer.guided import Grammars, json_grammar
    from meshlab.tokenizer import ByteTokenizer
    md, params, fwd = tiny
    eng = Engine(md, params, max_len=256, max_seqs=4, page_size=16, chunk=64)
    assert (eng.impl, eng.layers) == ("pallas", "kernels")
    prompt = np.random.default_rng(4).integers(0, md.cfg.vocab_size, 150).tolist()
    got = eng.prompt_logprobs(prompt, top=1)
    ref = np.asarray(jax.nn.log_softmax(fwd(params, jnp.asarray([prompt], jnp.int32))[0], axis=-1))
    np.testing.assert_allclose([e[0] for e in got[1:]], ref[np.arange(149), prompt[1:]], atol=2e-2, rtol=2e-2)
    eng.grammars = Grammars(ByteTokenizer(), md.cfg.vocab_size)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (req,) = eng.generate([prompt[:20]], SamplingParams(max_tokens=20, grammar=json_grammar(schema)))
    assert req.finish_reason == "stop" and isinstance(json.loads(bytes(req.output).decode())["ok"], bool)


def test_allowed_and_banned_tokens_hold_every_token(tiny, engine, monkeypatch):
    """vLLM's allowed_token_ids and bad_words (as ids): greedy output is the full forward's argmax over the
    tokens the rules leave at each point, sampled output stays inside them, and a request with a fixed
    mask (no bad word of several tokens) keeps the decode calls' several steps, beside free rows that
    are the plain greedy ones; the slot's mask is cleared for the request after it."""
    md, params, fwd = tiny
    vocab = md.cfg.vocab_size
    prompts = [list(range(3, 20)), list(range(40, 52)), list(range(60, 81))]
    free = engine.generate(prompts, SamplingParams(max_tokens=12))
    allowed = sorted(set(free[0].output[:3]) | {1, 2, 5, 9, 30})             # the free argmax leaves it early
    first, second = free[1].output[:2]
    singles = [[t] for t in free[1].output[2:4] if t != first]
    sp = [SamplingParams(max_tokens=12, allowed_token_ids=allowed),
          SamplingParams(max_tokens=12, bad_words_ids=[[first, second]] + singles),
          SamplingParams(max_tokens=12, temperature=1.0, seed=3, allowed_token_ids=allowed)]
    launches, launch = [], engine._launch
    monkeypatch.setattr(engine, "_launch", lambda key, *a, **kw: launches.append(key) or launch(key, *a, **kw))
    reqs = engine.generate(prompts, sp)
    assert any(k[0] == "decode" and k[2] == engine.steps_per_call for k in launches)   # fixed masks: no step rule
    assert set(reqs[2].output) <= set(allowed)
    for r, p in zip(reqs[:2], sp[:2]):
        seq = list(r.prompt) + r.output
        logits = np.asarray(fwd(params, jnp.asarray([seq], jnp.int32)))[0]
        for i, t in enumerate(r.output):
            ok = np.zeros(vocab, bool)
            ok[p.allowed_token_ids if p.allowed_token_ids is not None else slice(None)] = True
            for w in p.bad_words_ids:
                if len(w) == 1 or tuple(r.output[max(0, i - len(w) + 1):i]) == tuple(w[:-1]) and i >= len(w) - 1:
                    ok[w[-1]] = False
            assert t == np.where(ok, logits[len(r.prompt) - 1 + i], -np.inf).argmax()
    assert reqs[0].output != free[0].output and reqs[1].output[0] == first and reqs[1].output[1] != second
    assert not {t for (t,) in singles} & set(reqs[1].output)
    for r in engine.generate(prompts, SamplingParams(max_tokens=12)):
        assert_greedy_matches(fwd, params, r.prompt, r.output)


def test_token_rules_ban_a_words_last_token_only_after_the_rest():
    from meshlab.infer.guided import Guide, TokenRules
    from meshlab.infer.sampler import allowed_bits
    vocab = 70
    with pytest.raises(ValueError, match="bans every one of allowed_token_ids"):
        SamplingParams(allowed_token_ids=[4], bad_words_ids=[[4]]).validate(vocab)
    with pytest.raises(ValueError, match="allowed_token_ids must be"):
        SamplingParams(allowed_token_ids=[70]).validate(vocab)
    with pytest.raises(ValueError, match="bad_words_ids must be"):
        SamplingParams(bad_words_ids=[[]]).validate(vocab)
    guide = Guide(None, TokenRules(vocab, allowed=None, bad_words=[[3], [5, 6, 7], [8, 7]]))
    out = np.empty((vocab + 31) // 32, np.int32)

    def banned():
        guide.mask(out)
        return set(np.flatnonzero(~np.asarray(allowed_bits(jnp.asarray(out[None]), vocab))[0]).tolist())
    assert guide.per_step and banned() == {3}
    for t in (5, 6):
        guide.consume(t)
    assert banned() == {3, 7}
    guide.consume(8)
    assert banned() == {3, 7}
    guide.consume(9)
    assert banned() == {3}
    fixed = Guide(None, TokenRules(vocab, allowed=[31, 32, 33, 69], bad_words=[[32]]))
    fixed.mask(out)
    assert not fixed.per_step and fixed.version == 0
    assert np.flatnonzero(np.asarray(allowed_bits(jnp.asarray(out[None]), vocab))[0]).tolist() == [31, 33, 69]
    only = Guide(None, TokenRules(vocab, allowed=[31], bad_words=[[30, 31]]))
    only.consume(30)
    only.mask(out)                          # the ban would leave nothing: not applied
    assert np.flatnonzero(np.asarray(allowed_bits(jnp.asarray(out[None]), vocab))[0]).tolist() == [31]


def test_a_masked_request_back_in_a_slot_another_used_gets_its_mask_again():
    """A preempted request may be admitted again into a slot whose MASK row another request set (its own
    mask, or all bits) meanwhile: its mask is written again though its version did not move."""
    from types import SimpleNamespace

    from meshlab.infer.guided import Guide, Guided, TokenRules
    from meshlab.infer.programs import MASK

    class Slots(Guided):                 # the engine's state that Guided reads, with numpy rows
        DECODE = (1, 2, 4)

        def __init__(self):
            self.masked, self.guided, self._mask_width, self._mask_executor = set(), set(), 3, None
            self.slot_guide = [None, None]
            self.cache, self.now = {MASK: np.full((2, 3), -1, np.int32)}, []
            self.sched = SimpleNamespace(running=lambda: self.now, max_seqs=2)

        def _set_rows(self, entry, slots, rows):
            entry, real = entry.copy(), slots < 2
            entry[slots[real]] = rows[real]
            return entry
    class Req:
        def __init__(self, guide):
            self.slot, self.guide = 0, guide
    eng = Slots()
    first, other = Req(Guide(None, TokenRules(70, allowed=[3, 40]))), Req(Guide(None, TokenRules(70, allowed=[5])))
    eng.masked |= {first, other}
    for now, row in ((first, [8, 256, 0]), (other, [32, 0, 0]), (first, [8, 256, 0]), (Req(None), [-1, -1, -1]),
                     (first, [8, 256, 0])):
        eng.now = [now]
        eng._refresh_masks()
        assert eng.cache[MASK][0].tolist() == row


def test_allowed_tokens_outside_a_grammar_leave_the_grammar_its_tokens():
    """A grammar whose next tokens are none of allowed_token_ids: the rules yield (an empty mask would
    sample outside the grammar, which stops its matcher)."""
    from meshlab.infer.guided import Guide, TokenRules
    out = np.zeros(3, np.int32)
    out[0] = 1 << 5                                      # the grammar allows token 5 only
    Guide(None, TokenRules(70, allowed=[6, 7])).rules.restrict(out, ())
    assert out.tolist() == [1 << 5, 0, 0]
    out[0] = (1 << 5) | (1 << 6)
    Guide(None, TokenRules(70, allowed=[6, 7])).rules.restrict(out, ())
    assert out.tolist() == [1 << 6, 0, 0]


def test_scoring_benchmark_times_both_paths_and_they_agree(engine):
    """bench_serve's score job on the tiny engine: plain one-token requests and scored ones (with and
    without ranks) over the same prompts, each with its prompt tokens/s, and the scored requests'
    tokens equal the plain ones';
    then a multiple-choice load without and with the score store: the store computes fewer tokens and
    gives the same logprobs."""
    import re

    from meshlab.bench.serve_kinds import scoring
    work = [(list(range(1 + i, 12 + 3 * i)), 1) for i in range(4)]
    plain, scored, ranked, without, with_store = scoring(engine, work)
    assert plain["unit"] == scored["unit"] == ranked["unit"] == "prompt tok/s" and min(
        r["value"] for r in (plain, scored, ranked)) > 0
    assert "in 4 of 4" in scored["note"] and "in 4 of 4" in ranked["note"] and "ranks" in ranked["setting"]
    computed = [int(re.search(r"(\d+) computed", r["note"]).group(1)) for r in (without, with_store)]
    assert "without the score store" in without["setting"] and computed[1] < computed[0], computed
    assert float(re.search(r"at most ([0-9.e+-]+)", with_store["note"]).group(1)) < 1e-5


def test_guided_benchmark_times_each_run_and_its_outputs_keep_their_form(engine, monkeypatch):
    """bench_serve's guided job on the tiny engine: the workload free and with 1 in 2 requests held to a
    JSON string of its length, to allowed tokens, away from a bad word, each with its output tokens/s,
    every held output keeping its form."""
    from meshlab.bench.serve_kinds import guided
    monkeypatch.setattr(engine, "grammars", None)            # the job sets its own; the fixture's is left alone
    work = [(list(range(1 + i, 8 + 2 * i)), 6 + i) for i in range(4)]
    free, *held = guided(engine, work, share=2)
    assert len(held) == 3 and all(r["unit"] == "tok/s" and r["value"] > 0 for r in [free] + held)
    assert ["JSON" in held[0]["setting"], "allowed" in held[1]["setting"], "bad word" in held[2]["setting"]] == [True] * 3
    for row in held:
        assert "2 of 2 held outputs keep their form" in row["note"] and f"{sum(m for _, m in work)} output tokens" in row["note"]


def test_sampled_benchmark_times_greedy_and_each_sampled_setting(engine):
    """bench_serve's sampled job on the tiny engine: the workload greedy, at temperature 1 and with a
    chat client's filters, each with its output tokens/s and the engine's counters. Not warmed: every
    bucket of three sampled kinds is test_warmup_compiles_every_bucket's subject, and 20 s of compiles here."""
    from meshlab.bench.serve_kinds import sampled
    work = [(list(range(1, 8)), 6)]       # one request: its warm run and timed run share the batch-1 programs
    rows = sampled(engine, work, warm=False)
    assert [r["setting"].split(" n=")[0] for r in rows] == [
        "engine greedy", "engine temperature 1", "engine temperature 0.7, top_p 0.9",
        "engine temperature 0.7, top_p 0.9, top_k 50"]
    assert all(r["unit"] == "tok/s" and r["value"] > 0 and "decode steps per dispatch" in r["note"] for r in rows)
    assert all(f"{sum(m for _, m in work)} output tokens" in r["note"] and "x greedy" in r["note"] for r in rows[1:])


def test_shared_prefix_benchmark_computes_the_system_prompt_once(engine):
    """bench_serve's shared job on the tiny engine: requests behind one system prompt, all sent at once,
    compute fewer prompt tokens when they wait for the pages another computes than when they do not."""
    import re

    from meshlab.bench.serve_kinds import shared_prefix
    work = [(list(range(1 + i, 6 + i)), 3) for i in range(4)]
    each, waiting = shared_prefix(engine, work, system=16)
    computed = [int(re.search(r"(\d+) of \d+ prompt tokens computed", r["note"]).group(1)) for r in (each, waiting)]
    assert "waiting for it" in waiting["setting"] and computed[1] < computed[0], computed
    assert engine.sched.wait_in_flight
