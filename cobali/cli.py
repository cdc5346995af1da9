"""The `cobali` console script: one entry point, a subcommand per face."""

from __future__ import annotations

import argparse
import sys

from cobali import __version__, calibrate, runner, server, synth
from cobali.batch import cli as batch_cli
from cobali.bench import cli as bench_cli
from cobali.sim import cli as sim_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobali", description="continuous batching over llama.cpp")
    parser.add_argument("--version", action="version", version=f"cobali {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for face in (runner, bench_cli, server, calibrate, sim_cli, batch_cli, synth):
        face.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        parser.exit(2, f"cobali {args.command}: error: {err}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
