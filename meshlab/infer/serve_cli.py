"""scripts/serve.py's command line, importable: its arguments (`serve_parser`), the engine and server they
build (`start_server`), and the signal handling around a running server (`serve_until_signalled`)."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


def port_number(text: str) -> int:
    """--port's type: a TCP port, 0-65535 (the socket layer would take 70000 as 70000 mod 65536)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535; 0 picks a free one)")
    return port


def serve_parser(description: str = "OpenAI-compatible HTTP server") -> argparse.ArgumentParser:
    from meshlab.infer.loading import (HelpFormatter, add_checkpoint_args, add_speculative_args, add_storage_args,
                                      count_arg, seconds_arg)
    ap = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add_checkpoint_args(ap)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=port_number, default=8000, help="0 picks a free port (printed at start)")
    ap.add_argument("--model-name", default="meshlab", help="the model id /v1/models lists and requests name")
    ap.add_argument("--max-len", type=count_arg(1), default=2048, help="longest prompt + output, in tokens")
    ap.add_argument("--max-seqs", type=count_arg(1), default=16, help="requests decoded together")
    ap.add_argument("--page-size", type=count_arg(1), default=16, help="tokens per KV cache page (the prefix cache shares whole pages)")
    ap.add_argument("--num-pages", type=count_arg(2, " (page 0 is reserved)"), default=None, help="cache pages (default: every row full)")
    ap.add_argument("--chunk", type=count_arg(1), default=256, help="prefill chunk (the prefill bucket), tokens")
    ap.add_argument("--steps-per-call", type=count_arg(1), default=8, help="decode steps per device call")
    ap.add_argument("--max-step-tokens", type=count_arg(2), default=None,
                    help="tokens one step may feed, decodes and prompt chunks together (default: max-seqs + 4 chunks)")
    ap.add_argument("--attention", default="auto", choices=("auto", "xla", "pallas"),
                    help="paged decode attention (auto: the Pallas kernel on one GPU, else XLA)")
    ap.add_argument("--layers", default="auto", choices=("auto", "split", "fused", "kernels", "scan", "unroll"),
                    help="how the layer weights are held (meshlab/infer/engine.py): fused launches fewer "
                         "GEMMs (meant for one device); split keeps each weight's tensor sharding; "
                         "kernels: [n, k] matrices, Pallas decode matmuls at batch 1 (a mixture of experts' experts "
                         "up to batch 4; one device); "
                         "auto: kernels on one GPU with the Pallas attention, fused on one other device "
                         "(split for a mixture of experts), else split")
    add_storage_args(ap)
    add_speculative_args(ap)
    ap.add_argument("--max-body-bytes", type=count_arg(1), default=1 << 20, help="larger request bodies get 413")
    ap.add_argument("--body-timeout", type=seconds_arg(low_open=True), default=10.0, help="seconds to receive a request body (else 400)")
    ap.add_argument("--max-concurrent", type=count_arg(1), default=512, help="requests in flight before 429")
    ap.add_argument("--max-waiting", type=count_arg(1), default=1024, help="engine requests queued before 503")
    ap.add_argument("--api-key", default=os.environ.get("MESHLAB_API_KEY"),
                    help="clients must send `Authorization: Bearer KEY` to the /v1 and token routes (default: "
                         "$MESHLAB_API_KEY; unset: no key)")
    ap.add_argument("--stats-interval", type=seconds_arg(note=" (0: none)"), default=10.0,
                    help="seconds between throughput lines on stderr while serving (prompt and generation tok/s, "
                         "requests running and waiting, KV cache use, prefix-cache hits); 0: none")
    ap.add_argument("--shutdown-timeout", type=seconds_arg(), default=30.0,
                    help="on SIGTERM / Ctrl-C, seconds the requests in flight get to finish (new ones: 503)")
    ap.add_argument("--warmup", default="auto", choices=("auto", "on", "off"),
                    help="compile every batch bucket before listening (auto: on unless on CPU); otherwise a "
                         "bucket first met under load compiles then, stalling every request for seconds")
    ap.add_argument("--warmup-kinds", default="greedy",
                    help="the requests whose programs --warmup compiles before listening, comma-separated: greedy, "
                         "sampled (temperature, penalties, response_format), top_p (sampled with top_p), top_k "
                         "(with top_k), min_p (with min_p), logprobs, scoring (echo with logprobs, as evaluation harnesses score); a "
                         "step mixing kinds runs a program of its own, compiled at its first use")
    ap.add_argument("--warmup-idle-kinds", default="sampled,top_p,top_k,min_p",
                    help="kinds whose programs --warmup compiles after listening, while the engine has no work, "
                         "one program at a time (a request meanwhile waits at most for the one compiling; /health "
                         "says warming: true until done); empty: none")
    ap.add_argument("--tool-call-parser", default="auto", choices=("auto", "json", "hermes", "mistral"),
                    help='how tool_choice "auto" reads calls out of a reply: json (bare JSON calls, Llama 3\'s '
                         "too), hermes (<tool_call> blocks: Hermes, Qwen), mistral ([TOOL_CALLS]); auto: the one "
                         "the checkpoint's chat template writes, else json")
    ap.add_argument("--trust-request-chat-template", action="store_true",
                    help="a chat request's own `chat_template` (Jinja, run in a sandbox) formats its messages "
                         "instead of the checkpoint's; off: such a request gets 400 (vLLM's flag)")
    ap.add_argument("--allowed-origins", type=_origins, default=[], metavar="ORIGIN,...",
                    help="comma-separated origins whose browser pages may call the API (CORS), e.g. "
                         "https://app.example.com,http://localhost:3000; * for any; default: none (vLLM's flag)")
    return ap


