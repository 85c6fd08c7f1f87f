"""What `--checkpoint` may name, turned into (cfg, md, params, tokenizer) for the engines.

  random:<preset>[:<seed>]   a randomly initialised model (tests, benchmarks), byte tokenizer
  <dir with config.json>     a Hugging Face checkpoint (meshlab.infer.hf); tokenizer.json if present
  <training run dir>         a meshlab run (config.yaml + checkpoints/): the latest complete step's params

Serving places the parameters itself: on one device by default, or by a serving rule file on a
mesh of the devices present (`serving_placement`); never on the training run's mesh, which the
serving machine may not have. A run is read, not rebuilt: the model config from its config.yaml,
the parameters (not the optimizer state) from its checkpoint, the tokenizer from the files
training wrote beside them (`meshlab.checkpoint.write_run_tokenizer`). Nothing is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

import models
from meshlab.compat import count_arg, cpu_devices_arg
from meshlab.infer.hf import CheckpointError, load_hf
from meshlab.tokenizer import ByteTokenizer, TokenizerJson


class HFTokenizer(TokenizerJson):
    """tokenizer.json with what the server adds: its stop tokens, each token's own bytes, and the
    directory's chat template (tokenizer_config.json or chat_template.jinja) when it has one."""

    def __init__(self, path, stop_token_ids=()):
        path = Path(path)
        super().__init__(path)
        self.stop_token_ids = list(stop_token_ids)
        self.chat_template = _chat_template(path.parent)
        # a byte-level BPE vocabulary (GPT-2's, Llama 3's, Qwen's): each token string spells its bytes
        # in GPT-2's byte-to-unicode alphabet; added tokens are their own text
        self.byte_level = _byte_level(self.tk)
        self.added = set(self.tk.get_added_tokens_decoder()) if self.byte_level else set()

    def token_bytes(self, t: int) -> bytes | None:
        """Token t's own bytes (what OpenAI's logprobs call `bytes`), read off a byte-level vocabulary,
        where a token may hold part of a UTF-8 character (its decoded text alone is then U+FFFD, whose
        bytes are not the token's); None for other vocabularies and added tokens."""
        if not self.byte_level or t in self.added:
            return None
        piece = self.tk.id_to_token(t)
        if piece is None or any(c not in _UNICODE_TO_BYTE for c in piece):
            return None
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)


