"""What the server's completions answer: streamed equal to whole, stop strings, echo, n, several and truncated prompts,
special tokens, logprobs (of the output, the prompt and an echoed prompt) against the model's fp32 numbers, beam
search against a reference search, and the sampling controls (logit bias, penalties, allowed ids, bad words)."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from meshlab.infer import api_responses
from meshlab.tokenizer import ByteTokenizer
from tests.infer.http_helpers import call, scrape, sse_text

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.xdist_group("server"), pytest.mark.cheap_codegen]   # the shared server: see test_server.py


def test_completion_stream_equals_whole(server):
    body = {"model": "tiny", "prompt": "def main(", "max_tokens": 12, "temperature": 0}
    status, whole = call(server, "POST", "/v1/completions", body)
    assert status == 200 and whole["object"] == "text_completion"
    assert whole["usage"]["prompt_tokens"] == 9 and whole["choices"][0]["finish_reason"] in ("length", "stop")
    status, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    assert status == 200
    text, finish = sse_text(payload, chat=False)
    assert text == whole["choices"][0]["text"] and finish == whole["choices"][0]["finish_reason"]
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True,
                                                              stream_options={"include_usage": True}))
    last = json.loads([e for e in payload.splitlines() if e.startswith("data: {")][-1][6:])
    assert last["choices"] == [] and last["usage"] == whole["usage"]


def test_generate_script_streams(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", "random:tiny",
                          "--dtype", "float32", "--prompt", "abc", "--max-new-tokens", "5", "--chunk", "16"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("abc")
    bad = subprocess.run([sys.executable, str(ROOT / "scripts/generate.py"), "--checkpoint", str(tmp_path / "nope"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "does not exist" in bad.stderr


def test_stop_string_truncates(server):
    body = {"prompt": "while True:", "max_tokens": 16, "temperature": 0}
    text = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    i = next((i for i in range(2, len(text)) if text[i] not in "\ufffd"), None)
    if i is None:
        pytest.skip("no plain character in this model's output to stop on")
    stop = text[i]
    got = call(server, "POST", "/v1/completions", dict(body, stop=[stop]))[1]["choices"][0]
    assert got["text"] == text[:text.index(stop)] and got["finish_reason"] == "stop"
    kept = call(server, "POST", "/v1/completions", dict(body, stop=[stop], include_stop_str_in_output=True))[1]
    assert kept["choices"][0]["text"] == text[:text.index(stop) + 1]          # vLLM's: the stop string kept
    _, payload = call(server, "POST", "/v1/completions", dict(body, stop=stop, stream=True))
    assert sse_text(payload, chat=False) == (got["text"], "stop")


def test_echo_and_zero_max_tokens(server):
    body = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0}
    plain = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    echoed = call(server, "POST", "/v1/completions", dict(body, echo=True))[1]
    assert echoed["choices"][0]["text"] == "def f(x):" + plain
    _, payload = call(server, "POST", "/v1/completions", dict(body, echo=True, stream=True))
    assert sse_text(payload, chat=False)[0] == "def f(x):" + plain
    status, zero = call(server, "POST", "/v1/completions", dict(body, echo=True, max_tokens=0))
    assert status == 200 and zero["choices"][0]["text"] == "def f(x):" and zero["usage"]["completion_tokens"] == 0
    default = call(server, "POST", "/v1/completions", {"prompt": "def f(x):"})[1]          # OpenAI's default: 16
    assert default["usage"]["completion_tokens"] == 16 or default["choices"][0]["finish_reason"] == "stop"
    assert default["usage"]["completion_tokens"] <= 16


def test_requests_sample_unless_told_not_to(server):
    """As OpenAI's API: a request without `temperature` samples at 1, and one without `seed` draws its own
    (two such requests differ, over a random model's near-flat 16-token draws); a seed repeats its
    answer, and temperature 0 gives the greedy one whatever the seed."""
    body = {"prompt": "def f(x):", "max_tokens": 16}
    text = lambda **kw: call(server, "POST", "/v1/completions", dict(body, **kw))[1]["choices"][0]["text"]  # noqa: E731
    assert text() != text()
    assert text(seed=7) == text(seed=7) == text(seed=7, temperature=1.0) != text(seed=7, temperature=0)
    assert text(temperature=0) == text(temperature=0, seed=1)


def test_completion_top_logprobs_hold_the_chosen_token(server):
    """OpenAI's completions: top_logprobs always hold the sampled token, so up to logprobs + 1 entries
    (logprobs 0: the chosen token alone), each with the logprob token_logprobs gives it."""
    body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 1.5, "seed": 3}
    for k in (0, 1):
        lp = call(server, "POST", "/v1/completions", dict(body, logprobs=k))[1]["choices"][0]["logprobs"]
        for tok, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[tok] == chosen and len(top) <= k + 1 and (k or len(top) == 1)


def test_n_choices_are_seeded_copies(server):
    """n=3 gives three choices; choice i is what the same request alone gives with seed + i; the
    copies take the prompt's full pages (3 of 8 tokens) from the prefix cache instead of prefilling."""
    body = {"prompt": "import os, sys, json, time, re", "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 3}
    hits = server.engine.stats["prefix_hit_tokens"]
    status, resp = call(server, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert server.engine.stats["prefix_hit_tokens"] - hits >= 2 * 24
    alone = [call(server, "POST", "/v1/completions", dict(body, n=1, seed=11 + i))[1]["choices"][0]["text"]
             for i in range(3)]
    assert [c["text"] for c in resp["choices"]] == alone and len(set(alone)) > 1
    assert resp["usage"]["completion_tokens"] == 3 * 8 or any(c["finish_reason"] == "stop" for c in resp["choices"])
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:]) for e in payload.splitlines() if e.startswith("data: {")]
    per = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(3)]
    assert per == alone