def _origins(value: str) -> list:
    """--allowed-origins as a list: browsers send an origin as scheme://host[:port], without a path."""
    origins = [o.strip() for o in value.split(",") if o.strip()]
    for o in origins:
        if o != "*" and ("://" not in o or o.endswith("/")):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin: write scheme://host[:port] (no path or "
                                             "trailing slash), e.g. https://app.example.com")
    return origins


def warmup_kinds(args) -> tuple[list, list]:
    """(--warmup-kinds, --warmup-idle-kinds) as lists of warmup.WARMUP_KINDS names; ValueError names a bad one."""
    from meshlab.infer.warmup import WARMUP_KINDS
    kinds, idle = ([k for k in value.split(",") if k] for value in (args.warmup_kinds, args.warmup_idle_kinds))
    for flag, value, named in (("--warmup-kinds", args.warmup_kinds, kinds),
                               ("--warmup-idle-kinds", args.warmup_idle_kinds, idle)):
        if any(k not in WARMUP_KINDS for k in named):
            raise ValueError(f"{flag} {value}: each must be one of {', '.join(WARMUP_KINDS)}")
    return kinds, idle


def check_args(args) -> None:
    """ValueError naming the flags when the cache's sizes (and the speculative flags) do not fit together."""
    from meshlab.infer.loading import check_speculative_args
    if args.max_len % args.page_size:
        fix = (f"e.g. --max-len {-(-args.max_len // args.page_size) * args.page_size}" if args.page_size <= args.max_len
               else "lower --page-size")
        raise ValueError(f"--page-size {args.page_size} must divide --max-len {args.max_len} (a row holds whole pages), "
                         + fix)
    row = args.max_len // args.page_size + 1          # one full row, and page 0 the cache keeps free
    if args.num_pages is not None and args.num_pages < row:
        raise ValueError(f"--num-pages {args.num_pages} cannot hold one request of --max-len {args.max_len}: that takes "
                         f"{row - 1} pages of --page-size {args.page_size}, and page 0 is reserved; pass --num-pages "
                         f">= {row} or lower --max-len")
    check_speculative_args(args, args.max_len, f"--max-len {args.max_len}")


