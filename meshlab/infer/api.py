"""The OpenAI request schemas the server speaks: parsing and validating a body into engine requests
(the answers' text, usage and logprobs objects are meshlab/infer/api_responses.py's).

No I/O here (meshlab/infer/server.py does the HTTP). Every bad field is a BadRequest naming it.
Behaviour follows OpenAI's API reference where meshlab can honour it, with vLLM's extras (top_k,
min_p, repetition_penalty, ignore_eos, stop_token_ids, include_stop_str_in_output, min_tokens,
return_tokens_as_token_ids, truncate_prompt_tokens, skip_special_tokens, prompt_logprobs,
allowed_token_ids, bad_words), and refuses what would change the answer and is not implemented
(`UNSUPPORTED`: best_of, suffix, logits_processors, prompt_embeds, the deprecated functions) with a
400 that says so, rather than ignoring it; use_beam_search (width n) runs meshlab.infer.beam_call. Chat
requests take vLLM's add_generation_prompt, continue_final_message (a reply prefilled by its last
assistant message; echo: the reply begins with it), chat_template_kwargs (variables for the
template) and, from a server that trusts them, a request's own chat_template. `response_format`
json_object / json_schema holds the output to JSON, and vLLM's `structured_outputs` (or its older
guided_* fields) to a JSON schema, a regex, a list of choices or a grammar (meshlab.infer.guided);
chat `tools` with tool_choice "required" or a named function make the reply a tool call, and with
"auto" (the default) calls are read back out of the model's reply (meshlab.infer.tools).

A field this server does not know is ignored, as vLLM ignores it (OpenAI refuses it), so a client that
sends a newer field still gets its answer; a known field of the wrong type is a 400, also one that
does not change the answer (`user`, `parallel_tool_calls`).
"""
from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any, Optional

from meshlab.infer.api_responses import ToolCallParams
from meshlab.infer.sampler import SEED_RANGE, SamplingError, SamplingParams

MAX_TOP_LOGPROBS = 20          # OpenAI's chat limit (completions: 5); vLLM allows 20 for both
DEFAULT_TEMPERATURE = 1.0      # OpenAI's, for a request that names none (its clients send none unless set)


class BadRequest(Exception):
    """An error answer: its HTTP status, and OpenAI's error fields `param` (the request field at fault)
    and `code` (a machine-readable reason, as OpenAI's "context_length_exceeded"; mostly None)."""

    def __init__(self, message, status=400, param=None, retry_after=None, code=None):
        super().__init__(message)
        self.status, self.param, self.retry_after, self.code = status, param, retry_after, code


@dataclasses.dataclass
class Plan:
    """One HTTP request as the engine sees it: its prompts, and one SamplingParams per copy of each.
    Choice i answers prompt i // n (OpenAI's order: a prompt's n choices together)."""
    prompts: list                      # token ids per prompt (a chat request, or most completions: one)
    prompt_texts: list                 # what echo shows ("" for token ids without echo: never decoded then); chat: the prompts
    params: list                       # [SamplingParams] * n (seeds seed + i, modulo 2**31)
    chat: bool
    stream: bool
    echo: bool = False
    logprobs: Optional[int] = None     # top alternatives per token; None: no logprobs
    include_usage: bool = False
    continuous_usage: bool = False     # stream_options.continuous_usage_stats (vLLM's): usage in every chunk
    generate: bool = True              # False: max_tokens=0 with echo (the prompt back, nothing generated)
    prompt_logprobs: Optional[int] = None   # echo with logprobs: the prompt's tokens' logprobs too
    prompt_scores: Optional[int] = None     # vLLM's prompt_logprobs: a prompt_logprobs list beside the choices
    tool_call: bool = False            # each reply is held to a tool call (sent whole when it ends)
    # tool_choice named the function: OpenAI and vLLM finish its call "stop", keeping "tool_calls" for calls
    # the model chose to make ("auto", "required")
    named_call: bool = False
    tool_format: Optional[Any] = None  # the tools.ToolFormat a reply's calls are read back in (auto or a held call)
    tool_names: frozenset = frozenset()   # ... and the functions offered
    token_ids: bool = False            # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    beam: Optional[float] = None       # vLLM's use_beam_search (width n): its length_penalty; None: sampled choices
    reply_prefix: str = ""             # vLLM's chat echo: what each reply begins with (the last message's content)
    one_call: bool = False             # parallel_tool_calls false: a reply's first tool call only

    @property
    def submits(self) -> bool:
        """Whether the engine runs it: to generate, or (max_tokens=0) only to score the prompt."""
        return self.generate or self.prompt_logprobs is not None or self.prompt_scores is not None

    @property
    def special_tokens(self) -> bool:
        """vLLM's skip_special_tokens false: texts and logprobs show the special tokens."""
        return not self.params[0].skip_special_tokens

    @property
    def choices(self) -> int:
        return len(self.prompts) * len(self.params)


