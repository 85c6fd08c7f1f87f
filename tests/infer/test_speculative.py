"""Speculative decoding by prompt lookup: the drafts against a numpy reference, the tokens a step keeps,
the engine's tokens with speculation equal to those without (greedy, penalised, and seeded sampling with
no draft; float32, CPU), the logprobs it reports, and its attention over the paged cache."""
import re

import numpy as np
import pytest

from meshlab.infer import speculative
from meshlab.infer.engine import Engine
from meshlab.infer.programs import TOP_LOGPROBS
from meshlab.infer.sampler import CUT_NONE, CUT_TOP_K, SamplingParams, row_arrays
from tests.helpers import assert_greedy_matches, record_instances

pytestmark = [pytest.mark.xdist_group("speculative"), pytest.mark.cheap_codegen]


def reference_drafts(tokens, k, ngram, shortest=1):
    """The k tokens after the latest earlier occurrence of the longest suffix (shortest..ngram) that recurs."""
    for n in range(min(ngram, len(tokens) - 1), shortest - 1, -1):
        suffix = tokens[-n:]
        ends = [j for j in range(n - 1, len(tokens) - 1) if tokens[j - n + 1:j + 1] == suffix]
        if ends:
            follow = tokens[ends[-1] + 1:ends[-1] + 1 + k]
            return follow + [-1] * (k - len(follow))
    return [-1] * k


def test_drafts_follow_the_latest_longest_match():
    rng = np.random.default_rng(0)
    rows, L = [], 40
    for i in range(64):                    # few symbols: matches of every length, and rows without any
        n = int(rng.integers(1, L - 1))
        rows.append(rng.integers(0, 2 + i % 5, n).tolist() if i % 8 else list(range(n)))
    history = np.zeros((len(rows), L), np.int32)
    for i, r in enumerate(rows):
        history[i, :len(r)] = r
    history[:, -1] = 7                     # past each row's length: never read
    length = np.array([len(r) for r in rows], np.int32)
    for k, ngram, shortest in ((1, 1, 1), (3, 2, 1), (4, 3, 1), (6, 4, 1), (3, 3, 2), (2, 4, 4)):
        got = np.asarray(speculative.propose(history, length, k, ngram, shortest)).tolist()
        assert got == [reference_drafts(r, k, ngram, shortest) for r in rows], (k, ngram, shortest)
    # the longest suffix wins over a later shorter match: ... 1 2 3 [9 9] ... 5 3 [4 4] ... 2 3 -> 9 9
    assert np.asarray(speculative.propose(np.array([[1, 2, 3, 9, 9, 5, 3, 4, 4, 2, 3]], np.int32),
                                          np.array([11], np.int32), 2, 2)).tolist() == [[9, 9]]


def test_a_greedy_step_keeps_the_agreeing_drafts_and_the_models_next_token():
    drafts = np.array([[5, 6, 7], [5, 6, 7], [5, 6, 7], [-1, -1, -1]], np.int32)
    best = np.array([[5, 6, 7, 8], [5, 0, 7, 8], [1, 6, 7, 8], [3, 3, 3, 3]])
    logits = np.eye(10, dtype=np.float32)[best]                                   # [4, 4, 10]: argmax = best
    rows = row_arrays([SamplingParams()] * 4)
    tokens, kept = speculative.chosen_tokens(logits, drafts, rows, np.zeros(4, np.int32), True, CUT_NONE)
    assert np.asarray(kept).tolist() == [3, 1, 0, 0]
    assert np.asarray(tokens).tolist() == [[5, 6, 7, 8], [5, 0, -1, -1], [1, -1, -1, -1], [3, -1, -1, -1]]
    pos, limit = np.full(3, 10, np.int32), np.array([99, 14, 10], np.int32)       # nothing at or past the limit
    assert np.asarray(speculative.kept_tokens(np.array([3, 3, 0]), pos, limit)).tolist() == [4, 4, 0]


