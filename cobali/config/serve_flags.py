"""The `serve` subcommand's flags and the typed configs built from them. Only argparse-level imports:
`cobali run` loads this module too, and should not pay for importing FastAPI and uvicorn."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping

from cobali.config.flags import add_engine_args, non_negative_float, non_negative_int, positive_float, positive_int
from cobali.config.limit_flags import add_limit_args, grammar_limits, preprocess_limits, request_limits
from cobali.frontend.parsers.reasoning import REASONING_PARSERS
from cobali.frontend.parsers.reply import AUTO
from cobali.frontend.parsers.tools import TOOL_PARSERS
from cobali.http.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    DEFAULT_MAX_STREAM_BUFFER_CHARS,
    DEFAULT_SEND_TIMEOUT_S,
    ROUTERS,
    ServerConfig,
)


def _port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value}")
    return value


def _template_file(path: str) -> str:
    """The file's text: read here, so every replica gets the text itself, not a path it may not see."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path!r}: {err}") from None


def _key_file(path: str) -> tuple[str, ...]:
    """The keys of an --api-key-file, read here (as --chat-template), so every replica gets the keys themselves."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.strip() for line in file]
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read the API key file {path!r}: {err}") from None
    keys = tuple(line for line in lines if line and not line.startswith("#"))
    if not keys:
        raise argparse.ArgumentTypeError(f"the API key file {path!r} holds no key (one a line; blank lines and # "
                                         "comments are skipped)")
    return keys


def _existing_file(path: str) -> str:
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"no such file {path!r}")
    return path


def _origin(text: str) -> str:
    """Browsers send an origin as scheme://host[:port]: one with a path or a trailing slash would never match."""
    if text != "*" and ("://" not in text or "/" in text.split("://", 1)[1]):
        raise argparse.ArgumentTypeError(f"expected an origin such as https://app.example.com or *, got {text!r}")
    return text


def _numbers(text: str, count: int, flag_help: str) -> list[float]:
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != count or any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected {flag_help}, got {text!r}")
    return values


def _router_weights(text: str) -> tuple[float, float, float]:
    prefix, queue, kv = _numbers(text, 3, "PREFIX,QUEUE,KV: three weights >= 0, such as 3,2,2")
    return prefix, queue, kv


def _router_balance(text: str) -> tuple[int, float]:
    absolute, relative = _numbers(text, 2, "ABS,REL: requests >= 0 and a ratio >= 1, such as 64,1.5")
    if absolute != int(absolute) or relative < 1:
        raise argparse.ArgumentTypeError(f"expected ABS,REL: a whole number of requests and a ratio >= 1, "
                                         f"got {text!r}")
    return int(absolute), relative


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{name}: no such adapter file {path!r}")
    return name, path


