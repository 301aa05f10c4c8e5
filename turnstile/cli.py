"""`turnstile <command>`: every service, the whole stack, offline generation and benchmarks.

Every setting is a field of one settings dataclass; flags, TURNSTILE_* variables and
`--config FILE` (YAML) bind to it (turnstile/shared/settings.py)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from turnstile import bench_parsers, services
from turnstile.executor_svc.runner_config import ExecutorServiceConfig
from turnstile.gateway_svc.config import GatewayServiceConfig
from turnstile.launcher import ServeConfig, Service, configure_logging, run_service, serve
from turnstile.scheduler_svc.service_config import SchedulerServiceConfig
from turnstile.shared.config import EngineConfig
from turnstile.shared.settings import SettingError, add_settings, bind


def _service(name: str) -> Callable[[Any, argparse.Namespace], None]:
    return lambda config, _: run_service(Service(name, config))


# command: (help, its settings class, what runs it with those settings and the parsed flags)
COMMANDS: dict[str, tuple[str, type, Callable[[Any, argparse.Namespace], None]]] = {
    "serve": ("the whole stack on this host", ServeConfig, lambda config, _: serve(config)),
    "scheduler": ("the scheduler service", SchedulerServiceConfig, _service("scheduler")),
    "executor": (
        "the executor: the model on its device",
        ExecutorServiceConfig,
        _service("executor"),
    ),
    "gateway": ("the OpenAI-compatible HTTP gateway", GatewayServiceConfig, _service("gateway")),
    "generate": (
        "offline batch generation, JSON lines",
        services.GenerateConfig,
        services.generate,
    ),
    "prepare": ("build the model caches ahead of a start", EngineConfig, services.prepare),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turnstile", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (text, settings, run) in COMMANDS.items():
        command = commands.add_parser(name, help=text, description=text)
        add_settings(command, settings)
        command.set_defaults(settings=settings, run=run)
    generate = commands.choices["generate"]
    generate.add_argument("--input", required=True, help="JSON lines: prompt or messages")
    generate.add_argument("--output", required=True)
    keygen = commands.add_parser(
        "keygen", help="a ZeroMQ CURVE secret key for TURNSTILE_CURVE_SECRET_KEY"
    )
    keygen.set_defaults(handler=services.keygen)
    bench_parsers.add_parsers(commands.add_parser("bench", help="benchmarks"))
    return parser


def settings_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Any:
    """The parsed command's settings: its flags, then TURNSTILE_* variables, then its file."""
    return bind(args.settings, vars(args), environ, Path(args.config) if args.config else None)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.command)
    if "settings" not in args:
        args.handler(args)
        return
    try:
        config = settings_of(args)
    except SettingError as exc:
        parser.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        args.run(config, args)


if __name__ == "__main__":
    main(sys.argv[1:])