@pytest.mark.parametrize("top_k", [0, 2])
def test_sampled_tokens_are_distributed_as_plain_sampling(top_k):
    """A certain draft kept with probability p(d), else a draw from p without it: the first token is
    distributed as p, and the one after a kept draft as the next position's p (20,000 rows, 4.5 sigma)."""
    n, draft = 20_000, 1
    first, after = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 0.3]), np.array([0.0, 1.0, 2.0, 0.0, 0.0, -0.5])

    def p(l):
        l = np.where(np.argsort(np.argsort(-l)) < top_k, l, -np.inf) if top_k else l
        return np.exp(l - l.max()) / np.exp(l - l.max()).sum()
    logits = np.broadcast_to(np.stack([first, after]).astype(np.float32), (n, 2, 6))
    rows = row_arrays([SamplingParams(temperature=1.0, top_k=top_k, seed=i) for i in range(n)])
    tokens, kept = speculative.chosen_tokens(logits, np.full((n, 1), draft, np.int32), rows,
                                             np.full(n, 7, np.int32), False, CUT_TOP_K if top_k else CUT_NONE)
    tokens, kept = np.asarray(tokens), np.asarray(kept)
    assert ((kept == 1) == (tokens[:, 0] == draft)).all() and (tokens[kept == 0, 1] == -1).all()

    def close(samples, probs):
        freq = np.bincount(samples, minlength=6) / len(samples)
        assert np.all(np.abs(freq - probs) < 4.5 * np.sqrt(probs * (1 - probs) / len(samples)) + 1e-9), (freq, probs)
    close(tokens[:, 0], p(first))
    close(tokens[kept == 1, 1], p(after))


def _engine(md, params, k=3, **kw):
    kw = {"max_len": 256, "max_seqs": 4, "page_size": 8, "chunk": 32, "steps_per_call": 4, **kw}
    return Engine(md, params, speculative_tokens=k, **kw)


def _prompts():
    rng = np.random.default_rng(3)
    pattern = rng.integers(0, 250, 12).tolist()
    return [pattern * 4, rng.integers(0, 250, 30).tolist(), pattern * 2 + [5, 6, 7]]


@pytest.fixture(scope="module")
def plain(tiny):
    md, params, _ = tiny
    sp = [SamplingParams(max_tokens=m) for m in (40, 33, 47)]
    return [r.output for r in _engine(md, params, k=0).generate(_prompts(), sp)]


def simulated_lookup(prompt, output, k, ngram):
    """(drafted, kept drafts) of prompt lookup over a greedy output whose first token came from the
    prompt's step: each step drafts from the tokens so far and keeps those the output continues with."""
    drafted = kept = 0
    done = 1
    while done < len(output):
        tokens = list(prompt) + list(output[:done])
        drafts = reference_drafts(tokens, k, ngram)[:len(output) - done - 1]     # fed below the limit
        agree = 0
        while agree < len(drafts) and drafts[agree] == output[done + agree]:
            agree += 1
        drafted += sum(d >= 0 for d in drafts)
        kept += agree
        done += agree + 1
    return drafted, kept


def test_speculative_greedy_equals_plain_greedy(tiny, plain):
    md, params, fwd = tiny
    eng = _engine(md, params)
    sp = [SamplingParams(max_tokens=m) for m in (40, 33, 47)]
    outs = [r.output for r in eng.generate(_prompts(), sp)]
    assert outs == plain
    for prompt, out in zip(_prompts(), outs):
        assert_greedy_matches(fwd, params, prompt, out)
    assert eng.stats["spec_calls"] > 0 and eng.stats["decode_calls"] == 0
    # calls chained on the device, each from the rows' tokens and positions the one before left there
    assert eng.stats["chained_calls"] > 0
    # the drafts each step made on the device and the ones it kept, as the reference's lookup makes them
    drafted, kept = np.sum([simulated_lookup(p, o, 3, eng.prompt_lookup[1]) for p, o in zip(_prompts(), outs)], axis=0)
    assert (eng.stats["spec_drafted"], eng.stats["spec_accepted"]) == (drafted, kept)
    assert kept > 0
    unchained = _engine(md, params, chain_decode=False)
    assert [r.output for r in unchained.generate(_prompts(), sp)] == plain and unchained.stats["chained_calls"] == 0
    assert (unchained.stats["spec_drafted"], unchained.stats["spec_accepted"]) == (drafted, kept)
    # a stop token mid-call: the tokens after it are dropped, the request ends there
    stop = plain[0][10]
    out = eng.generate([_prompts()[0]], SamplingParams(max_tokens=40, stop_token_ids=[stop]))[0].output
    assert out == plain[0][:plain[0].index(stop) + 1]