def _parser_name(known: Mapping[str, object], *others: str) -> Callable[[str], str]:
    def name(text: str) -> str:
        if text not in known and text not in (AUTO, *others):
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(sorted(known))}, "
                                             f"{', '.join((AUTO, *others))}")
        return text

    return name


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """What a request's body may name, and how its chat is rendered: `serve`'s and `run-batch`'s."""
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: GGUF name)")
    parser.add_argument("--chat-template", type=_template_file, default=None, metavar="FILE",
                        help="Jinja chat template to use instead of the GGUF's tokenizer.chat_template")
    parser.add_argument("--reasoning-parser", type=_parser_name(REASONING_PARSERS, "none"), default=AUTO,
                        metavar="NAME", help="how replies' reasoning is read apart from their content (vLLM's "
                        f"names: {', '.join(sorted(REASONING_PARSERS))}; none: not at all; default: auto, from "
                        "the chat template)")
    parser.add_argument("--tool-call-parser", type=_parser_name(TOOL_PARSERS), default=AUTO, metavar="NAME",
                        help=f"how tool calls are read from replies ({', '.join(sorted(TOOL_PARSERS))}; default: "
                        "auto, from the chat template)")
    parser.add_argument("--lora-modules", type=_lora_module, nargs="+", default=(), metavar="NAME=PATH",
                        help="LoRA adapters (GGUF, as llama.cpp's convert_lora_to_gguf.py or `cobali synth-lora` "
                             "write them), each served as model NAME beside the base model; a tick runs the "
                             "requests of one adapter, and busy adapters take turns")
    add_limit_args(parser)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=_port, default=8000, help="port to bind")
    parser.add_argument("--max-queue", type=non_negative_int, default=256,
                        help="requests that may wait for a slot; beyond it requests get HTTP 429")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1, /slots and the docs; repeat for several "
                             "keys, any of which is accepted. A key here shows in `ps`: prefer --api-key-file or "
                             "COBALI_API_KEY")
    parser.add_argument("--api-key-file", type=_key_file, default=(), metavar="FILE",
                        help="API keys, one a line (blank lines and # comments skipped), beside any --api-key")
    parser.add_argument("--shared-prefix-cache", action="store_true",
                        help="let requests under different API keys reuse each other's cached prompt prefixes "
                             "(one tenant's keys); by default each key's are its own, so usage's cached_tokens "
                             "and the replies' speed tell nothing of another key's prompts")
    parser.add_argument("--max-connections", type=positive_int, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="requests in flight at once (connections at work: an idle keep-alive one is not "
                             "counted); beyond it requests get HTTP 503 before their body is read "
                             "(default %(default)s)")
    parser.add_argument("--max-connections-per-client", type=positive_int,
                        default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT, metavar="N",
                        help="requests in flight at once from one client address (behind a proxy, the forwarded "
                             "one); beyond it requests get HTTP 429 before their body is read (default %(default)s)")
    parser.add_argument("--allowed-origins", type=_origin, nargs="+", default=(), metavar="ORIGIN",
                        help="let web pages from these origins (https://app.example.com, or * for any) call the "
                             "API from a browser: CORS headers, off by default")
    parser.add_argument("--ssl-keyfile", type=_existing_file, default=None, metavar="FILE",
                        help="serve HTTPS with this private key (PEM), with --ssl-certfile")
    parser.add_argument("--ssl-certfile", type=_existing_file, default=None, metavar="FILE",
                        help="serve HTTPS with this certificate chain (PEM), with --ssl-keyfile")
    parser.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body; beyond it requests get HTTP 413")
    _add_model_args(parser)
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (clients then "
                             "name adapter files on this machine); default from VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    parser.add_argument("--shutdown-grace", type=non_negative_float, default=30.0,
                        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted")
    parser.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                        help="a stream sends its text every N tokens (the first text and the end at once); "
                             "larger N costs the server less per token, and streams less smoothly")
    parser.add_argument("--send-timeout", type=positive_float, default=DEFAULT_SEND_TIMEOUT_S, metavar="S",
                        help="a stream whose client reads nothing for S seconds is dropped, its request aborted")
    parser.add_argument("--max-stream-buffer", type=positive_int, default=DEFAULT_MAX_STREAM_BUFFER_CHARS,
                        metavar="CHARS", help="text a stream may hold for a client that falls behind; beyond it "
                        "the client is dropped, its request aborted")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="uvicorn's log line per request (on by default; at hundreds of short requests a "
                             "second it costs the server a few percent of its CPU)")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                        help="run the engine in a process of its own: a crash in llama.cpp then costs a restart "
                             "(requests that had started end with an error, the others wait for it), not the server; "
                             "off by default (docs/configuration.md says why)")
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="engines behind one endpoint, with Ray Serve (optional extra: pip install 'cobali[ray]')")
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster for --replicas > 1 (default: start a local one)")
    _add_replica_args(parser)


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    """Ray Serve's autoscaling, and how requests are routed among the replicas (docs/serving.md, Replicas)."""
    parser.add_argument("--min-replicas", type=non_negative_int, default=None, metavar="N",
                        help="autoscale between N and --max-replicas replicas (default 1), instead of --replicas")
    parser.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                        help="autoscale up to N replicas, by requests in flight (Ray Serve's autoscaling)")
    parser.add_argument("--target-ongoing-requests", type=positive_float, default=None, metavar="N",
                        help="requests in flight per replica the autoscaler aims at (default: Ray Serve's, 2)")
    parser.add_argument("--router", choices=ROUTERS, default=None,
                        help="how a request picks its replica: kv (default), where its prompt's KV is as the "
                             "replicas report it, unless the load says otherwise; text, by the prompts' text sent to "
                             "each; least-busy, the less busy of two drawn at random")
    add_kv_router_args(parser)