def _gpt2_unicode_to_byte() -> dict:
    """GPT-2's byte-level alphabet inverted: the printable Latin-1 bytes stand for themselves, the other
    bytes for the code points from 256 up, in byte order (the `tokenizers` ByteLevel table)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(extra)}}


_UNICODE_TO_BYTE = _gpt2_unicode_to_byte()


def _byte_level(tk) -> bool:
    """Whether a `tokenizers` Tokenizer is byte-level: its decoder or pre-tokenizer is ByteLevel, alone
    or in a Sequence (their serialized state names the parts)."""
    def parts(state):
        return [state, *(p for key in ("decoders", "pretokenizers") for s in state.get(key) or [] for p in parts(s))]
    for component in (tk.decoder, tk.pre_tokenizer):
        if component is not None and any(p.get("type") == "ByteLevel"
                                         for p in parts(json.loads(component.__getstate__()))):
            return True
    return False


class ChatTemplate:
    """A Hugging Face chat template (Jinja) rendered in a sandbox, as transformers does."""

    def __init__(self, source: str, special: dict, owner: str = "the checkpoint's"):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:                       # a syntax error: ValueError, as a render's
            raise ValueError(f"{owner} chat template does not compile: {e}") from None
        self.special, self.source, self.owner = special, source, owner
        # what __call__ sets itself: a request's template variables may not replace these
        self.variables = frozenset({"messages", "tools", "add_generation_prompt", *special})

    def __call__(self, messages: list, tools: list | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, kwargs: dict | None = None) -> str:
        """The prompt text; continue_final_message: cut right after the last message's content (no
        end-of-turn after it), so the model continues that message, as transformers does. kwargs: more
        variables for the template (a request's chat_template_kwargs, e.g. enable_thinking)."""
        from jinja2.exceptions import TemplateError
        try:
            text = self.template.render({**(kwargs or {}), **self.special, "messages": messages, "tools": tools,
                                         "add_generation_prompt": add_generation_prompt and not continue_final_message})
        except TemplateError as e:
            raise ValueError(f"{self.owner} chat template refused these messages: {e}") from None
        if continue_final_message:
            final = (messages[-1].get("content") or "").strip()
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("continue_final_message: the chat template does not write the last message's "
                                 "content as sent, so there is no end of it to continue from")
            text = text[:at + len(final)]
        return text


@functools.lru_cache(maxsize=32)
def request_template(source: str, special: tuple) -> ChatTemplate:
    """A request's own chat template (vLLM's `chat_template`), with the checkpoint's special tokens
    ((name, text) pairs); compiled once per source, as clients send the same one again."""
    return ChatTemplate(source, dict(special), owner="the request's")


def _chat_template(directory: Path):
    """The ChatTemplate of a tokenizer directory, or None (the server then uses its plain format)."""
    cfg_path, jinja_path = directory / "tokenizer_config.json", directory / "chat_template.jinja"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    source = jinja_path.read_text() if jinja_path.is_file() else tcfg.get("chat_template")
    if isinstance(source, list):             # several named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    text = lambda v: v.get("content", "") if isinstance(v, dict) else (v or "")
    special = {k: text(tcfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return ChatTemplate(source, special)


def stop_token_ids(tok) -> list[int]:
    """Token ids that end a generation: the tokenizer's end-of-sequence (or end-of-document) ids."""
    ids = getattr(tok, "stop_token_ids", None)
    if ids:
        return list(ids)
    return [tok.eod_id] if getattr(tok, "eod_id", None) is not None else []


def serving_placement(rules: str | None, mesh: str | None):
    """(rules, mesh) for serving: (None, None) is one device; a rule file (and mesh spec, else the
    rule file's own) shards the weights over the devices present."""
    if rules is None and mesh is None:
        return None, None
    from meshlab.mesh import make_mesh
    from meshlab.rules import load_rules
    if rules is None:
        raise ValueError(f"--mesh {mesh} needs --rules (a rule file that says how the weights are sharded)")
    r = load_rules(rules)
    return r, make_mesh(mesh or r.mesh)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, except where its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)) or action.required:
            return text
        return super()._get_help_string(action)


def seconds_arg(low_open: bool = False, note: str = ""):
    """An argparse type: a finite number of seconds, >= 0 (> 0 when low_open)."""
    def parse(text: str) -> float:
        x = float(text)
        if not math.isfinite(x) or x < 0 or (low_open and x == 0):
            raise argparse.ArgumentTypeError(f"{text} must be a number of seconds {'> 0' if low_open else '>= 0'}{note}")
        return x
    parse.__name__ = "float"
    return parse


def add_checkpoint_args(ap) -> None:
    """The arguments the serving entry scripts share: what to load, in which dtype, and where it runs."""
    ap.add_argument("--checkpoint", required=True,
                    help="a Hugging Face directory, a meshlab run directory, or random:<preset>")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="compute dtype (default: the checkpoint's)")
    ap.add_argument("--rules", default=None, help="serving rule file (e.g. tp) to shard the weights; default: "
                    "one device")
    ap.add_argument("--mesh", default=None, help="serving mesh spec, e.g. tensor=2 (default: the rule file's)")
    ap.add_argument("--cpu-devices", type=cpu_devices_arg, default=0, help="simulate N CPU devices (CPU only)")
    ap.add_argument("--compile-cache", default="auto",
                    help="jax's persistent compile cache directory: a restart loads the compiled programs "
                         "(auto: $XDG_CACHE_HOME/meshlab/jax; empty: off; JAX_COMPILATION_CACHE_DIR, when set, wins)")


def add_storage_args(ap) -> None:
    """The fp8 storage flags serve.py and generate.py share (their values reach Engine / ContiguousGenerator
    through storage_kwargs)."""
    from meshlab.infer.kv_cache import KV_CACHE_DTYPES
    ap.add_argument("--quantize", default="none", choices=("none", "fp8"),
                    help="fp8: the decoder layers' matrices in float8_e4m3fn with a scale per output row "
                         "(about half the bytes a decode token reads; prompt chunks in FP8 GEMMs, their "
                         "activations scaled per token; a GPU needs sm89+); a dense model on one device")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="fp8: the KV cache in float8_e4m3fn (half its bytes: raise --num-pages or --max-seqs in the "
                         "same memory; K/V saturate at +-448, no scales, as vLLM's fp8 without calibration); auto: the "
                         "model's dtype")


def storage_kwargs(args) -> dict:
    """add_storage_args' values as the generators' arguments (quantize=None for "none")."""
    return {"quantize": None if args.quantize == "none" else args.quantize, "kv_cache_dtype": args.kv_cache_dtype}


