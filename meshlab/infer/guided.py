"""Structured output: a request's tokens held to a grammar (OpenAI's `response_format` json_object and
json_schema; vLLM's `structured_outputs` json, regex, choice and grammar), by llguidance's token
matcher (the library vLLM and SGLang offer for it; the `serve` extra installs it). request_grammar
reads a request's fields into its one grammar.

A request carries its grammar (SamplingParams.grammar, llguidance's text: `json_grammar` makes one
from a JSON schema); the engine makes its matcher at admission (`Guide`) from a tokenizer view built
once (`matcher_tokenizer`), and before each step the matcher's allowed tokens, a bitmask of
ceil(V / 32) int32 words, go into the slot's MASK cache entry (programs.MASK); the sampler sets every
other token's logit to -inf (sampler.sample's `allowed`). Each sampled token advances the matcher on
the host; a grammar that is complete (nothing may follow) finishes the request with "stop", and one
that may end allows the tokenizer's end-of-sequence token.

What it costs: the next mask needs the last token on the host, so a guided row sits out each step
planned while its last token is still on the device (Scheduler.decoding; the engine's steps still
overlap: it decodes every other step), and while one runs, decode calls do not chain and run
Engine.guided_steps steps (default 1), of which a guided row takes the first. A step's masks are
computed in parallel across its guided rows (llguidance's executor; ~2-100 us each, the grammar's)
and written in one device call; the sampling programs read a [rows, V / 32]
mask and take their non-greedy path (penalties and a draw per row) for guided rows.

vLLM's allowed_token_ids and bad_words (`TokenRules`) ride in the same MASK rows, alone or over a
grammar's mask. Allowed tokens and one-token bad words are a fixed mask, written once when the request
takes a slot: no step rule, its decode calls chain and run steps_per_call steps. A bad word of several
tokens bans its last one after the rest, so its mask follows each token, as a grammar's does, at the
same cost.
"""
from __future__ import annotations

import collections
import json
from typing import Optional

import numpy as np

from meshlab.infer.programs import MASK
from meshlab.infer.scheduler import AdmissionError

# Compact JSON unless the schema's own "x-guidance" says otherwise: no whitespace between tokens (a
# model may otherwise spend its max_tokens on blanks the grammar allows).
JSON_DEFAULTS = {"whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured output (response_format, structured_outputs) needs llguidance: "
                         "pip install 'meshlab[serve]'") from None
    return llguidance


def json_grammar(schema, whitespace_pattern=None) -> str:
    """The llguidance grammar of a JSON schema (a dict, or True: any JSON object); whitespace_pattern,
    a regex, is the whitespace allowed between its tokens (none by default)."""
    llg = _llguidance()
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, not {type(schema).__name__}")
    defaults = JSON_DEFAULTS if whitespace_pattern is None else dict(JSON_DEFAULTS, whitespace_pattern=whitespace_pattern)
    return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)


def regex_grammar(pattern: str) -> str:
    """The grammar of a regular expression (Rust's regex syntax) that the whole output matches."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("a regex must be a non-empty string")
    return _checked(_llguidance().LLMatcher.grammar_from_regex(pattern), "regex")


def choice_grammar(choices) -> str:
    """The grammar whose outputs are exactly the given strings."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    return _checked(_llguidance().grammar_from("choice", choices), "choice")


def cfg_grammar(text: str) -> str:
    """The grammar of a context-free grammar's text: llguidance's Lark (a `start` rule) or GBNF as
    llama.cpp writes it (a `root` rule), as vLLM's guidance backend reads `grammar`."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a grammar must be non-empty text")
    return _checked(_llguidance().grammar_from("grammar", text), "grammar")   # ValueError: GBNF that does not convert


def _checked(grammar: str, what: str) -> str:
    """The grammar, or ValueError with llguidance's message (the grammar_from_* makers do not check)."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the {what} was refused: {error.strip()}")
    return grammar