def body_field(body, name, typ, default=None, lo=None, hi=None):
    """body[name] as typ (default when absent or null), within [lo, hi]; else a BadRequest naming it."""
    v = body.get(name)
    if v is None:
        return default
    kind = {int: "an integer", bool: "true or false", float: "a number", str: "a string"}[typ]
    ok = isinstance(v, bool) if typ is bool else (not isinstance(v, bool) and isinstance(
        v, (int, float) if typ is float else typ))
    if not ok or (lo is not None and not v >= lo) or (hi is not None and not v <= hi):    # NaN is out too
        rng = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else "")
        raise BadRequest(f"`{name}` must be {kind}{rng}, got {v!r}", param=name)
    return v


# Fields that would change the answer and that this server does not implement: OpenAI's, and vLLM's
# extras that its clients send (a server that ignored them would answer another question). Each:
# (whether the value asks for something, what to send instead).
UNSUPPORTED = {
    "best_of": (lambda v, b: v != b.get("n", 1), "leave it out"),
    "suffix": (lambda v, b: bool(v), "leave it out"),
    "logits_processors": (lambda v, b: bool(v), "leave it out"),
    "prompt_embeds": (lambda v, b: v is not None, "send the prompt's tokens or text"),
    "functions": (lambda v, b: bool(v), "send `tools` (OpenAI's replacement for functions)"),
    "function_call": (lambda v, b: v is not None, "send `tool_choice` (OpenAI's replacement for function_call)"),
}


