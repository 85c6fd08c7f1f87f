"""The response side of the OpenAI schemas (meshlab/infer/api.py parses the requests): the text a
choice may show so far, the tokens that text covers, and the usage and logprobs objects of completions
and chat answers, whole or streamed (meshlab/infer/http_call.py puts them into bodies and chunks).
"""
from __future__ import annotations

import dataclasses
import json

from meshlab.infer.sampler import SamplingParams


@dataclasses.dataclass
class ToolCallParams(SamplingParams):
    """The SamplingParams of a reply held to one tool call (tool_choice "required" or a named function):
    the reply is the call's JSON, so `visible` shows a reply that ends before the call is whole (cut by
    max_tokens or a stop string) as no text, never as a piece of JSON."""


def visible(req, final: bool) -> str:
    """Text safe to show so far: never a half UTF-8 character, never a possible stop-string prefix. A
    stop token that ended the reply is not in it (unless include_stop_str_in_output), as vLLM's: a
    special one decodes to nothing anyway, but another (stop_token_ids: a space, a newline) has text.
    A reply held to a tool call (ToolCallParams) shows only when its call is whole JSON."""
    p = req.params
    if (req.finish_reason == "stop" and req.text_stop is None and req.output and req.output[-1] in p.stop_token_ids
            and not p.include_stop_str_in_output and p.skip_special_tokens):   # else output_decoder cut it already
        text = req.decoded(len(req.output) - 1)
    else:
        text = req.text
    if isinstance(p, ToolCallParams):
        # a call cut short is no call and no content: finish_reason "length" (or "stop") says why it is empty
        return text if final and _whole_json(text) else ""
    if final:
        return text
    text = text.rstrip("\ufffd")
    hold = max((len(s) - 1 for s in req.params.stop), default=0)
    return text[:len(text) - hold] if hold else text


def _whole_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def covered_tokens(decode, output: list, text: str, final: bool, start: int = 0) -> int:
    """How many output tokens the shown `text` accounts for (their logprobs go out with it).
    Final: every token when the text is their whole decoding, else (a stop string cut it) the fewest
    that cover the text. Not final: the most whose decoding fits within the text shown so far."""
    if final:
        if decode(output) == text:
            return len(output)
        k = start
        while k < len(output) and len(decode(output[:k])) < len(text):
            k += 1
        return k
    n = len(output)                       # the engine thread may append meanwhile: decide on these n
    if len(decode(output[:n]).rstrip("\ufffd")) <= len(text):
        return n                          # the usual case, in one decode instead of one per new token
    k = start
    while k < len(output) and len(decode(output[:k + 1]).rstrip("\ufffd")) <= len(text):
        k += 1
    return k


def _token_bytes(tok, t: int, s: str) -> bytes:
    """Token t's bytes, its decoded text being s: its own (a byte-level vocabulary's token may be part of
    a UTF-8 character, s then U+FFFD) where the tokenizer knows them, else s's."""
    if not hasattr(tok, "tk"):                          # byte tokenizer: ids 0..255 are the bytes
        return bytes([t]) if 0 <= t < 256 else b""
    own = tok.token_bytes(t) if s and hasattr(tok, "token_bytes") else None   # s empty: a special token skipped
    return s.encode("utf-8") if own is None else own


class TokenText:
    """Each token id's text alone, as OpenAI's logprobs show it, worked out once per id: (its decoded
    text, its display string, its UTF-8 bytes). A streamed chunk's logprobs name every new token and
    its alternatives; decoding and formatting them per chunk cost the event loop ~40% of its time
    under load. At most `limit` ids are kept (then the cache starts again); skip_special_tokens=False:
    special tokens show their text."""

    def __init__(self, tok, limit: int = 1 << 18, skip_special_tokens: bool = True):
        self.tok, self.limit, self.known, self.skip = tok, limit, {}, skip_special_tokens

    def __call__(self, t: int) -> tuple:
        got = self.known.get(t)
        if got is None:
            if len(self.known) >= self.limit:
                self.known.clear()
            s = self.tok.decode([t]) if self.skip else self.tok.decode([t], skip_special_tokens=False)
            raw = _token_bytes(self.tok, t, s)
            # a part of a UTF-8 character: OpenAI's bytes: form
            shown = "bytes:" + "".join(f"\\x{b:02x}" for b in raw) if "\ufffd" in s else s
            got = self.known[t] = (s, shown, tuple(raw))
        return got


def token_id_text(text: TokenText):
    """`text` with each token shown as "token_id:<id>" (vLLM's return_tokens_as_token_ids), so that a
    client can tell apart tokens whose texts are equal or empty (two ids of the byte tokenizer that
    both decode to "" would otherwise share one top_logprobs key)."""
    def shown_as_id(t: int) -> tuple:
        piece, _, raw = text(t)
        return piece, f"token_id:{t}", raw
    return shown_as_id


def completion_logprobs(text: TokenText, output, entries, offset: int, before: dict | None = None) -> dict:
    """OpenAI completions format for output tokens with (logprob, {id: logprob}) entries (None: a
    prompt's first token, null in both); `offset`: where the first token's text starts in the
    choice's text; `before`: the lists of tokens shown before these (the echoed prompt's), extended."""
    out = before or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, entry in zip(output, entries):
        piece, shown, _ = text(t)
        out["tokens"].append(shown)
        out["token_logprobs"].append(None if entry is None else float(entry[0]))
        if entry is None:
            out["top_logprobs"].append(None)
        else:                           # OpenAI: the chosen token always among them, so up to logprobs + 1 entries
            top = {text(a)[1]: float(v) for a, v in entry[1].items()}
            top.setdefault(shown, float(entry[0]))
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(piece)
    return out


def chat_logprobs(text: TokenText, output, entries) -> dict:
    def one(t, lp):
        _, shown, raw = text(t)
        return {"token": shown, "logprob": float(lp), "bytes": raw}
    return {"content": [dict(one(t, lp), top_logprobs=[one(a, v) for a, v in top.items()])
                        for t, (lp, top) in zip(output, entries)]}


def prompt_logprobs_list(text: TokenText, prompt, entries, top: int, by_id: bool = False) -> list:
    """vLLM's prompt_logprobs: per prompt token (the first null) {"<id>": {logprob, rank, decoded_token}}
    for the token itself and its `top` most likely alternatives (ranks 1..top), from Request.prompt_logprobs
    entries (logprob, {id: logprob} best first, rank); by_id: decoded_token as "token_id:<id>"."""
    def one(t, lp, rank):
        return {"logprob": float(lp), "rank": int(rank), "decoded_token": text(t)[1] if by_id else text(t)[0]}
    out = []
    for t, entry in zip(prompt, entries):
        if entry is None:
            out.append(None)
            continue
        lp, alternatives, rank = entry
        shown = {str(a): one(a, v, j + 1) for j, (a, v) in enumerate(list(alternatives.items())[:top])}
        shown.setdefault(str(t), one(t, lp, rank))
        out.append(shown)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
