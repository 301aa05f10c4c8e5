"""`turnstile <command>`: one entry point for every service, offline generation and benchmarks."""

from __future__ import annotations

import argparse
import sys


def _bench_scheduler(args: argparse.Namespace) -> None:
    from bench.scheduler_bench import format_table, run

    print(format_table(run(steps=args.steps, repeats=args.repeats)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", required=True
    )
    scheduler = bench.add_parser("scheduler", help="scheduler alone, simulated executor")
    scheduler.add_argument("--steps", type=int, default=300, help="timed steps per run")
    scheduler.add_argument("--repeats", type=int, default=5, help="runs per workload")
    scheduler.set_defaults(handler=_bench_scheduler)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.handler(args)


if __name__ == "__main__":
    main(sys.argv[1:])