def chat_messages(messages) -> list:
    """Messages as [{role, content: str}]; content given as text parts is joined. A tool's result
    (role "tool") keeps its tool_call_id, and an assistant's tool calls (content then may be null)
    their tool_calls, for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if content is None and isinstance(calls, list) and calls:
            content = ""
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool") \
                or not isinstance(content, str):
            raise BadRequest(f"messages[{i}] must be {{\"role\": system|developer|user|assistant|tool, \"content\": "
                             "string or text parts}", param="messages")
        extra = {k: m[k] for k in ("tool_call_id", "tool_calls", "name") if m.get(k) is not None}
        out.append({"role": m["role"], "content": content, **extra})
    return out


def plain_chat_prompt(messages: list, tools: Optional[list] = None, add_generation_prompt: bool = True,
                      continue_final_message: bool = False) -> str:
    """The format for tokenizers without a chat template: 'role: content' lines (an assistant's tool
    calls as their JSON; the tools first, as one line), then 'assistant:' (not with
    add_generation_prompt False, nor with continue_final_message: the last line is continued)."""
    from meshlab.infer.tools import plain_tools_line
    lines = [plain_tools_line(tools)] if tools else []
    lines += [f"{m['role']}: {json.dumps(m['tool_calls']) if m.get('tool_calls') else m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt and not continue_final_message else "")


def parse(body, chat: bool, tok, model_name: str, max_len: int, stop_ids, max_n: int, tool_format=None,
          trust_templates: bool = False, vocab_size: Optional[int] = None) -> Plan:
    """Validate a request body into a Plan (raises BadRequest). tool_format: the tools.ToolFormat of
    tool_choice "auto" (None: the one the tokenizer's chat template writes); trust_templates: a chat
    request's own `chat_template` formats its messages (else it is a 400); vocab_size: the model's, which
    token ids (the prompt's, logit_bias's, stop_token_ids', allowed_token_ids') must lie below."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if not isinstance(body.get("model", ""), (str, type(None))):
        raise BadRequest(f"`model` must be a string (this server serves {model_name!r})", param="model")
    if body.get("model") not in (None, model_name):
        raise BadRequest(f"unknown model {body.get('model')!r}; this server serves {model_name!r}",
                         status=404, param="model", code="model_not_found")
    for name, (used, instead) in UNSUPPORTED.items():
        if body.get(name) is not None and used(body[name], body):
            raise BadRequest(f"`{name}` is not supported by this server; {instead}", param=name)
    if not chat and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise BadRequest("`tools` belong to /v1/chat/completions", param="tools")
    texts, prompts, choice, last = (_chat_prompt(body, tok, trust_templates) if chat
                                    else (*_completion_prompts(body.get("prompt"), tok), None, ""))
    if not all(prompts):
        raise BadRequest("the prompt encodes to no tokens; send some text", param="prompt")
    if vocab_size is not None and any(min(p) < 0 or max(p) >= vocab_size for p in prompts):
        raise BadRequest(f"prompt token ids must lie in [0, {vocab_size}) (this model's vocabulary)",
                         param="messages" if chat else "prompt")
    body_field(body, "user", str)              # OpenAI's end-user id: checked, not used
    one_call = not body_field(body, "parallel_tool_calls", bool, True)
    n = body_field(body, "n", int, 1, 1, max_n)
    stream = body_field(body, "stream", bool, False)
    echo = body_field(body, "echo", bool, False)
    limit = _max_tokens(body, chat, echo)
    keep = body_field(body, "truncate_prompt_tokens", int, None, -1)       # vLLM's: the last k tokens
    if keep == 0:
        raise BadRequest("`truncate_prompt_tokens` must be >= 1 (the prompt's last tokens kept), or -1 (as many as "
                         "the context holds beside max_tokens)", param="truncate_prompt_tokens")
    if keep is not None:
        # -1: the context less max_tokens, so the reply fits (a chat request without max_tokens, whose default is
        # the rest of the context, keeps all but one position); vLLM keeps the whole context, leaving no room
        keep = max(max_len - (1 if limit is None else limit), 1) if keep == -1 else keep
        texts = [t if len(p) <= keep else None for t, p in zip(texts, prompts)]   # a cut prompt's echo: its ids decoded
        prompts = [p[-keep:] for p in prompts]
    skip = body_field(body, "skip_special_tokens", bool, True)
    # token ids are decoded only for echo (~0.1 ms per 1k ids)
    decode = tok.decode if skip else (lambda ids: tok.decode(ids, skip_special_tokens=False))
    texts = [(decode(p) if echo else "") if t is None else t for t, p in zip(texts, prompts)]
    if chat and echo and choice is not None:
        raise BadRequest("`echo` with `tools`: send one of them", param="echo")
    logprobs, max_tokens = _logprobs_and_length(body, chat, limit, max(map(len, prompts)), max_len)
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and stream):
        raise BadRequest("`stream_options` must be an object and needs `stream: true`", param="stream_options")
    opts = opts or {}
    for key in ("include_usage", "continuous_usage_stats"):
        if not isinstance(opts.get(key, False), bool):
            raise BadRequest(f"`stream_options.{key}` must be true or false", param="stream_options")
    prompt_logprobs = logprobs if echo and not chat else None
    scores = body_field(body, "prompt_logprobs", int, None, 0, MAX_TOP_LOGPROBS)    # vLLM's
    if scores is not None and stream:
        raise BadRequest("`prompt_logprobs` are not available with `stream: true` (as in vLLM); send them unstreamed",
                         param="prompt_logprobs")
    token_ids = body_field(body, "return_tokens_as_token_ids", bool, False)
    tool_call = choice is not None and choice.call is not None
    if choice is not None and choice.auto and tool_format is None:
        from meshlab.infer.tools import tool_format as format_named
        tool_format = format_named("auto", getattr(tok, "chat_template", None))
    elif tool_call:                            # the grammar's JSON call, read back as bare JSON
        from meshlab.infer.tools import TOOL_FORMATS
        tool_format = TOOL_FORMATS["json"]
    from meshlab.infer.guided import FormError, bad_words_ids, request_grammar
    try:
        asked, grammar = request_grammar(body)
        bad_words = bad_words_ids(body.get("bad_words"), tok)
    except FormError as e:
        raise BadRequest(str(e), param=e.param) from None
    if tool_call and asked:
        raise BadRequest(f"`{asked}` and a required tool call both fix the reply's form; send one", param=asked)
    scored = max((k for k in (prompt_logprobs, scores) if k is not None), default=None)
    beamed = body_field(body, "use_beam_search", bool, False)
    params = _sampling(body, n, max(max_tokens, 1), logprobs, stop_ids, scored, choice.grammar() if tool_call else grammar,
                       ranks=scores is not None, bad_words=bad_words, beamed=beamed, vocab_size=vocab_size,
                       kind=ToolCallParams if tool_call else SamplingParams)
    beam = None                                # vLLM's use_beam_search: its length_penalty (meshlab.infer.beam)
    if beamed:
        from meshlab.infer.beam import BeamError, check_beam
        try:
            check_beam(params[0], n, stream or max_tokens == 0 or (choice is not None and choice.auto))
        except BeamError as e:
            raise BadRequest(str(e), param=e.param) from None
        beam = body_field(body, "length_penalty", float, 1.0)
    return Plan(prompts, texts, params, chat, stream, echo, logprobs, opts.get("include_usage", False),
                opts.get("continuous_usage_stats", False), generate=max_tokens > 0, prompt_logprobs=prompt_logprobs,
                tool_call=tool_call, named_call=tool_call and isinstance(body.get("tool_choice"), dict),
                tool_format=tool_format if tool_call or (choice is not None and choice.auto) else None,
                tool_names=frozenset(choice.names) if choice is not None else frozenset(), token_ids=token_ids,
                prompt_scores=scores, beam=beam, reply_prefix=last if echo else "", one_call=one_call)


