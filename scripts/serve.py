"""OpenAI-compatible HTTP server: python scripts/serve.py --checkpoint PATH --port P.

--checkpoint: a Hugging Face directory, a meshlab run directory, or random:<preset> (tests).
Continuous batching over a paged KV cache; see meshlab/infer/server.py for the endpoints and
meshlab/infer/serve_cli.py for what the options build.
Needs the `serve` extra (pip install -e '.[serve]': Starlette, uvicorn, Jinja2, llguidance, prometheus-client).
Serves on one device unless --rules (and --mesh) shard the weights over the devices present.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    from meshlab.infer.serve_cli import listen_url, serve_parser, serve_until_signalled, start_server
    args = serve_parser(__doc__.splitlines()[0]).parse_args(argv)
    try:
        server = start_server(args)
    except ImportError as e:
        sys.exit(f"serve: {e}; install the serve extra: pip install -e '.[serve]'")
    except (ValueError, OSError, RuntimeError) as e:
        sys.exit(f"serve: {e}")
    print(f"serving {args.model_name} on {listen_url(args.host, server.port)}", flush=True)
    serve_until_signalled(server, args.shutdown_timeout)


if __name__ == "__main__":
    main()