def test_masked_rows_or_too_many_do_not_speculate(tiny, plain):
    md, params, _ = tiny
    eng = _engine(md, params, speculative_max_batch=2)
    sp = [SamplingParams(max_tokens=m) for m in (40, 33, 47)]
    assert [r.output for r in eng.generate(_prompts(), sp)] == plain
    # three rows decode plainly (over the limit); the two left after the shortest ends speculate
    assert eng.stats["spec_calls"] > 0 and eng.stats["decode_calls"] > 0
    for params_ in (SamplingParams(max_tokens=20, allowed_token_ids=list(range(100))),
                    SamplingParams(max_tokens=20, temperature=0.8, bad_words_ids=[[3]])):
        before = eng.stats["spec_calls"]
        eng.generate([_prompts()[0]], params_)
        assert eng.stats["spec_calls"] == before


@pytest.mark.parametrize("top", [0, 3])
def test_rows_with_logprobs_speculate_and_get_each_kept_tokens(tiny, plain, top):
    """A row asking for logprobs speculates, to plain greedy's tokens; each token's logprob (and its top
    alternatives) is the full forward's log-softmax there, drafts kept or the model's own alike; a row
    without logprobs in the same calls gets none."""
    import jax
    import jax.numpy as jnp
    from tests.helpers import check_prompt_logprobs
    md, params, fwd = tiny
    eng = _engine(md, params)
    sp = [SamplingParams(max_tokens=m, logprobs=top if i != 1 else None) for i, m in enumerate((40, 33, 47))]
    reqs = eng.generate(_prompts(), sp)
    assert [r.output for r in reqs] == plain
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0 and eng.stats["decode_calls"] == 0
    assert reqs[1].logprobs == []
    for r in (reqs[0], reqs[2]):
        seq = r.prompt + r.output
        ref = np.asarray(jax.nn.log_softmax(fwd(params, jnp.asarray([seq], jnp.int32))[0], axis=-1))
        # as prompt logprobs are checked: entry k is token seq[k]'s, alternatives after the row before
        got = [None] + [(lp, alternatives, None) for lp, alternatives in r.logprobs]
        check_prompt_logprobs(got, seq[len(r.prompt) - 1:], ref[len(r.prompt) - 1:], top)


def test_sampled_rows_speculate(tiny, plain):
    """Sampled rows speculate too: a temperature near 0 gives greedy decoding's tokens, and a seed its
    own tokens again."""
    md, params, _ = tiny
    eng = _engine(md, params)
    cold = [SamplingParams(max_tokens=m, temperature=1e-5, seed=i) for i, m in enumerate((40, 33, 47))]
    assert [r.output for r in eng.generate(_prompts(), cold)] == plain
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0 and eng.stats["decode_calls"] == 0
    warm = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=5)
    first, again = (eng.generate([_prompts()[0]], warm)[0].output for _ in range(2))
    assert first == again and len(first) == 30 and eng.stats["decode_calls"] == 0


