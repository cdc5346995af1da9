"""The `serve` subcommand's flags. Only argparse-level imports: `cobali run` loads this module too, and
should not pay for importing FastAPI and uvicorn."""

from __future__ import annotations

import argparse

from cobali.options import add_engine_args, non_negative_int, positive_int

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# A server's users feel the inter-token latency: by default each tick's prefill is sized to keep it under
# 250 ms (on the mixed workload: ITL p99 1728 -> 496 ms for 1 % more wall time than the fixed 512 budget).
DEFAULT_ITL_TARGET_MS = 250.0


def _port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text}")
    return value


def _template_file(path: str) -> str:
    """The file's text: read here, so every replica gets the text itself, not a path it may not see."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path!r}: {err}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_args(parser, itl_target_ms=DEFAULT_ITL_TARGET_MS)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=_port, default=8000, help="port to bind")
    parser.add_argument("--max-queue", type=non_negative_int, default=256,
                        help="requests that may wait for a slot; beyond it requests get HTTP 429")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1 and /slots")
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body; beyond it requests get HTTP 413")
    parser.add_argument("--chat-template", type=_template_file, default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the GGUF's tokenizer.chat_template")
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: GGUF name)")
    parser.add_argument("--shutdown-grace", type=_seconds, default=30.0,
                        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="engines behind one endpoint, with Ray Serve (optional extra: pip install 'cobali[ray]')")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster for --replicas > 1 (default: start a local one)")
    parser.set_defaults(func=_serve_command)


def _serve_command(args: argparse.Namespace) -> int:
    if args.replicas == 1:
        if args.ray_address is not None:
            raise ValueError("--ray-address needs --replicas > 1 (one replica runs in this process)")
        from cobali.server.serve import serve

        return serve(args)
    try:
        from cobali.ray.serve import serve_replicas  # Ray is an optional extra: imported only here
    except ImportError as err:
        raise ValueError(f"--replicas > 1 needs Ray Serve (pip install 'cobali[ray]'): {err}") from None

    return serve_replicas(args)
