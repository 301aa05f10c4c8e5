"""Settings: one dataclass field per setting, and flags, TURNSTILE_* variables and a YAML file
bound to it in that order of precedence."""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from turnstile.cli import COMMANDS, build_parser, main, settings_of
from turnstile.launcher import ServeConfig, stack
from turnstile.shared.settings import SettingError, leaves


def bound(argv: list[str], environ: dict[str, str] | None = None) -> ServeConfig:
    return settings_of(build_parser().parse_args(argv), environ or {})


def test_a_flag_beats_a_variable_beats_the_file_beats_the_default(tmp_path: Path) -> None:
    file = tmp_path / "serve.yaml"
    file.write_text("port: 7000\nblock-size: 64\nmax_num_seqs: 8\nenable-prefix-caching: false\n")
    environ = {"TURNSTILE_PORT": "8100", "TURNSTILE_BLOCK_SIZE": "32"}
    config = bound(["serve", "--config", str(file), "--port", "9000"], environ)
    assert config.gateway.port == 9000  # flag
    assert config.engine.block_size == 32  # variable
    assert config.engine.max_num_seqs == 8  # file
    assert config.scheduling.enable_prefix_caching is False  # file
    assert config.scheduling.max_num_batched_tokens is None  # 2048, or an encoder's context
    assert bound(["serve"]) == ServeConfig()


def test_booleans_and_unset_values_from_variables_and_flags() -> None:
    config = bound(["serve"], {"TURNSTILE_ENABLE_PREFIX_CACHING": "0", "TURNSTILE_API_KEY": ""})
    assert config.scheduling.enable_prefix_caching is False and config.gateway.api_key is None
    config = bound(["serve", "--no-enable-prefix-caching", "--enforce-eager", "--max-waiting", "4"])
    assert not config.scheduling.enable_prefix_caching and config.executor.enforce_eager
    assert config.admission.max_waiting == 4
    assert bound(["serve", "--max-model-len", "none"]).engine.max_model_len is None


def test_a_list_is_words_or_a_json_array_as_vllms_flags_take_it() -> None:
    both = ("http://a.example", "http://b.example")
    given = [
        bound(["serve", "--allowed-origins", *both]),
        bound(["serve", "--allowed-origins", '["http://a.example", "http://b.example"]']),
        bound(["serve"], {"TURNSTILE_ALLOWED_ORIGINS": "http://a.example http://b.example"}),
        bound(["serve"], {"TURNSTILE_ALLOWED_ORIGINS": '["http://a.example", "http://b.example"]'}),
    ]
    assert [config.gateway.allowed_origins for config in given] == [both] * 4
    assert bound(["serve"]).gateway.allowed_origins == ("*",)  # vLLM's default


@pytest.mark.parametrize(
    ("argv", "environ", "file", "named"),
    [
        (["--block-size", "abc"], {}, "", "--block-size"),
        ([], {"TURNSTILE_KV_CACHE_GIB": "lots"}, "", "$TURNSTILE_KV_CACHE_GIB"),
        ([], {}, "block-size: [1]\n", "block_size in"),
        ([], {}, "blok-size: 16\n", "'blok_size'"),
        ([], {}, "- a list\n", "a mapping"),
        (["--allowed-origins", '["http://a.example",'], {}, "", "is not a JSON array"),
        (
            ["--block-size", "0"],
            {},
            "",
            "--block-size, --max-num-seqs and --tensor-parallel-size must be positive",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_it(
    tmp_path: Path, argv: list[str], environ: dict[str, str], file: str, named: str
) -> None:
    if file:
        (tmp_path / "bad.yaml").write_text(file)
        argv = [*argv, "--config", str(tmp_path / "bad.yaml")]
    with pytest.raises(SettingError, match=named.replace("$", r"\$").replace("[", r"\[")):
        bound(["serve", *argv], environ)


def test_the_command_line_reports_a_bad_setting_as_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["scheduler", "--policy", "lifo"])
    assert exit_.value.code == 2 and "--policy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["gateway", "--config", "/nonexistent.yaml"])
    assert exit_.value.code == 2 and "/nonexistent.yaml" in capsys.readouterr().err


def test_no_setting_has_its_default_written_twice() -> None:
    """Each setting is one field of one settings class; every flag of a command that takes
    settings is one of them, and none has a default of its own (argparse's is SUPPRESS)."""
    owners: dict[str, set[type]] = defaultdict(set)
    for _, settings, _ in COMMANDS.values():
        for owner, field, _ in leaves(settings):
            owners[field.name].add(owner)
            assert field.default is not dataclasses.MISSING, field.name
    twice = {name: classes for name, classes in owners.items() if len(classes) > 1}
    assert not twice
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    plain = {"help", "config", "input", "output"}  # not settings: no default to duplicate
    for name, (_, settings, _) in COMMANDS.items():
        actions = [a for a in subparsers.choices[name]._actions if a.dest not in plain]
        assert {a.dest for a in actions} == {field.name for _, field, _ in leaves(settings)}
        assert all(a.default is argparse.SUPPRESS for a in actions), name


def test_serve_hands_each_service_its_settings(tmp_path: Path) -> None:
    config = bound(["serve", "--metrics-port", "9300", "--port", "8123", "--block-size", "32"])
    scheduler, executor, gateway = stack(config, tmp_path)
    assert [s.name for s in (scheduler, executor, gateway)] == ["scheduler", "executor", "gateway"]
    socket = f"ipc://{tmp_path}/scheduler.sock"
    assert scheduler.config.addresses.scheduler_address == socket
    assert gateway.config.addresses == scheduler.config.addresses == executor.config.addresses
    assert scheduler.config.metrics.metrics_port == 9300
    assert executor.config.metrics.metrics_port == 9301
    assert executor.config.runner.engine.block_size == scheduler.config.engine.block_size == 32
    assert gateway.config.gateway.port == 8123