def add_kv_router_args(parser: argparse.ArgumentParser) -> None:
    """The kv router's settings, as `cobali serve` and `cobali simulate` both take them (None: the default)."""
    parser.add_argument("--router-weights", type=_router_weights, default=None, metavar="PREFIX,QUEUE,KV",
                        help="the kv router's score: prefix matched, minus queued work, minus KV in use, weighted "
                             "(default 3,2,2, llm-d's)")
    parser.add_argument("--router-balance", type=_router_balance, default=None, metavar="ABS,REL",
                        help="the kv router ignores prefixes when the longest queue exceeds the shortest by more than "
                             "ABS requests and REL times (default 64,1.5, SGLang's)")
    parser.add_argument("--routing-stats-period", type=positive_float, default=None, metavar="S",
                        help="how often each replica reports the prefixes it holds to the router (default 1 s)")


def add_run_batch_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("-i", "--input", required=True,
                        help='JSONL in OpenAI\'s Batch format: {"custom_id", "method": "POST", "url", "body"} a line')
    parser.add_argument("-o", "--output", required=True,
                        help="JSONL results, appended; custom_ids answered there are skipped (but for a server "
                             "error's: run again)")
    _add_model_args(parser)
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="requests in flight at once (default: 4 x --max-slots)")


def run_batch_config(args: argparse.Namespace) -> ServerConfig:
    """The in-process server a batch runs through: no socket, and no queue limit (the batch bounds itself)."""
    return ServerConfig(served_model_name=args.served_model_name, chat_template=args.chat_template, max_queue=None,
                        max_connections=None, max_connections_per_client=None,
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        lora_modules=tuple(args.lora_modules), limits=request_limits(args),
                        grammar=grammar_limits(args), preprocess=preprocess_limits(args, client_queue=False))


def server_config(args: argparse.Namespace) -> ServerConfig:
    keys = tuple(dict.fromkeys((*(args.api_key or ()), *args.api_key_file)))  # in order, each once
    return ServerConfig(host=args.host, port=args.port, max_queue=args.max_queue, api_keys=keys,
                        shared_prefix_cache=args.shared_prefix_cache, max_connections=args.max_connections,
                        max_connections_per_client=args.max_connections_per_client,
                        allowed_origins=tuple(args.allowed_origins), ssl_keyfile=args.ssl_keyfile,
                        ssl_certfile=args.ssl_certfile,
                        max_body_bytes=args.max_body_bytes, served_model_name=args.served_model_name,
                        shutdown_grace_s=args.shutdown_grace, replicas=args.replicas,
                        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                        target_ongoing_requests=args.target_ongoing_requests, router=args.router,
                        router_weights=args.router_weights, router_balance=args.router_balance,
                        routing_stats_period_s=args.routing_stats_period,
                        engine_process=args.engine_process, ray_address=args.ray_address,
                        chat_template=args.chat_template, stream_interval=args.stream_interval,
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        lora_modules=tuple(args.lora_modules), runtime_lora=args.allow_runtime_lora_updating,
                        send_timeout_s=args.send_timeout, max_stream_buffer_chars=args.max_stream_buffer,
                        access_log=args.access_log, limits=request_limits(args), grammar=grammar_limits(args),
                        preprocess=preprocess_limits(args))
