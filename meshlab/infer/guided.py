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
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np

from meshlab.infer.programs import MASK

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


def response_grammar(fmt) -> Optional[str]:
    """The grammar of OpenAI's `response_format`: None for text; JSON for {"type": "json_object"} (any
    object) and {"type": "json_schema", "json_schema": {"schema": {...}}} (that schema)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    try:
        if kind == "json_object":
            return json_grammar(True)
        spec = fmt.get("json_schema")
        if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
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


class Guide:
    """One request's matcher: its allowed-token mask now, and the tokens sampled under it."""
    __slots__ = ("matcher", "fed", "written")

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"the grammar was refused: {self.matcher.get_error()}")
        self.fed = 0                   # output tokens consumed
        self.written = None            # (slot, fed) of the mask in the engine's MASK entry

    def mask(self, out: np.ndarray) -> None:
        """Write the allowed tokens into out [mask_words(V)] int32 (bit t % 32 of word t // 32)."""
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; True when the grammar is complete (nothing may follow)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"token {token} was sampled outside the grammar: {self.matcher.get_error()}")
        self.fed += 1
        return self.matcher.is_stopped()


class Grammars:
    """A serving tokenizer's matchers: `guide(grammar)` makes a request's Guide; the tokenizer view
    (matcher_tokenizer) is built at the first one."""

    def __init__(self, tok, vocab_size: int):
        self.tok, self.vocab_size, self._tokenizer = tok, vocab_size, None

    def guide(self, grammar: str) -> Guide:
        if self._tokenizer is None:
            self._tokenizer = matcher_tokenizer(self.tok, self.vocab_size)
        return Guide(self._tokenizer, grammar)


class Guided:
    """Engine's grammar masks (a mixin, as meshlab.infer.scoring's Scoring is): each guided row's MASK
    entry kept equal to its matcher's next allowed tokens, and the step rules those rows need."""

    def _guides_running(self) -> bool:
        """Whether a running request is held to a grammar: decode calls then run one step and do not
        chain, so that a guided row whose last token is read back joins the next call."""
        return any(r.slot >= 0 for r in self.guided)

    def _refresh_masks(self) -> None:
        """Write each running guided row's allowed tokens into its slot's MASK row where its matcher moved
        (or the request moved slot) since the last write, and all bits into the rows of slots a guided
        request left: the masks computed in parallel (llguidance's executor), one device call for all.
        Nothing to do, and no row looked at, while no request is held to a grammar and no slot holds a mask."""
        if not self.guided and not self.slot_guided.any():
            return
        rows = [r for r in self.sched.running() if (r.guide is None and self.slot_guided[r.slot])
                or (r.guide is not None and r.guide.written != (r.slot, r.guide.fed))]
        if not rows:
            return
        b = next(x for x in self.DECODE if x >= len(rows))
        slots = np.full(b, self.sched.max_seqs, np.int32)                 # padding rows: dropped
        masks = np.full((b, self._mask_width), -1, np.int32)               # [b, V / 32]; free rows: every token
        guided = [(r.guide.matcher, i) for i, r in enumerate(rows) if r.guide is not None]
        if guided:
            if self._mask_executor is None:
                self._mask_executor = _llguidance().LLExecutor()
            self._mask_executor.unsafe_compute_mask_ptr(guided, masks.ctypes.data, masks.strides[0], b)
        for i, r in enumerate(rows):
            slots[i] = r.slot
            self.slot_guided[r.slot] = r.guide is not None
            if r.guide is not None:
                r.guide.written = (r.slot, r.guide.fed)
        self.cache[MASK] = self._set_rows(self.cache[MASK], slots, masks)