def test_several_prompts_answer_in_prompt_order(server):
    """A list of prompts (strings or token-id lists, as evaluation harnesses batch them) gets n choices
    per prompt, in OpenAI's order (index = prompt * n + copy), each what its prompt alone gets; usage
    counts each prompt once; streaming gives the same texts; echo with logprobs scores each prompt."""
    prompts = ["def f(x):", "import os", [100, 101, 102]]
    body = {"prompt": prompts, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 3}
    status, resp = call(server, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in resp["choices"]] == list(range(6))
    for i, c in enumerate(resp["choices"]):
        alone = call(server, "POST", "/v1/completions", dict(body, prompt=prompts[i // 2], n=1, seed=3 + i % 2))[1]
        assert c["text"] == alone["choices"][0]["text"]
    assert resp["usage"]["prompt_tokens"] == 9 + 9 + 3
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    texts = [""] * 6
    for e in payload.splitlines():
        if e.startswith("data: {"):
            for c in json.loads(e[6:])["choices"]:
                texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in resp["choices"]]
    scored = call(server, "POST", "/v1/completions", dict(body, n=1, echo=True, logprobs=0, max_tokens=1,
                                                           temperature=0))[1]["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in scored] == [10, 10, 4]
    assert [c["text"][:-1] for c in scored] == ["def f(x):", "import os", "def"]


def test_truncate_prompt_tokens_keeps_the_prompts_end(server):
    """vLLM's truncate_prompt_tokens k: the prompt's last k tokens only (left truncation), as if sent
    alone (usage, greedy answer, echo); -1 keeps as many as the context holds beside max_tokens (a chat
    request without max_tokens: all but one position); a prompt already short is kept."""
    ids = ByteTokenizer().encode("the first part is dropped; the end is kept")
    body = {"prompt": "the first part is dropped; the end is kept", "max_tokens": 6, "temperature": 0}
    status, cut = call(server, "POST", "/v1/completions", dict(body, truncate_prompt_tokens=10, echo=True))
    alone = call(server, "POST", "/v1/completions", dict(body, prompt=ids[-10:]))[1]
    assert status == 200 and cut["usage"]["prompt_tokens"] == 10
    assert cut["choices"][0]["text"] == ByteTokenizer().decode(ids[-10:]) + alone["choices"][0]["text"]
    full = call(server, "POST", "/v1/completions", body)[1]
    for keep in (-1, len(ids), 100):
        same = call(server, "POST", "/v1/completions", dict(body, truncate_prompt_tokens=keep))[1]
        assert same["usage"] == full["usage"] and same["choices"][0]["text"] == full["choices"][0]["text"]
    status, cut = call(server, "POST", "/v1/completions", dict(body, prompt="y" * 200, truncate_prompt_tokens=-1))
    assert status == 200 and cut["usage"] == {"prompt_tokens": 122, "completion_tokens": 6, "total_tokens": 128}, cut
    status, cut = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 200}],
                                                                "truncate_prompt_tokens": -1, "temperature": 0})
    assert status == 200 and cut["usage"]["prompt_tokens"] == 127 and cut["usage"]["completion_tokens"] == 1, cut
    for bad in (0, -2, "10"):
        status, err = call(server, "POST", "/v1/completions", dict(body, truncate_prompt_tokens=bad))
        assert status == 400 and err["error"]["param"] == "truncate_prompt_tokens", err