def add_speculative_args(ap, batch: bool = True) -> None:
    """The speculative decoding flags serve.py and generate.py share (to Engine through speculative_kwargs);
    batch: also --speculative-max-batch (a server's; generate.py decodes one row)."""
    ap.add_argument("--speculative-tokens", type=int, default=0,
                    help="draft tokens a step checks, by prompt lookup, for requests without a token mask "
                         "(0: off; meshlab/infer/speculative.py says where it pays)")
    ap.add_argument("--prompt-lookup-max", type=count_arg(1), default=3, help="the longest suffix a draft is looked up by, tokens")
    ap.add_argument("--prompt-lookup-min", type=count_arg(1), default=1, help="the shortest suffix a draft is looked up by, tokens")
    if batch:
        ap.add_argument("--speculative-max-batch", type=count_arg(1), default=4, help="speculate while at most this many rows decode")


def check_speculative_args(args, max_len: int, max_len_words: str) -> None:
    """ValueError naming the flags when add_speculative_args' values cannot work together or with a row of
    max_len tokens (max_len_words: where that length comes from, e.g. "--max-len 2048")."""
    from meshlab.infer.speculative import MAX_PROMPT_LOOKUP
    k, shortest, longest = args.speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max
    if shortest > longest:
        raise ValueError(f"--prompt-lookup-min {shortest} must be <= --prompt-lookup-max {longest}")
    if k > 0 and longest > MAX_PROMPT_LOOKUP:       # k < 0: Engine names it
        raise ValueError(f"--prompt-lookup-max {longest} must be <= {MAX_PROMPT_LOOKUP}: the lookup compiles a pass per "
                         "suffix length, its compile time growing as the square of the longest")
    if k >= max_len:
        raise ValueError(f"--speculative-tokens {k} must be below {max_len_words}: a speculative step feeds a row "
                         "its last token and its drafts")


def speculative_kwargs(args) -> dict:
    """add_speculative_args' values as Engine's arguments."""
    kw = {"speculative_tokens": args.speculative_tokens, "prompt_lookup_max": args.prompt_lookup_max,
          "prompt_lookup_min": args.prompt_lookup_min}
    if hasattr(args, "speculative_max_batch"):
        kw["speculative_max_batch"] = args.speculative_max_batch
    return kw


def open_checkpoint(args):
    """(rules, mesh, cfg, md, params, tokenizer) from add_checkpoint_args' values. --cpu-devices is
    applied first: it must precede the first use of a JAX backend; the compile cache (its line on stderr)
    before the first compile."""
    import sys
    from meshlab import compile_cache
    if args.cpu_devices:
        from meshlab.compat import set_cpu_devices
        set_cpu_devices(args.cpu_devices)
    rules, mesh = serving_placement(args.rules, args.mesh)
    print(compile_cache.enable(args.compile_cache, setting="--compile-cache")[1], file=sys.stderr, flush=True)
    return (rules, mesh, *load_checkpoint(args.checkpoint, dtype=args.dtype, rules=rules, mesh=mesh))


def random_params(cfg, seed: int = 0, dtype=None):
    """Random params created on device in `dtype` (no fp32 copy of a big model on the host)."""
    md_dtype = jnp.dtype(dtype or cfg.dtype)
    make = lambda k: jax.tree.map(lambda x: x.astype(md_dtype),
                                  nnx.to_pure_dict(nnx.state(models.build(cfg, nnx.Rngs(k)), nnx.Param)))
    return jax.jit(make)(jax.random.key(seed))


def load_checkpoint(spec: str, *, dtype: str | None = None, rules=None, mesh=None, **cfg_overrides):
    """(cfg, md, params, tokenizer) for a --checkpoint value (see the module docstring)."""
    from models import model_def
    if spec.startswith("random:"):
        name, seed = _random_spec(spec)
        cfg = dataclasses.replace(models.preset(name), **({"dtype": dtype} if dtype else {}), **cfg_overrides)
        tok = check_vocab(ByteTokenizer(), cfg, spec)
        params = random_params(cfg, seed)
        if rules is not None and mesh is not None:
            params = jax.device_put(params, _shardings(model_def(cfg), rules, mesh))
        return cfg, model_def(cfg), params, tok
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"checkpoint {spec!r} does not exist; pass a Hugging Face directory, a meshlab run "
                              "directory, or random:<preset>")
    if (path / "config.json").is_file():
        over = dict(cfg_overrides, **({"dtype": dtype} if dtype else {}))
        cfg, md, params = load_hf(path, rules=rules, mesh=mesh, **over)
        tok = (HFTokenizer(path / "tokenizer.json", _hf_eos(path)) if (path / "tokenizer.json").is_file()
               else ByteTokenizer())
        return cfg, md, params, check_vocab(tok, cfg, path)
    if (path / "config.yaml").is_file():
        return _load_run(path, dtype, rules, mesh, cfg_overrides)
    raise CheckpointError(f"{path}: neither a Hugging Face checkpoint (config.json) nor a meshlab run (config.yaml)")