class FormError(ValueError):
    """A request's output form that cannot be served; `param` names its field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# vLLM's structured output: `structured_outputs` {kind: value}, and the guided_<kind> fields its
# versions before 0.12 read (clients written for them still send them)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def request_grammar(body) -> tuple[Optional[str], Optional[str]]:
    """(the field that asks, its llguidance grammar) for the one output form a request asks for:
    OpenAI's response_format, vLLM's structured_outputs (json, regex, choice, grammar, json_object;
    whitespace_pattern between a JSON schema's tokens) or its older guided_json / guided_regex /
    guided_choice / guided_grammar; (None, None) for free text. FormError (the server's 400) names the
    field that is wrong, or the two that each ask for a form."""
    asked, spacing = [], body.get("guided_whitespace_pattern")          # (field, kind, value)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        asked.append(("response_format", None, fmt))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise FormError('`structured_outputs` must be an object such as {"choice": ["yes", "no"]}',
                            param="structured_outputs")
        other = sorted(k for k, v in outputs.items()
                       if k not in STRUCTURED_KINDS + ("whitespace_pattern",) and v not in (None, False))
        if other:
            raise FormError(f"`structured_outputs.{other[0]}` is not supported by this server; it reads "
                            f"{', '.join(STRUCTURED_KINDS)} and whitespace_pattern", param="structured_outputs")
        asked += [(f"structured_outputs.{k}", k, outputs[k]) for k in STRUCTURED_KINDS
                  if outputs.get(k) not in (None, False)]
        spacing = outputs.get("whitespace_pattern", spacing)
    asked += [(f"guided_{k}", k, body[f"guided_{k}"]) for k in STRUCTURED_KINDS[:4] if body.get(f"guided_{k}") is not None]
    if len(asked) > 1:
        names = " and ".join(f"`{a[0]}`" for a in asked)
        raise FormError(f"{names} each fix the output's form; send one", param=asked[1][0])
    if not asked:
        return None, None
    name, kind, value = asked[0]
    if kind is None:
        return name, response_grammar(value)
    if spacing is not None and not isinstance(spacing, str):
        raise FormError("`whitespace_pattern` must be a regex string", param="whitespace_pattern")
    try:
        if kind in ("json", "json_object"):
            if kind == "json_object" and value is not True:
                raise ValueError("must be true")
            schema = True if kind == "json_object" else json.loads(value) if isinstance(value, str) else value
            return name, json_grammar(schema, spacing)
        return name, {"regex": regex_grammar, "choice": choice_grammar, "grammar": cfg_grammar}[kind](value)
    except ValueError as e:                                       # json.JSONDecodeError included
        raise FormError(f"`{name}`: {e}", param=name) from None


def bad_words_ids(words, tok) -> list:
    """vLLM's bad_words as token ids (SamplingParams.bad_words_ids): each word (leading blanks dropped) as
    the tokenizer encodes it, and with one space before it where that is another word's tokens of the
    same length (the word met mid-text)."""
    if not words:
        return []
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise FormError("`bad_words` must be a list of words, each with some non-blank character", param="bad_words")
    out = []
    for word in words:
        plain, spaced = tok.encode(word.lstrip()), tok.encode(" " + word.lstrip())
        out += [plain] + ([spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [])
    return out


def response_grammar(fmt) -> Optional[str]:
    """The grammar of OpenAI's `response_format`: None for text; JSON for {"type": "json_object"} (any
    object) and {"type": "json_schema", "json_schema": {"schema": {...}}} (that schema)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None      # not an object: the error below
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return json_grammar(True)
        spec = fmt.get("json_schema") if kind == "json_schema" else None
        if isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
            return json_grammar(spec.get("schema", {}))
    except ValueError as e:
        raise FormError(f"`response_format`: {e}", param="response_format") from None
    raise FormError('`response_format` must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                    '"json_schema": {"name": ..., "schema": {...}}}', param="response_format")


class _ByteTokens:
    """meshlab's ByteTokenizer as llguidance's TokenizerWrapper reads a tokenizer: every id's bytes,
    the end-of-document id, and encode."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id, self.bos_token_id = tok.eod_id, None
        self.tokens = [bytes([i]) if i < 256 else f"<|{i}|>".encode() for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def matcher_tokenizer(tok, vocab_size: int):
    """llguidance's view of a serving tokenizer (meshlab.infer.loading's HFTokenizer or the byte
    tokenizer) over the model's vocab_size ids; ~1 s for a 128k vocabulary, built once per engine."""
    llg = _llguidance()
    stops = list(getattr(tok, "stop_token_ids", None) or [])
    if hasattr(tok, "tk"):                            # tokenizer.json through the tokenizers library
        return llg.LLTokenizer(tok.tk.to_str(), n_vocab=vocab_size, eos_token=stops or None)
    if getattr(tok, "eod_id", None) is not None:
        return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(tok, vocab_size)), n_vocab=vocab_size)
    raise ValueError(f"structured output cannot read a {type(tok).__name__}'s tokens")


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's allowed-token bitmask."""
    return (vocab_size + 31) // 32