def test_skip_special_tokens_false_shows_them(server, templated_tokenizer):
    """vLLM's skip_special_tokens false: special tokens (a logit bias makes the model say <|eot|>) show
    in the text, whole and streamed, in the logprobs' tokens and offsets, and in an echoed prompt of
    token ids; a stop token that ends the output stays out unless include_stop_str_in_output."""
    tok = templated_tokenizer
    eot = tok.stop_token_ids[0]
    old = server.tok, server.engine.detokenize, server.token_text, server.special_token_text
    server.tok, server.engine.detokenize = tok, tok.decode
    server.token_text, server.special_token_text = api_responses.TokenText(tok), api_responses.TokenText(tok, skip_special_tokens=False)
    body = {"prompt": "hello", "max_tokens": 3, "logit_bias": {str(eot): 100}, "logprobs": 1}
    try:
        texts = {skip: call(server, "POST", "/v1/completions", dict(body, skip_special_tokens=skip))[1]["choices"][0]
                 for skip in (True, False)}
        status, streamed = call(server, "POST", "/v1/completions", dict(body, skip_special_tokens=False, stream=True))
        ended = {keep: call(server, "POST", "/v1/completions", dict(
            body, skip_special_tokens=False, stop_token_ids=[eot], include_stop_str_in_output=keep))[1]["choices"][0]
            for keep in (False, True)}
        echo = call(server, "POST", "/v1/completions", {"prompt": [eot] + tok.encode("hi"), "max_tokens": 0, "echo": True,
                                                        "skip_special_tokens": False})[1]["choices"][0]["text"]
        bad = call(server, "POST", "/v1/completions", dict(body, skip_special_tokens="no"))
    finally:
        server.tok, server.engine.detokenize, server.token_text, server.special_token_text = old
    assert texts[True]["text"] == "" and texts[False]["text"] == "<|eot|>" * 3
    assert texts[False]["logprobs"]["tokens"] == ["<|eot|>"] * 3 and texts[False]["logprobs"]["text_offset"] == [0, 7, 14]
    assert status == 200 and sse_text(streamed, chat=False)[0] == "<|eot|>" * 3
    assert ended[False]["text"] == "" and ended[True]["text"] == "<|eot|>"
    assert ended[False]["finish_reason"] == ended[True]["finish_reason"] == "stop"
    assert echo == "<|eot|>hi"
    assert bad[0] == 400 and bad[1]["error"]["param"] == "skip_special_tokens"


def _reference_logprobs(srv, prompt_ids, output_ids):
    """log_softmax of the model's fp32 logits over the real vocabulary, position by position."""
    ids = np.array([prompt_ids + output_ids], np.int32)
    logits = srv.md.bind(srv.params)(ids)[0, :, :srv.md.cfg.vocab_size]
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return [lp[len(prompt_ids) - 1 + k] for k in range(len(output_ids))]