def _random_spec(spec: str) -> tuple[str, int]:
    """random:<preset>[:<seed>] -> (preset, seed), or one CheckpointError naming the part at fault."""
    _, name, *rest = spec.split(":")
    try:
        models.preset(name)
    except KeyError as e:
        raise CheckpointError(f"--checkpoint {spec}: {e.args[0]}") from None
    if len(rest) > 1 or (rest and not rest[0].lstrip("-").isdigit()):
        raise CheckpointError(f"--checkpoint {spec}: the seed after {name}: must be a whole number, "
                              f"e.g. random:{name}:0")
    return name, int(rest[0]) if rest else 0


def check_vocab(tok, cfg, where):
    """tok, when the model has an embedding row for each of its ids; else a CheckpointError naming both
    sizes (every prompt holding the tokenizer's last ids would otherwise be refused, per request)."""
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{where}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                              f"{cfg.vocab_size}, so ids >= {cfg.vocab_size} have no embedding; serve the model "
                              "with the tokenizer it was trained with")
    return tok


def _hf_eos(path: Path) -> list[int]:
    """eos_token_id of generation_config.json, else config.json (an int or a list)."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def _shardings(md, rules, mesh):
    from jax.sharding import NamedSharding
    from meshlab.layout import leaf_specs
    return jax.tree.map(lambda s: NamedSharding(mesh, s), leaf_specs(md, rules, mesh, "params"),
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def run_model_config(path: Path, overrides: dict):
    """The model config of a run, from its config.yaml's `model:` section (plain YAML, no trainer)."""
    raw = yaml.safe_load((path / "config.yaml").read_text()) or {}
    fields = dict(raw.get("model") or {})
    try:
        base = models.preset(fields.get("name", "tiny"))
    except KeyError as e:
        raise CheckpointError(f"{path}/config.yaml: {e.args[0]}") from None
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{path}/config.yaml: model fields {unknown} are unknown to this meshlab's "
                              f"{type(base).__name__}; serve the run with the meshlab version that trained it")
    # the caller's overrides (--dtype) win over the run's own fields: config.yaml names its dtype always
    cfg = dataclasses.replace(base, **{**fields, **overrides})
    cfg.validate()
    return cfg, raw


def run_tokenizer(path: Path, raw: dict):
    """The tokenizer the run trained with, from the run directory (see write_run_tokenizer)."""
    from meshlab.checkpoint import TOKENIZER_META
    meta_file = path / TOKENIZER_META
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    corpus = (raw.get("data") or {}).get("corpus", "stdlib")
    if meta is None and corpus != "stdlib":
        raise CheckpointError(f"{path} has no {TOKENIZER_META} (written by training since serving reads the "
                              f"run alone) and its corpus {corpus!r} is not the byte-token stdlib one; copy the "
                              f"corpus's tokenizer.json into {path} and write {TOKENIZER_META} as "
                              '{"tokenizer": "tokenizer.json", "eod_id": ID}')
    if meta is None or meta.get("tokenizer") == "byte":
        return ByteTokenizer()
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}/{TOKENIZER_META} names a tokenizer.json, but {path}/tokenizer.json is "
                              "missing; copy the tokenizer the corpus was prepared with there")
    eod = meta.get("eod_id")
    return HFTokenizer(path / "tokenizer.json", [eod] if eod is not None else [])


def _load_run(path: Path, dtype, rules, mesh, overrides: dict):
    """Params of a meshlab training run's latest checkpoint, restored onto the serving placement."""
    from meshlab.checkpoint import restore_params
    from models import model_def
    cfg, raw = run_model_config(path, dict(overrides, **({"dtype": dtype} if dtype else {})))
    md = model_def(cfg)
    if rules is not None and mesh is not None:
        shardings = _shardings(md, rules, mesh)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, md.abstract)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), md.abstract, shardings)
    ckpt_dir = (raw.get("checkpoint") or {}).get("dir") or path / "checkpoints"
    tok = check_vocab(run_tokenizer(path, raw), cfg, path)       # before the restore: a mismatch is found at once
    params, _ = restore_params(ckpt_dir, target)   # model order, whatever order a pipeline stored
    return cfg, md, params, tok