def _bits(words: np.ndarray, ids, value: bool) -> None:
    """Set (value) or clear the bits of token ids in a mask row of int32 words (bit t % 32 of word t // 32)."""
    ids = np.asarray(ids, np.int64)
    if not ids.size:
        return
    bit = (np.uint32(1) << (ids % 32).astype(np.uint32))
    view = words.view(np.uint32)
    if value:
        np.bitwise_or.at(view, ids // 32, bit)
    else:
        np.bitwise_and.at(view, ids // 32, ~bit)


class TokenRules:
    """vLLM's allowed_token_ids and bad_words of one request, as masks: `base` allows the listed ids (all
    when none are listed) less the one-token bad words; a longer bad word bans its last token while the
    output ends with the tokens before it (vLLM checks the output only, not the prompt)."""
    __slots__ = ("base", "after", "lengths")

    def __init__(self, vocab_size: int, allowed=None, bad_words=()):
        self.base = np.full(mask_words(vocab_size), 0 if allowed is not None else -1, np.int32)
        if allowed is not None:
            _bits(self.base, list(allowed), True)
        _bits(self.base, [w[0] for w in bad_words if len(w) == 1], False)
        self.after: dict = {}                            # tokens before a bad word's last -> the last ones
        for w in bad_words:
            if len(w) > 1:
                self.after.setdefault(tuple(w[:-1]), []).append(w[-1])
        self.lengths = sorted({len(k) for k in self.after})

    @classmethod
    def of(cls, params, vocab_size: int) -> Optional["TokenRules"]:
        if params.allowed_token_ids is None and not params.bad_words_ids:
            return None
        return cls(vocab_size, params.allowed_token_ids, params.bad_words_ids)

    def restrict(self, out: np.ndarray, tail) -> None:
        """out [mask_words(V)] &= the rules after output tokens ending with `tail`. A rule that would leave
        nothing to sample is not applied: a grammar's next tokens none of allowed_token_ids (the grammar
        wins), or the allowed tokens all banned here."""
        narrowed = out & self.base
        if narrowed.any():
            out[:] = narrowed
        for n in self.lengths:
            last = self.after.get(tuple(tail)[-n:]) if len(tail) >= n else None
            if last:
                kept = out.copy()
                _bits(out, last, False)
                if not out.any():
                    out[:] = kept


class Guide:
    """One request's allowed tokens: its grammar's matcher (llguidance), its TokenRules, or both; the
    mask now, and the tokens sampled under it. per_step: the mask may change with each token (a
    grammar, or a bad word of several tokens), so its row needs its last token on the host."""
    __slots__ = ("matcher", "rules", "tail", "fed", "written")

    def __init__(self, matcher=None, rules: Optional[TokenRules] = None):
        self.matcher, self.rules = matcher, rules
        self.tail = collections.deque(maxlen=rules.lengths[-1]) if rules is not None and rules.lengths else None
        self.fed = 0                   # output tokens consumed
        self.written = None            # the version of its mask last written to the engine's MASK entry

    @property
    def per_step(self) -> bool:
        return self.matcher is not None or self.tail is not None

    @property
    def version(self) -> int:
        """What the mask follows from: the tokens consumed, or nothing (a fixed mask)."""
        return self.fed if self.per_step else 0

    def mask(self, out: np.ndarray) -> None:
        """Write the allowed tokens into out [mask_words(V)] int32 (bit t % 32 of word t // 32)."""
        if self.matcher is not None:
            self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        else:
            out[:] = -1
        self.restrict(out)

    def restrict(self, out: np.ndarray) -> None:
        """The rules' bans applied to a grammar's mask already in out."""
        if self.rules is not None:
            self.rules.restrict(out, self.tail or ())

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; True when the grammar is complete (nothing may follow)."""
        stopped = False
        if self.matcher is not None:
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"token {token} was sampled outside the grammar: {self.matcher.get_error()}")
            stopped = self.matcher.is_stopped()
        if self.tail is not None:
            self.tail.append(token)
        self.fed += 1
        return stopped


class Grammars:
    """A serving tokenizer's matchers: `guide(grammar)` makes a request's Guide; the tokenizer view
    (matcher_tokenizer) is built at the first one."""

    def __init__(self, tok, vocab_size: int):
        self.tok, self.vocab_size, self._tokenizer = tok, vocab_size, None

    def guide(self, grammar: str, rules: Optional[TokenRules] = None) -> Guide:
        if self._tokenizer is None:
            self._tokenizer = matcher_tokenizer(self.tok, self.vocab_size)
        matcher = _llguidance().LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar was refused: {matcher.get_error()}")
        return Guide(matcher, rules)


class Guided:
    """Engine's token masks (a mixin, as meshlab.infer.scoring's Scoring is): each masked row's MASK entry
    kept equal to its Guide's next allowed tokens, and the step rules the per-step ones need. The engine
    holds `masked` (requests with a Guide, queued or running), `guided` (those whose mask is per_step),
    and per slot the Guide whose mask its MASK row holds (`slot_guide`; None: every token)."""

    def _guide_of(self, params) -> Optional[Guide]:
        """A request's Guide from its grammar and token rules, or None (any thread, at add_request)."""
        rules = TokenRules.of(params, self.md.cfg.vocab_size)
        if params.grammar is None:
            return None if rules is None else Guide(None, rules)
        if self.grammars is None:
            raise AdmissionError("a grammar needs the engine's tokenizer: set engine.grammars = "
                                 "meshlab.infer.guided.Grammars(tokenizer, vocab_size)")
        return self.grammars.guide(params.grammar, rules)

    def _hold_mask(self, req) -> None:
        """Count a request queued with a Guide among the masked (and the per-step) ones."""
        if req.guide is not None:
            self.masked.add(req)
            if req.guide.per_step:
                self.guided.add(req)
            if req.guide.matcher is not None:
                self.stats["guided_requests"] += 1

    def _guides_running(self) -> bool:
        """Whether a running request's mask follows its tokens: decode calls then run one step and do not
        chain, so that such a row whose last token is read back joins the next call."""
        return any(r.slot >= 0 for r in self.guided)

    def _refresh_masks(self) -> None:
        """Write each running masked row's allowed tokens into its slot's MASK row where its matcher moved
        (or the request moved slot) since the last write, and all bits into the rows of slots a masked
        request left: the grammars' masks computed in parallel (llguidance's executor), the token rules
        applied over them, one device call for all. Nothing to do, and no row looked at, while no request
        has a mask and no slot holds one."""
        if not self.masked and not any(self.slot_guide):
            return
        # a row is rewritten unless it holds this guide's mask at its version: a preempted request may come
        # back to a slot that another's mask (or all bits) took meanwhile
        rows = [r for r in self.sched.running() if self.slot_guide[r.slot] is not r.guide
                or (r.guide is not None and r.guide.written != r.guide.version)]
        if not rows:
            return
        b = next(x for x in self.DECODE if x >= len(rows))
        slots = np.full(b, self.sched.max_seqs, np.int32)                 # padding rows: dropped
        masks = np.full((b, self._mask_width), -1, np.int32)               # [b, V / 32]; free rows: every token
        guided = [(r.guide.matcher, i) for i, r in enumerate(rows) if r.guide is not None and r.guide.matcher is not None]
        if guided:
            if self._mask_executor is None:
                self._mask_executor = _llguidance().LLExecutor()
            self._mask_executor.unsafe_compute_mask_ptr(guided, masks.ctypes.data, masks.strides[0], b)
        for i, r in enumerate(rows):
            slots[i] = r.slot
            self.slot_guide[r.slot] = r.guide
            if r.guide is not None:
                r.guide.restrict(masks[i])
                r.guide.written = r.guide.version
        self.cache[MASK] = self._set_rows(self.cache[MASK], slots, masks)