def _chat_prompt(body, tok, trust_templates: bool = False):
    """([text], [ids], tools.ToolChoice or None, what vLLM's chat echo puts before the reply): the
    messages (and tools) through the request's own chat_template (trust_templates), else the
    tokenizer's, else the plain format. The echo is the last message's content when that message is
    in the reply's role: an assistant's, or any without add_generation_prompt (the reply continues it)."""
    from meshlab.infer.tools import ToolError, parse_tools
    messages = chat_messages(body.get("messages"))
    try:
        choice = parse_tools(body.get("tools"), body.get("tool_choice"))
    except ToolError as e:
        raise BadRequest(str(e), param=e.param) from None
    tools = choice.tools if choice else None
    # vLLM's prefill of the assistant's reply: continue_final_message (with add_generation_prompt false)
    cont = body_field(body, "continue_final_message", bool, False)
    gen = body_field(body, "add_generation_prompt", bool, not cont)
    if cont and gen:
        raise BadRequest("`continue_final_message` continues the last message, `add_generation_prompt` opens a new "
                         "one: set add_generation_prompt to false", param="add_generation_prompt")
    template, extra = _template(body, tok, trust_templates), body.get("chat_template_kwargs")
    if extra is not None and not (isinstance(extra, dict) and all(isinstance(k, str) for k in extra)):
        raise BadRequest("`chat_template_kwargs` must be an object of template variables", param="chat_template_kwargs")
    if extra and template is None:
        raise BadRequest("`chat_template_kwargs`: this checkpoint has no chat template to pass them to (its prompts "
                         "are 'role: content' lines); leave them out", param="chat_template_kwargs")
    taken = sorted(set(extra) & template.variables) if extra else []
    if taken:
        raise BadRequest(f"`chat_template_kwargs` may not set {taken}: the messages, tools and the tokenizer's own",
                         param="chat_template_kwargs")
    try:
        text = template(messages, tools, gen, cont, extra) if template else plain_chat_prompt(messages, tools, gen, cont)
    except ValueError as e:          # the template raised: its own words, on the template a request sent
        raise BadRequest(str(e), param="messages" if body.get("chat_template") is None else "chat_template") from None
    last = messages[-1]
    echo = (last.get("content") or "") if not gen or last["role"] == "assistant" else ""
    return [text], [tok.encode(text)], choice, echo


