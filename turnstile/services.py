"""What the commands besides the services run: offline generation, cache preparation, keys.
Heavy imports stay inside each command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.shared.config import EngineConfig, SchedulingConfig
from turnstile.shared.settings import nested


@dataclass(slots=True, frozen=True)
class GenerateConfig:
    runner: RunnerConfig = nested(RunnerConfig)
    scheduling: SchedulingConfig = nested(SchedulingConfig)


def generate(config: GenerateConfig, args: argparse.Namespace) -> None:
    from turnstile.generate import generate_file

    generate_file(Path(args.input), Path(args.output), config.runner, config.scheduling)


def prepare(config: EngineConfig, _: argparse.Namespace) -> None:
    """Build the caches a first start would otherwise build: model header, tokenizer,
    dequantized weights, the native CPU kernels. Later starts only map files."""
    from turnstile.executor_svc.model.weights import load_weights
    from turnstile.kernels import cpu_native
    from turnstile.shared.tokenizer import served_tokenizer

    path = config.model_path
    info = config.model_info()
    served_tokenizer(config, info)
    load_weights(path, info)
    native = cpu_native.library()
    print(f"prepared {path}; native CPU kernels: {'built' if native else 'unavailable'}")


def keygen(_: argparse.Namespace) -> None:
    """Print a secret key; give every service the same one to encrypt and authenticate their
    ZeroMQ links (a cross-host deployment should)."""
    import zmq

    print(zmq.curve_keypair()[1].decode())