def start_server(args):
    """Load the checkpoint, build the engine, compile the warmup kinds, and start the server (listening
    when this returns). ImportError: the serve extra is missing; ValueError, OSError, RuntimeError: bad
    arguments, a checkpoint that does not load, a port in use."""
    import jax
    from meshlab.infer import kv_cache
    from meshlab.infer.programs import weights_summary
    from meshlab.infer.engine import Engine
    from meshlab.infer.loading import open_checkpoint, speculative_kwargs, stop_token_ids, storage_kwargs
    from meshlab.infer.server import Server
    from meshlab.infer.tools import tool_format
    from meshlab.infer.warmup import WARMUP_KINDS
    kinds, idle = warmup_kinds(args)
    check_args(args)
    rules, mesh, cfg, md, params, tok = open_checkpoint(args)
    if args.attention == "pallas" and jax.default_backend() != "gpu":     # the backend is set up by now
        raise ValueError(f"--attention pallas runs the Pallas paged-attention kernels compiled, which needs a GPU "
                         f"(this backend: {jax.default_backend()}); use --attention xla or auto")
    engine = Engine(md, params, max_len=args.max_len, max_seqs=args.max_seqs, page_size=args.page_size,
                    num_pages=args.num_pages, chunk=args.chunk, steps_per_call=args.steps_per_call,
                    max_step_tokens=args.max_step_tokens, impl=args.attention, layers=args.layers, rules=rules,
                    mesh=mesh, **speculative_kwargs(args), **storage_kwargs(args))
    print(f"{weights_summary(engine.params)}; {kv_cache.summary(engine.cache)}", file=sys.stderr, flush=True)
    warm = args.warmup == "on" or (args.warmup == "auto" and jax.default_backend() != "cpu")
    if warm:
        t = time.perf_counter()
        k = sum(engine.warmup(**WARMUP_KINDS[kind]) for kind in kinds)
        print(f"compiled {k} programs ({', '.join(kinds)}) in {time.perf_counter() - t:.0f} s", file=sys.stderr,
              flush=True)
    return Server(engine, tok, args.model_name, args.host, args.port, stop_token_ids=stop_token_ids(tok),
                  max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                  max_concurrent=args.max_concurrent, max_waiting=args.max_waiting,
                  tool_format=tool_format(args.tool_call_parser, getattr(tok, "chat_template", None)),
                  api_key=args.api_key, stats_interval=args.stats_interval,
                  trust_request_chat_template=args.trust_request_chat_template, allowed_origins=args.allowed_origins,
                  idle_warmup=[WARMUP_KINDS[k] for k in idle if k not in kinds] if warm else ()).start()


def listen_url(host: str, port: int) -> str:
    """The address a client dials, as serve.py prints it: '' binds every interface (shown as 0.0.0.0),
    an IPv6 literal goes in brackets."""
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_until_signalled(server, shutdown_timeout: float) -> None:
    """Serve until SIGINT or SIGTERM, then drain (new requests 503, those in flight get shutdown_timeout
    seconds; a second signal stops at once) and stop. Main thread only (signal handlers)."""
    done, now = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: (now if done.is_set() else done).set())
    # The kernel may deliver the signal to any thread (the engine's, uvicorn's, XLA's): CPython then only
    # flags it, and the handler runs when the main thread next executes bytecode. An untimed wait would
    # sleep through it (seen: SIGTERM ignored until a second one), so the wait wakes every 0.2 s.
    while not done.wait(0.2):
        pass
    print(f"draining: new requests get 503, those in flight have {shutdown_timeout:g} s to finish "
          "(signal again to stop now)", flush=True)
    if not server.drain(shutdown_timeout, cancel=now):
        print(f"stopping with {server.inflight} requests unfinished", flush=True)
    server.stop()