def _template(body, tok, trust: bool):
    """The ChatTemplate that formats a chat request: its own `chat_template` (vLLM's; Jinja run in the
    same sandbox as the checkpoint's, compiled once per source), else the tokenizer's, else None."""
    own, theirs = getattr(tok, "chat_template", None), body.get("chat_template")
    if theirs is None:
        return own
    if not isinstance(theirs, str) or not theirs.strip():
        raise BadRequest("`chat_template` must be a Jinja template string", param="chat_template")
    if not trust:
        raise BadRequest("`chat_template`: this server formats messages with the checkpoint's own template; start "
                         "it with --trust-request-chat-template to take a request's", param="chat_template")
    from meshlab.infer.loading import request_template
    try:
        return request_template(theirs, tuple(sorted(own.special.items())) if own is not None else ())
    except ValueError as e:
        raise BadRequest(f"`chat_template`: {e}", param="chat_template") from None


def _max_tokens(body, chat: bool, echo: bool) -> Optional[int]:
    """The request's max_tokens with OpenAI's bounds: completions default to 16 (0 only with echo); None
    for a chat request without one (its default, the rest of the context, depends on the prompt)."""
    if chat:                                   # OpenAI's max_tokens is deprecated for max_completion_tokens: it wins
        max_tokens = body_field(body, "max_tokens", int, None, 1)
        return body_field(body, "max_completion_tokens", int, max_tokens, 1)
    max_tokens = body_field(body, "max_tokens", int, 16, 0)
    if max_tokens == 0 and not echo:
        raise BadRequest("`max_tokens` must be >= 1 (0 is meant with `echo`: the prompt back)", param="max_tokens")
    return max_tokens


def _logprobs_and_length(body, chat: bool, max_tokens: Optional[int], prompt_len: int, max_len: int):
    """(top logprobs per token or None, max_tokens: chat's default the rest of the context), checked
    against the context."""
    if chat:
        want = body_field(body, "logprobs", bool, False)
        top = body_field(body, "top_logprobs", int, None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        logprobs = (top or 0) if want else None
        if max_tokens is None:                 # chat default: the rest of the context
            max_tokens = max(max_len - prompt_len, 1)
    else:
        logprobs = body_field(body, "logprobs", int, None, 0, MAX_TOP_LOGPROBS)
    if prompt_len + min(max_tokens, 1) > max_len:   # no max_tokens fits it: the prompt is at fault, as OpenAI names it
        room = " (the prompt and at least one generated token)" if max_tokens else ""
        raise BadRequest(f"the prompt is {prompt_len} tokens, the context holds {max_len}{room}; shorten the prompt",
                         param="messages" if chat else "prompt", code="context_length_exceeded")
    if prompt_len + max_tokens > max_len:
        raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens={max_tokens} exceeds the context of "
                         f"{max_len}; shorten the prompt or lower max_tokens", param="max_tokens",
                         code="context_length_exceeded")
    return logprobs, max_tokens


# The request field of a SamplingParams field that the request names otherwise; `grammar` is the server's
# (from response_format, structured_outputs or tools), whose own checks come first
_REQUEST_FIELD = {"bad_words_ids": "bad_words", "grammar": None}