# (prompt, settings): plain greedy; greedy with repetition and frequency penalties and a logit bias; greedy with
# a presence penalty and min_tokens holding a stop token; seeded sampling with penalties
SCRIPTED = [(0, SamplingParams(max_tokens=40)),
            (0, SamplingParams(max_tokens=40, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={7: 2.0})),
            (1, SamplingParams(max_tokens=33, presence_penalty=0.8, min_tokens=30, stop_token_ids=[12])),
            (2, SamplingParams(max_tokens=47, temperature=0.9, seed=4, repetition_penalty=1.2, frequency_penalty=0.3))]


@pytest.mark.parametrize("oracle", [True, False])
def test_scripted_drafts_give_plain_decodings_tokens(tiny, monkeypatch, oracle):
    """Drafts that are greedy decoding's own tokens are all kept (k + 1 tokens a step), to its tokens;
    with no drafts the one-token steps give plain decoding's tokens, a seeded sampled row's too (its draws
    keyed by its counter). Penalties, logit bias and min_tokens read each position's state as plain
    decoding has it there (the drafts before it seen and counted, the counter advanced). Kept drafts change
    a sampled row's draws, not their distribution (test_sampled_tokens_are_distributed_as_plain_sampling)."""
    md, params, _ = tiny
    prompts = [_prompts()[i] for i, _ in SCRIPTED]
    want = [r.output for r in _engine(md, params, k=0).generate(prompts, [sp for _, sp in SCRIPTED])]
    text = [None]                             # what the request being decoded continues (one a call: max_seqs=1)

    def drafts(history, length, k_, ngram, shortest):
        import jax.numpy as jnp
        at = length[:, None] + jnp.arange(k_)
        if text[0] is None:
            return jnp.full(at.shape, -1, jnp.int32)
        return jnp.asarray(text[0])[jnp.minimum(at, len(text[0]) - 1)]
    monkeypatch.setattr(speculative, "propose", drafts)
    k = 3
    for i, ((_, sp), prompt) in enumerate(zip(SCRIPTED, prompts)):
        if oracle and sp.temperature > 0:
            continue
        text[0] = np.array(prompt + want[i], np.int32) if oracle else None    # read when the engine's programs trace
        eng = _engine(md, params, k=k, max_seqs=1)
        assert eng.generate([prompt], sp)[0].output == want[i], i
        assert eng.stats["spec_calls"] > 0 and eng.stats["decode_calls"] == 0
        decoded = len(want[i]) - 1                                            # the first comes from the prompt's step
        kept = decoded - -(-decoded // (k + 1)) if oracle else 0
        assert (eng.stats["spec_accepted"], bool(eng.stats["spec_drafted"])) == (kept, oracle), i


@pytest.mark.parametrize("t,h,kvh,d", [(2, 4, 2, 16), (3, 8, 2, 64), (5, 8, 2, 64), (7, 4, 4, 16), (8, 32, 8, 64),
                                       (5, 6, 2, 16)])
def test_span_attention_equals_the_gather_over_the_valid_queries(t, h, kvh, d):
    """A speculative step's k + 1 queries (consecutive positions, the valid ones first) through the paged
    prompt kernel, t padded to its query tile, equal the gather + dense causal attention on every valid
    query: rows at the table's start, mid-page, at its end, and with one valid token; GQA 1, 2, 3 and 4."""
    import jax.numpy as jnp
    from meshlab.infer import kv_cache
    rng = np.random.default_rng(t)
    page_size, max_pages, b = 4, 6, 4
    cache = {n: jnp.asarray(rng.normal(size=(2, 30, page_size, kvh, d)), jnp.float32) for n in "kv"}
    table = jnp.asarray(np.stack([rng.permutation(np.arange(1, 30))[:max_pages] for _ in range(b)]), jnp.int32)
    start = jnp.asarray([0, 5, page_size * max_pages - t, 9], jnp.int32)
    count = jnp.asarray([t, t, t, 1], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    want = kv_cache.gathered_attention(q, cache, 1, table, start[:, None] + jnp.arange(t)[None])
    got = kv_cache.span_attention(q, cache, 1, table, start, count, interpret=True)
    assert got is not None and got.shape == q.shape
    valid = np.arange(t)[None, :] < np.asarray(count)[:, None]                    # [b, t]
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)


def test_speculative_calls_over_the_gpus_layout(tiny, plain):
    """An engine as a GPU runs it (the Pallas kernels, here in interpret mode; the layers' [n, k] matrices):
    its k + 1-token steps run the prompt path's GEMMs and the paged prompt kernel, to the same greedy tokens."""
    md, params, _ = tiny
    eng = _engine(md, params, max_seqs=2, impl="pallas", interpret=True, layers="kernels")
    sp = [SamplingParams(max_tokens=m) for m in (40, 33)]
    assert [r.output for r in eng.generate(_prompts()[:2], sp)] == plain[:2]
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0


def test_speculative_calls_on_a_mesh_give_the_one_device_tokens(tiny, plain):
    """fsdp_tp over the 8 simulated devices: parameters and cache placed by the rule file."""
    import jax
    from jax.sharding import NamedSharding
    from meshlab.layout import leaf_specs
    from meshlab.mesh import make_mesh
    from meshlab.rules import load_rules
    md, params, _ = tiny
    rules, mesh = load_rules("fsdp_tp"), make_mesh("data=1,fsdp=4,tensor=2")
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params,
                           leaf_specs(md, rules, mesh, "params"), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    eng = _engine(md, sharded, rules=rules, mesh=mesh)
    assert len(eng.cache["k"].sharding.device_set) == 8
    sp = [SamplingParams(max_tokens=m) for m in (40, 33)]
    assert [r.output for r in eng.generate(_prompts()[:2], sp)] == plain[:2]
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0


def test_bad_speculation_settings_are_refused(tiny):
    md, params, _ = tiny
    with pytest.raises(ValueError, match="speculative_tokens=-1 must be >= 0"):
        _engine(md, params, k=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min=3 <= prompt_lookup_max=2"):
        _engine(md, params, prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="kinds: packed, decode, first, head, spec"):
        _engine(md, params, compiler_options={"speculative": {}})
    # the spec kind's options reach the speculative program, and only it: the prompt is prefilled first
    eng = _engine(md, params, compiler_options={"spec": {"xla_not_a_flag": "1"}})
    with pytest.raises(Exception, match="xla_not_a_flag"):
        eng.generate([_prompts()[0]], SamplingParams(max_tokens=8))
    assert eng.stats["packed_calls"] > 0 and eng.stats["spec_calls"] == 0


def test_warmup_compiles_the_speculative_calls(tiny, plain):
    md, params, _ = tiny
    eng = _engine(md, params, max_seqs=1)
    assert eng.warmup() > 0
    compiled = eng.stats["compiles"]
    assert any(key[0] == "spec" for key in eng._programs)
    out = eng.generate([_prompts()[0]], SamplingParams(max_tokens=40))[0].output
    assert out == plain[0] and eng.stats["spec_calls"] > 0
    assert eng.stats["compiles"] == compiled                      # nothing left to compile at the first request
    assert eng.warmup(logprobs=TOP_LOGPROBS) > 0                  # the logprobs kind's speculative calls too
    compiled, calls = eng.stats["compiles"], eng.stats["spec_calls"]
    eng.generate([_prompts()[0]], SamplingParams(max_tokens=40, logprobs=2))
    assert eng.stats["spec_calls"] > calls and eng.stats["compiles"] == compiled


def test_serve_speculates_greedy_requests_and_counts_the_drafts(tmp_path, monkeypatch):
    """serve.py's --speculative-tokens reaches the engine; /metrics counts the drafts checked and kept;
    a bad value is one error naming it."""
    import http.client
    import json
    from meshlab.infer.serve_cli import serve_parser, start_server
    monkeypatch.chdir(tmp_path)
    argv = ["--checkpoint", "random:tiny", "--port", "0", "--max-len", "64", "--chunk", "16", "--warmup", "off",
            "--stats-interval", "0", "--compile-cache", "", "--speculative-tokens"]
    with pytest.raises(ValueError, match="speculative_tokens=-1 must be >= 0"):
        start_server(serve_parser().parse_args(argv + ["-1"]))
    server = start_server(serve_parser().parse_args(argv + ["2", "--prompt-lookup-max", "2"]))
    try:
        assert (server.engine.speculative_tokens, server.engine.prompt_lookup) == (2, (1, 2))
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"prompt": "abcabcabcabc", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
        conn.request("POST", "/v1/completions", body=json.dumps(body))
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 12
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    finally:
        server.stop()
    drafted = float(re.search(r"^meshlab_spec_decode_draft_tokens_total (\S+)$", metrics, re.M).group(1))
    assert drafted == server.engine.stats["spec_drafted"] > 0 and server.engine.stats["spec_calls"] > 0
    assert "meshlab_spec_decode_accepted_tokens_total" in metrics


def test_generate_script_speculates_to_the_same_text(tmp_path, monkeypatch, capsys):
    import runpy
    from pathlib import Path
    from meshlab.infer import engine
    made = record_instances(monkeypatch, engine, "Engine")
    monkeypatch.chdir(tmp_path)
    script = str(Path(__file__).resolve().parents[2] / "scripts/generate.py")
    texts = []
    for extra in ([], ["--speculative-tokens", "3"]):
        runpy.run_path(script, run_name="generate")["main"](
            ["--checkpoint", "random:tiny", "--prompt", "abcabcabc", "--max-new-tokens", "24", "--compile-cache", ""] + extra)
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("abcabcabc")
    assert len(made) == 1 and made[0].stats["spec_calls"] > 0 and made[0].stats["generated_tokens"] == 24
    assert list(tmp_path.iterdir()) == []


def test_the_benchmark_rows_compare_each_k_with_plain_decoding(tiny):
    from meshlab.bench.speculative import measure, table
    md, params, _ = tiny
    prompts = [p[:24] for p in _prompts()[:2]]
    rows = measure(md, params, prompts, ks=(0, 2), max_tokens=12, max_len=64, page_size=8, chunk=16, steps_per_call=4)
    assert [r["k"] for r in rows] == [0, 2] and all(r["equal"] == r["requests"] == 2 for r in rows)
    assert rows[0]["drafted"] == 0 and rows[1]["drafted"] >= rows[1]["kept"] >= 0
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_step"] > 0 for r in rows)
    lines = table(rows, "tiny").splitlines()
    assert len(lines) == 4 and lines[3].split(" | ")[3] == "2"


@pytest.mark.gpu
def test_gpu_speculative_calls_on_the_shipped_paths(tiny):
    """On one GPU, the engine's defaults (Pallas kernels, kernels layers; the k + 1 queries through the
    paged prompt kernel): every token is the full forward's argmax up to fp32 rounding (XLA's GPU dots
    may round through TF32, hence 2e-2), with drafts made and kept."""
    import jax.numpy as jnp
    md, params, fwd = tiny
    eng = Engine(md, params, max_len=256, max_seqs=4, page_size=16, chunk=64, speculative_tokens=4)
    assert (eng.impl, eng.layers) == ("pallas", "kernels")
    sp = [SamplingParams(max_tokens=m) for m in (40, 33, 47)]
    for r in eng.generate(_prompts(), sp):
        seq = r.prompt + r.output
        logits = np.asarray(fwd(params, jnp.asarray([seq], jnp.int32)))[0, len(r.prompt) - 1:len(seq) - 1]
        chosen = logits[np.arange(len(r.output)), r.output]
        np.testing.assert_array_less(logits.max(-1) - chosen, 2e-2)
    assert eng.stats["spec_calls"] > 0 and eng.stats["spec_accepted"] > 0