def test_completion_logprobs_match_the_model(server):
    body = {"prompt": "def g(", "max_tokens": 6, "logprobs": 3, "temperature": 0}
    status, resp = call(server, "POST", "/v1/completions", body)
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == resp["usage"]["completion_tokens"] == 6
    out = [int(t[6:], 16) if t.startswith("bytes:") else (ByteTokenizer().encode(t) or [256])[0] for t in
           (t.replace("\\x", "") for t in lp["tokens"])]
    ref = _reference_logprobs(server, ByteTokenizer().encode("def g("), out)
    for k, (t, row) in enumerate(zip(out, ref)):
        assert abs(lp["token_logprobs"][k] - row[t]) < 1e-4
        top = sorted(row, reverse=True)[:3]
        assert np.allclose(sorted(lp["top_logprobs"][k].values(), reverse=True), top, atol=1e-4)
        assert lp["token_logprobs"][k] == pytest.approx(max(lp["top_logprobs"][k].values()), abs=1e-5)  # greedy
    assert ByteTokenizer().decode(out) == choice["text"] and lp["text_offset"][0] == 0
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:])["choices"][0] for e in payload.splitlines() if e.startswith("data: {")]
    streamed = sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), [])
    assert np.allclose(streamed, lp["token_logprobs"], atol=1e-6)


def test_logprobs_name_token_ids_when_asked(server):
    """vLLM's return_tokens_as_token_ids: tokens and their alternatives as "token_id:<id>", so ids whose
    texts are equal stay apart (ids >= 256 all decode to "" under the byte tokenizer: as text they
    would share one top_logprobs key); each named id's logprob is the model's at that id."""
    prompt = ByteTokenizer().encode("def g(")
    body = {"prompt": "def g(", "max_tokens": 6, "logprobs": 3, "return_tokens_as_token_ids": True, "temperature": 0}
    status, resp = call(server, "POST", "/v1/completions", body)
    lp = resp["choices"][0]["logprobs"]
    assert status == 200 and all(t.startswith("token_id:") for t in lp["tokens"])
    out = [int(t[len("token_id:"):]) for t in lp["tokens"]]
    assert ByteTokenizer().decode(out) == resp["choices"][0]["text"]
    for k, row in enumerate(_reference_logprobs(server, prompt, out)):
        assert abs(lp["token_logprobs"][k] - row[out[k]]) < 1e-4
        alts = {int(key[len("token_id:"):]): v for key, v in lp["top_logprobs"][k].items()}
        assert sorted(alts) == sorted(np.argsort(row)[-3:].tolist())
        assert all(abs(v - row[i]) < 1e-4 for i, v in alts.items())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True}
    content = call(server, "POST", "/v1/chat/completions", chat)[1]["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") and all(a["token"].startswith("token_id:") for a in e["top_logprobs"])
               for e in content)
    status, err = call(server, "POST", "/v1/completions", dict(body, return_tokens_as_token_ids="yes"))
    assert status == 400 and err["error"]["param"] == "return_tokens_as_token_ids"