def _sampling(body, n: int, max_tokens: int, logprobs, stop_ids, prompt_logprobs=None, grammar=None,
              ranks: bool = False, bad_words=(), beamed: bool = False, vocab_size: Optional[int] = None,
              kind: type = SamplingParams) -> list:
    """One `kind` (SamplingParams) per choice: the same settings, seeds seed + i (modulo 2**31); the first scores the
    prompt when prompt_logprobs is set (every choice shares its prompt), with each token's rank if ranks;
    checked against vocab_size when given."""
    allowed = body.get("allowed_token_ids")
    if allowed is not None and not (isinstance(allowed, list) and allowed and all(type(t) is int for t in allowed)):
        raise BadRequest("`allowed_token_ids` must be a non-empty list of token ids", param="allowed_token_ids")
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
        raise BadRequest("`stop` must be a non-empty string or a list of them", param="stop")
    # OpenAI takes any int64 seed; the engine's are int32: folded modulo, so a seed keeps its answer (and one
    # already in range is itself), and choice i's seed is the same whatever n
    seed = body_field(body, "seed", int, None, -2 ** 63, 2 ** 63 - 1)
    if seed is None:                    # unseeded requests draw apart, as OpenAI's do
        seed = secrets.randbelow(SEED_RANGE)
    # beam search ranks by the raw logprobs: it has no temperature to default to
    # top_k: vLLM's "off" is 0 or -1 (its older default, which its clients still send)
    kw = {"temperature": body_field(body, "temperature", float, 0.0 if beamed else DEFAULT_TEMPERATURE, 0.0, 2.0),
          "top_p": body_field(body, "top_p", float, 1.0),
          "top_k": max(body_field(body, "top_k", int, 0, -1), 0), "min_p": body_field(body, "min_p", float, 0.0, 0.0, 1.0),
          "repetition_penalty": body_field(body, "repetition_penalty", float, 1.0),
          "include_stop_str_in_output": body_field(body, "include_stop_str_in_output", bool, False),
          "skip_special_tokens": body_field(body, "skip_special_tokens", bool, True),
          "min_tokens": body_field(body, "min_tokens", int, 0, 0),
          "presence_penalty": body_field(body, "presence_penalty", float, 0.0, -2.0, 2.0),
          "frequency_penalty": body_field(body, "frequency_penalty", float, 0.0, -2.0, 2.0)}
    kw["logit_bias"] = _logit_bias(body.get("logit_bias"))
    kw["grammar"] = grammar
    kw["allowed_token_ids"], kw["bad_words_ids"] = allowed, bad_words
    extra = body.get("stop_token_ids") or []            # vLLM's: more stop tokens; ignore_eos: not the model's own
    if not isinstance(extra, list) or any(type(t) is not int for t in extra):
        raise BadRequest("`stop_token_ids` must be a list of token ids", param="stop_token_ids")
    stop_ids = tuple(extra) + (() if body_field(body, "ignore_eos", bool, False) else tuple(stop_ids))
    try:
        return [kind(max_tokens=max_tokens, seed=(seed + i) % SEED_RANGE, stop=tuple(stop), stop_token_ids=stop_ids,
                     logprobs=logprobs, prompt_logprobs=None if i else prompt_logprobs,
                     prompt_ranks=ranks and not i, **kw).validate(vocab_size)
                for i in range(n)]
    except SamplingError as e:
        raise BadRequest(str(e), param=_REQUEST_FIELD.get(e.param, e.param)) from None


def _logit_bias(bias) -> dict:
    """OpenAI's logit_bias, {"token id": bias}, as {int: float} (SamplingParams checks ids and ranges)."""
    if bias is None:
        return {}
    if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
        raise BadRequest('`logit_bias` must map token ids (as strings, e.g. {"50256": -100}) to biases',
                         param="logit_bias")
    return {int(k): v for k, v in bias.items()}


def _completion_prompts(prompt, tok):
    """([text], [ids]) of a completions prompt: a string or a list of token ids (text None), or a
    list of those (several prompts: what evaluation harnesses batch into one request)."""
    def one(p):
        if isinstance(p, str) and p:
            return p, tok.encode(p)
        if isinstance(p, list) and p and all(type(t) is int for t in p):     # bool is not int here
            return None, list(p)
        return None
    single = one(prompt)
    many = [single] if single else [one(p) for p in prompt] if isinstance(prompt, list) and prompt else [None]
    if None in many:
        raise BadRequest("`prompt` must be a non-empty string, a list of token ids, or a list of those",
                         param="prompt")
    texts, ids = zip(*many)
    return list(texts), list(ids)


def tokenize(body, tok, max_len: int, trust_templates: bool = False) -> dict:
    """vLLM's /tokenize: a completions `prompt` (a string) or chat `messages` (through the chat template,
    as /v1/chat/completions formats them) -> {"tokens", "count", "max_model_len"}: what a client needs to
    fit a prompt and max_tokens in the context before it sends them."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise BadRequest("send {\"prompt\": text} or {\"messages\": [...]}", param="prompt")
    if "messages" in body:
        ids = _chat_prompt(body, tok, trust_templates)[1][0]
    elif isinstance(body["prompt"], str):
        ids = tok.encode(body["prompt"])
    else:
        raise BadRequest("`prompt` must be a string", param="prompt")
    return {"tokens": list(ids), "count": len(ids), "max_model_len": max_len}


def detokenize(body, tok) -> dict:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or any(type(t) is not int or not 0 <= t < tok.vocab_size for t in ids):
        raise BadRequest(f"`tokens` must be a list of token ids in [0, {tok.vocab_size})", param="tokens")
    return {"prompt": tok.decode(ids)}
