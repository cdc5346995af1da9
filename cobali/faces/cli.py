"""The `cobali` console script: one entry point, a subcommand per face."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

from cobali import __version__
from cobali.config import settings
from cobali.config.flags import engine_setup
from cobali.config.model_flags import add_models_args, models_config
from cobali.config.serve_flags import add_run_batch_args, add_serve_args, run_batch_config, server_config
from cobali.faces import batch, bench, calibrate, run, simulate, synth_lora, synth_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobali", description="continuous batching over llama.cpp")
    parser.add_argument("--version", action="version", version=f"cobali {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    run.register(subparsers)
    bench.register(subparsers)
    serve = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_serve_args(serve)
    add_models_args(serve)  # not in add_serve_args: model_flags builds on serve_flags
    serve.set_defaults(func=serve_command)
    calibrate.register(subparsers)
    simulate.register(subparsers)
    batch.register(subparsers).set_defaults(func=batch_command)
    run_batch = subparsers.add_parser("run-batch", help="a file in OpenAI's Batch API format, run offline (as vllm "
                                      "run-batch)", description="Each line's body goes through the server's routes "
                                      "in this process; results are appended as they finish, and a rerun resumes.")
    add_run_batch_args(run_batch)
    run_batch.set_defaults(func=run_batch_command)
    synth_model.register(subparsers)
    synth_lora.register(subparsers)
    settings.add_config_flags(parser)
    return parser


def batch_command(args: argparse.Namespace) -> int:
    """One engine in this process, or --replicas engines on Ray workers."""
    if not args.ray:
        return batch.batch_command(args)
    from cobali.ray.batch import run_shards_on_ray  # Ray is an optional extra: imported only here

    return batch.batch_command(args, run_shards=functools.partial(run_shards_on_ray, args.replicas))


def run_batch_command(args: argparse.Namespace) -> int:
    from cobali.http.run_batch import run_batch_file  # FastAPI loads only for the faces that serve

    spec = engine_setup(args, record_ticks=False)
    return run_batch_file(spec, run_batch_config(args), args.input, args.output,
                          args.max_concurrency or 4 * args.max_slots)


def serve_command(args: argparse.Namespace) -> int:
    """One engine in this process, or --replicas engines behind one endpoint with Ray Serve."""
    if (models := models_config(args)) is not None:
        from cobali.http.serve import serve_models

        return serve_models(models)
    # A server runs for days: its ticks go to the metrics (Engine.on_tick), not into a list that only grows.
    spec, settings = engine_setup(args, record_ticks=False), server_config(args)
    if not settings.on_ray:
        from cobali.http.serve import serve  # FastAPI and uvicorn load only for `serve`

        return serve(spec, settings)
    try:
        from cobali.ray.serve import serve_replicas  # Ray is an optional extra: imported only here
    except ImportError as err:
        raise ValueError(f"--replicas > 1 needs Ray Serve (pip install 'cobali[ray]'): {err}") from None
    return serve_replicas(spec, settings)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = settings.parse_args(parser, argv)  # the flags, and what COBALI_* and --config FILE add to them
    # INFO for cobali's own lines in every face (the backend's load line says what the model takes, and where);
    # other libraries' only from WARNING: an HTTP client's line per request would bury them.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cobali").setLevel(logging.INFO)
    try:
        return args.func(args)
    except ValueError as err:
        parser.exit(2, f"cobali {args.command}: error: {err}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