def test_chat_logprobs_format(server):
    # ignore_eos: the random model's sampled EOS (about one reply in 60 here) would end the reply early
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}
    status, resp = call(server, "POST", "/v1/chat/completions", body)
    content = resp["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == resp["usage"]["completion_tokens"] == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    plain = call(server, "POST", "/v1/chat/completions", dict(body, logprobs=False, top_logprobs=None))[1]
    assert plain["choices"][0]["logprobs"] is None


def test_logprobs_bytes_are_the_tokens_own(templated_tokenizer, tmp_path):
    """OpenAI's logprobs `bytes` of a token holding part of a UTF-8 character (the byte-level BPE of a
    tokenizer.json: "é" is two tokens of one byte each, each decoding to U+FFFD alone) are the token's own
    bytes, read off its vocabulary string, not U+FFFD's; whole characters and added tokens keep their
    text's; a vocabulary that is not byte-level falls back to the decoded text's bytes."""
    from tokenizers import Tokenizer, models as tk_models
    from meshlab.infer.loading import HFTokenizer
    tok = templated_tokenizer
    ids = tok.encode("é!")
    assert len(ids) == 3 and tok.byte_level
    entries = [(-1.0, {t: -1.0}) for t in ids]
    content = api_responses.chat_logprobs(api_responses.TokenText(tok), ids, entries)["content"]
    assert [e["bytes"] for e in content] == [(0xC3,), (0xA9,), (ord("!"),)]
    assert [e["token"] for e in content] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    eot = tok.stop_token_ids[0]
    assert api_responses.TokenText(tok, skip_special_tokens=False)(eot) == ("<|eot|>", "<|eot|>", tuple(b"<|eot|>"))
    assert api_responses.TokenText(tok)(eot) == ("", "", ())                       # skipped: no text, no bytes
    Tokenizer(tk_models.WordLevel({"\u00e9": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    word = HFTokenizer(tmp_path / "tokenizer.json")
    assert not word.byte_level and api_responses.TokenText(word)(0) == ("é", "é", tuple("é".encode()))


def test_covered_tokens_decode_once_when_the_text_shows_them_all():
    """The tokens a streamed chunk's logprobs cover: one decoding when the shown text holds all of
    them (the usual case), not one per new token; a held-back tail still bounds them."""
    tok, lengths = ByteTokenizer(), []
    decode = lambda ids: lengths.append(len(ids)) or tok.decode(ids)   # noqa: E731
    out = list(b"hello world")
    assert api_responses.covered_tokens(decode, out, "hello world", False, start=3) == 11 and lengths == [11]
    assert api_responses.covered_tokens(decode, out, "hello wo", False, start=3) == 8
    assert api_responses.covered_tokens(decode, out + [0xE2, 0x82], "hello world", False, start=3) == 13   # half a character


def test_prompt_logprobs_list_each_prompt_tokens_rank_and_alternatives(server):
    """vLLM's prompt_logprobs k: per prompt token (the first null) the token's logprob and rank and its k
    most likely alternatives with ranks 1..k, as the model computes them in fp32; in every completion
    choice (n = 2 shares the first copy's scores), once beside a chat reply; with stream a 400."""
    tok = ByteTokenizer()
    ids = tok.encode("def f(x): return x  # twenty-five")                              # crosses chunks of 16
    status, resp = call(server, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 2, "prompt_logprobs": 2,
                                                            "temperature": 0.7, "n": 2})
    assert status == 200, resp
    ref = _reference_logprobs(server, ids[:1], ids[1:])                                  # row k - 1: before ids[k]
    assert resp["choices"][0]["prompt_logprobs"] == resp["choices"][1]["prompt_logprobs"]
    listed = resp["choices"][0]["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for k in range(1, len(ids)):
        row, entry, t = ref[k - 1], listed[k], ids[k]
        best = np.argsort(-row)[:2].tolist()
        assert [int(a) for a in entry][:2] == best and set(entry) == {str(a) for a in best + [t]}
        assert [entry[str(a)]["rank"] for a in best] == [1, 2]
        assert entry[str(t)]["logprob"] == pytest.approx(row[t], abs=1e-4)
        assert 1 + np.sum(row > row[t] + 1e-4) <= entry[str(t)]["rank"] <= 1 + np.sum(row > row[t] - 1e-4)   # ties
        assert entry[str(t)]["decoded_token"] == tok.decode([t])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    status, resp = call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and len(resp["prompt_logprobs"]) == resp["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in resp["prompt_logprobs"][1:])
    for bad in ({"stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        status, err = call(server, "POST", "/v1/chat/completions", dict(chat, **bad))
        assert status == 400 and err["error"]["param"] == "prompt_logprobs", err


def test_echo_with_logprobs_scores_the_prompt(server):
    """What evaluation harnesses send to score a continuation (lm-evaluation-harness's local-completions:
    the prompt as one list of ids, echo, logprobs 1, max_tokens 1): every prompt token's logprob given
    the ones before it (the first null), then the generated token's, each as the model computes it in
    fp32. max_tokens 0 gives the prompt's alone; streaming gives the same values; a prompt met again
    is served its full pages' stored scores and computes the rest, in other chunks than the first
    time: the same values within fp32 rounding."""
    ids = ByteTokenizer().encode("def score(x): return x * 2  # forty tokens")       # crosses chunks of 16
    body = {"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    status, resp = call(server, "POST", "/v1/completions", body)
    choice, n = resp["choices"][0], len(ids)
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == n + 1 and resp["usage"]["completion_tokens"] == 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _reference_logprobs(server, ids[:1], ids[1:])                               # row k: after ids[:k + 1]
    for k in range(1, n):
        assert abs(lp["token_logprobs"][k] - ref[k - 1][ids[k]]) < 1e-4
        top = lp["top_logprobs"][k]                    # the best token, and the prompt's own when another
        assert len(top) <= 2 and top[lp["tokens"][k]] == lp["token_logprobs"][k]
        assert max(top.values()) == pytest.approx(ref[k - 1].max(), abs=1e-4)
    assert lp["text_offset"][:3] == [0, 1, 2] and lp["text_offset"][n] == len(choice["text"]) - 1
    assert lp["token_logprobs"][n] == pytest.approx(max(lp["top_logprobs"][n].values()), abs=1e-5)   # greedy
    plain = call(server, "POST", "/v1/completions", {"prompt": [ids], "max_tokens": 1, "temperature": 0})[1]["choices"][0]["text"]
    assert choice["text"] == ByteTokenizer().decode(ids) + plain      # the token the scoring pass answered with
    stored = lambda: scrape(server)["meshlab_prompt_tokens_score_cached_total"]   # noqa: E731
    before = stored()
    again = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["logprobs"]["token_logprobs"]
    assert np.allclose(again[1:], lp["token_logprobs"][1:], atol=1e-6)
    assert stored() - before == (n // 8 - 1) * 8         # all but its last full page of 8 from the store
    status, zero = call(server, "POST", "/v1/completions", dict(body, max_tokens=0))
    zl = zero["choices"][0]["logprobs"]
    assert status == 200 and zero["usage"]["completion_tokens"] == 0 and len(zl["tokens"]) == n
    assert zero["choices"][0]["text"] == ByteTokenizer().decode(ids)
    assert np.allclose(zl["token_logprobs"][1:], lp["token_logprobs"][1:n], atol=1e-6)
    _, payload = call(server, "POST", "/v1/completions", dict(body, stream=True))
    chunks = [json.loads(e[6:])["choices"][0] for e in payload.splitlines() if e.startswith("data: {")]
    streamed = sum((c["logprobs"]["token_logprobs"] for c in chunks if c["logprobs"]), [])
    assert streamed[0] is None and np.allclose(streamed[1:], lp["token_logprobs"][1:], atol=1e-6)
    assert "".join(c["text"] for c in chunks) == choice["text"]


def test_a_prompt_that_fills_the_context_is_scored(server):
    """lm-evaluation-harness's rolling loglikelihood sends windows of the whole context with max_tokens 0,
    echo and logprobs: the prompt is scored though no output token would fit beside it."""
    ids = (ByteTokenizer().encode("def fill(x): return x  # ") * 8)[:128]          # the server's context: 128
    status, resp = call(server, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert status == 200, resp
    lp = resp["choices"][0]["logprobs"]
    assert resp["usage"]["completion_tokens"] == 0 and len(lp["tokens"]) == 128 and lp["token_logprobs"][0] is None
    ref = _reference_logprobs(server, ids[:1], ids[1:])
    assert np.allclose(lp["token_logprobs"][1:], [row[t] for row, t in zip(ref, ids[1:])], atol=1e-4)


def _reference_beam_search(srv, prompt, width, steps, stops, penalty):
    """Beam search over the model's fp32 log-softmax, written out: each live beam's 2 x width best next
    tokens, a stop token finishing its beam, the width best live ones kept; ranked by summed logprob /
    (prompt + output length) ** penalty. [(output, finish_reason)] best first."""
    live, done = [([], 0.0)], []
    for _ in range(steps):
        grown = []
        for out, total in live:
            row = _reference_logprobs(srv, prompt + out, [0])[0]
            for t in np.argsort(-row, kind="stable")[:2 * width].tolist():
                (done if t in stops else grown).append((out if t in stops else out + [t], total + float(row[t])))
        live = sorted(grown, key=lambda b: -b[1])[:width]
    ranked = [(o, lp, "stop") for o, lp in done] + [(o, lp, "length") for o, lp in live]
    ranked.sort(key=lambda b: -b[1] / (len(prompt) + len(b[0])) ** penalty)
    return [(o, reason) for o, _, reason in ranked[:width]]


def test_beam_ranking_divides_by_the_length_to_the_penalty():
    """best_beams and next_beams as vLLM ranks: summed logprob / (prompt + output) ** length_penalty over
    finished and live beams (a kept stop token not counted); a round keeps the width best live beams
    and finishes those a stop token extends."""
    from meshlab.infer.beam import Beam, best_beams, next_beams
    short, long = Beam([1], -2.0, "stop"), Beam([1, 2, 3], -2.5)           # lengths 5 and 7 after 4 prompt tokens
    assert [b.output for b in best_beams([short], [long], 2, 4, 1.0)] == [[1, 2, 3], [1]]      # -0.357 > -0.4
    assert [b.output for b in best_beams([Beam([1], -2.0, "stop")], [Beam([1, 2, 3], -2.5)], 2, 4, 0.0)] == \
        [[1], [1, 2, 3]]                                                   # no penalty: the summed logprob
    assert Beam([1, 9], -2.0, "stop", kept_stop=True).score(4, 1.0) == short.score(4, 1.0)
    live, done = next_beams([Beam([5], -1.0), Beam([6], -1.5)], [{7: -0.1, 9: -0.2}, {8: -0.05, 9: -3.0}], 2, {9}, False)
    assert [(b.output, b.logprob) for b in live] == [([5, 7], -1.1), ([6, 8], -1.55)]
    assert [(b.output, b.finish_reason) for b in done] == [([5], "stop"), ([6], "stop")]


@pytest.mark.parametrize("width,penalty", [(3, 1.0), (2, 0.5)])
def test_beam_search_equals_the_reference(server, width, penalty):
    """vLLM's use_beam_search (width n, length_penalty): the choices are the reference search's beams in
    its order, with their finish reasons (a stop token among the candidates ends a beam); usage counts
    every beam's tokens; the engine holds nothing afterwards."""
    tok = ByteTokenizer()
    prompt = tok.encode("def beam(")
    status, resp = call(server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 5, "n": width,
                                                            "use_beam_search": True, "length_penalty": penalty})
    assert status == 200, resp
    want = _reference_beam_search(server, prompt, width, 5, {256}, penalty)
    got = [(c["text"], c["finish_reason"]) for c in resp["choices"]]
    assert got == [(tok.decode(o), reason) for o, reason in want]
    assert resp["usage"]["completion_tokens"] == sum(len(o) for o, _ in want)
    assert not server.engine.has_work()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2, "use_beam_search": True}
    status, resp = call(server, "POST", "/v1/chat/completions", chat)
    assert status == 200 and len(resp["choices"]) == 2 and resp["choices"][0]["message"]["content"] != \
        resp["choices"][1]["message"]["content"]
    for bad, param in (({"temperature": 0.7}, "use_beam_search"), ({"stream": True}, "use_beam_search"),
                       ({"n": 11}, "n"), ({"logprobs": True}, "use_beam_search"), ({"stop": ["x"]}, "use_beam_search")):
        status, err = call(server, "POST", "/v1/chat/completions", dict(chat, **bad))
        assert status == 400 and err["error"]["param"] == param, err


def test_logit_bias_and_penalties_reach_the_sampler(server):
    """logit_bias of +100 on one token makes greedy answer with it every time; the presence and frequency
    penalties are accepted (the engine tests check their values)."""
    body = {"prompt": "def f(x):", "max_tokens": 4, "logit_bias": {str(ord("z")): 100}}
    status, resp = call(server, "POST", "/v1/completions", body)
    assert status == 200 and resp["choices"][0]["text"] == "zzzz"
    status, resp = call(server, "POST", "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4,
                                                            "presence_penalty": 1.0, "frequency_penalty": 0.5})
    assert status == 200 and resp["usage"]["completion_tokens"] >= 1


def test_allowed_token_ids_and_bad_words_hold_the_output(server):
    """vLLM's allowed_token_ids keeps every output token among them, greedy and drawn; its bad_words keeps
    a one-token word out of the output, and a longer word's last token out after the rest of it (the
    greedy answer's first two tokens as the word: the answer begins with the first, then turns away)."""
    body = {"prompt": "def f(x):", "max_tokens": 8, "logprobs": 0, "return_tokens_as_token_ids": True, "temperature": 0}

    def ids(extra):
        status, resp = call(server, "POST", "/v1/completions", dict(body, **extra))
        assert status == 200, resp
        return [int(t[len("token_id:"):]) for t in resp["choices"][0]["logprobs"]["tokens"]]
    greedy = ids({})
    for extra in ({}, {"temperature": 1.0, "seed": 5}):
        assert set(ids(dict(extra, allowed_token_ids=[97, 98]))) <= {97, 98}
    text = ByteTokenizer().decode(greedy[:2])
    assert len(greedy) == 8 and max(greedy[:2]) < 128 and len(text) == 2            # two ASCII bytes: one word
    turned = ids({"bad_words": [text]})
    assert turned[0] == greedy[0] and turned[1] != greedy[1]
    assert greedy[0] not in ids({"bad_words": [text[0]]})


def test_vllm_sampling_extras(server):
    """min_p, ignore_eos, stop_token_ids and min_tokens (vLLM's extras, which its clients send) change the
    answer as they say: min_p 1 keeps only the best token, so a draw at temperature 1 answers as greedy;
    a token forced by logit_bias stops the answer when it is the model's end token or in stop_token_ids,
    not when ignore_eos drops the end token, and only after min_tokens others; a stop token's text stays
    out of the reply, whole and streamed (as vLLM's), unless include_stop_str_in_output."""
    body = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    greedy = call(server, "POST", "/v1/completions", body)[1]["choices"][0]["text"]
    for seed in (1, 2):
        drawn = call(server, "POST", "/v1/completions", dict(body, temperature=1.0, min_p=1.0, seed=seed))[1]
        assert drawn["choices"][0]["text"] == greedy
    eos = dict(body, logit_bias={"256": 100})                # the server's end token (stop_token_ids=[256])
    stopped = call(server, "POST", "/v1/completions", eos)[1]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    ignored = call(server, "POST", "/v1/completions", dict(eos, ignore_eos=True))[1]
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8
    held = call(server, "POST", "/v1/completions", dict(eos, min_tokens=5))[1]         # the end token held back 5
    assert held["choices"][0]["finish_reason"] == "stop" and held["usage"]["completion_tokens"] == 6
    again = call(server, "POST", "/v1/completions", eos)[1]                          # the slot's held stops cleared
    assert again["usage"]["completion_tokens"] == 1
    z = dict(body, logit_bias={str(ord("z")): 100})
    assert call(server, "POST", "/v1/completions", z)[1]["choices"][0]["text"] == "z" * 8
    got = call(server, "POST", "/v1/completions", dict(z, stop_token_ids=[ord("z")], logprobs=0))[1]
    assert got["choices"][0]["text"] == "" and got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] == 1 and got["choices"][0]["logprobs"]["tokens"] == []
    _, payload = call(server, "POST", "/v1/completions", dict(z, stop_token_ids=[ord("z")], stream=True))
    assert sse_text(payload, chat=False) == ("", "stop")
    kept = dict(z, stop_token_ids=[ord("z")], include_stop_str_in_output=True)
    assert call(server, "POST", "/v1/completions", kept)[1]["choices"][0]["text"] == "z"
    _, payload = call(server, "POST", "/v1/completions", dict(kept, stream=True))
    assert sse_text(payload, chat=False) == ("z", "stop")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "logit_bias": {str(ord("z")): 100}, "stop_token_ids": [ord("z")]}
    for stream in (False, True):
        status, resp = call(server, "POST", "/v1/chat/completions", dict(chat, stream=stream))
        got = sse_text(resp, chat=True) if stream else (resp["choices"][0]["message"]["content"],
                                                        resp["choices"][0]["finish_reason"])
        assert status == 200 and got == ("", "stop")
