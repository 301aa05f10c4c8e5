"""Settings: frozen dataclasses are their only source; flags, TURNSTILE_* variables and a YAML
file (`--config`, keys as the flags' names) bind to them here. A flag beats a variable, a
variable beats the file, the file beats the field's default.

A settings class holds either settings (fields made with `setting`) or other settings classes
(a service's whole configuration), and each class of settings is one group in `--help`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

ENV_PREFIX = "TURNSTILE_"
# A service's exit status when it refuses its settings at start (sysexits' EX_CONFIG): starting
# it again would only refuse them again, so `turnstile serve` stops.
REFUSED = 78


class SettingError(ValueError):
    """A setting's value that does not fit it; the message names the setting and its source."""


def setting(default: Any, help: str, alias: str | None = None) -> Any:
    """A field of a settings class: its one default and its one line of help; `alias`: a second
    flag name (vLLM's, where ours differs)."""
    return dataclasses.field(default=default, metadata={"help": help, "alias": alias})


def nested(cls: type) -> Any:
    """A field holding a whole settings class, at its defaults."""
    return dataclasses.field(default_factory=cls)


def leaves(cls: type) -> Iterator[tuple[type, dataclasses.Field, Any]]:
    """Every setting under `cls`: (the class that holds it, its field, its type)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from leaves(hint)  # type: ignore[arg-type]
        else:
            yield cls, field, hint


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _choices(hint: Any) -> list[str] | None:
    options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return list(options)
    if len(options) == 1 and typing.get_origin(options[0]) is typing.Literal:
        return list(typing.get_args(options[0]))
    return None


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(hint)
    )


def add_settings(parser: argparse.ArgumentParser, cls: type) -> None:
    """One `--flag` per setting under `cls`, grouped by settings class, and `--config FILE`.
    Flags default to absent, so that `bind` knows which were given."""
    parser.add_argument("--config", metavar="FILE", help="YAML settings; keys as the flags")
    groups: dict[type, argparse._ArgumentGroup] = {}
    for owner, field, hint in leaves(cls):
        if owner not in groups:
            groups[owner] = parser.add_argument_group((owner.__doc__ or "").split("\n")[0])
        shown = "none" if field.default is None else field.default
        text = f"{field.metadata['help']} (default: {shown}; ${env_name(field.name)})"
        options: dict[str, Any] = {"default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if hint is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif _is_list(hint):
            options["nargs"] = "+"
            options["metavar"] = field.name.split("_")[-1].upper()
        else:
            options["choices"] = _choices(hint)
            options["metavar"] = None if options["choices"] else field.name.split("_")[-1].upper()
        alias = field.metadata.get("alias")
        names = [flag(field.name), *([f"--{alias}"] if alias else [])]
        groups[owner].add_argument(*names, dest=field.name, **options)


def _is_dict(hint: Any) -> bool:
    return any(typing.get_origin(arg) is dict for arg in (hint, *typing.get_args(hint)))


def _is_list(hint: Any) -> bool:
    return any(typing.get_origin(arg) in (list, tuple) for arg in (hint, *typing.get_args(hint)))


def _json_array(words: list[Any]) -> bool:
    return len(words) == 1 and isinstance(words[0], str) and words[0].startswith("[")


def _convert(value: Any, hint: Any, source: str) -> Any:
    if isinstance(value, str) and _optional(hint) and value.lower() in ("", "none", "null"):
        return None
    if isinstance(value, str) and _is_list(hint):
        value = [value] if value.startswith("[") else value.split()  # a variable: words
    if _is_list(hint) and isinstance(value, list) and _json_array(value):
        try:
            value = msgspec.json.decode(value[0])  # as vLLM's flags take lists
        except msgspec.DecodeError as exc:
            raise SettingError(f"{source}: {value[0]!r} is not a JSON array ({exc})") from None
    if isinstance(value, str) and _is_dict(hint):
        try:
            value = msgspec.json.decode(value)  # a flag or a variable holds a mapping as JSON
        except msgspec.DecodeError as exc:
            raise SettingError(f"{source}: {value!r} is not a JSON object ({exc})") from None
    try:
        return msgspec.convert(value, hint, strict=not isinstance(value, str))
    except msgspec.ValidationError as exc:
        raise SettingError(f"{source}: {value!r} is not valid ({exc})") from None


def read_file(path: Path) -> dict[str, Any]:
    """A YAML mapping of setting names (as flags, without the dashes) to values."""
    try:
        content = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise SettingError(f"--config {path}: {exc}") from None
    if not isinstance(content, dict):
        raise SettingError(f"--config {path}: expected a mapping of settings to values")
    return {str(key).replace("-", "_"): value for key, value in content.items()}


def bind(
    cls: type,
    flags: Mapping[str, Any],
    environ: Mapping[str, str] = os.environ,
    file: Path | None = None,
) -> Any:
    """An instance of `cls` from the flags given (parsed by a parser `add_settings` built), the
    TURNSTILE_* variables set, and the file's settings."""
    from_file = read_file(file) if file else {}
    known = {field.name: hint for _, field, hint in leaves(cls)}
    unknown = sorted(set(from_file) - set(known))
    if unknown:
        raise SettingError(f"--config {file}: unknown setting {unknown[0]!r} for this command")
    values: dict[str, Any] = {}
    for name, hint in known.items():
        if name in flags:
            values[name] = _convert(flags[name], hint, flag(name))
        elif environ.get(env_name(name), "") != "":
            values[name] = _convert(environ[env_name(name)], hint, f"${env_name(name)}")
        elif name in from_file:
            values[name] = _convert(from_file[name], hint, f"{name} in {file}")
    try:
        return build(cls, **values)
    except (TypeError, ValueError) as exc:
        raise SettingError(str(exc)) from None


def build(cls: type, **values: Any) -> Any:
    """An instance of `cls` from settings by name, wherever they nest; the rest at defaults."""
    unknown = sorted(set(values) - {field.name for _, field, _ in leaves(cls)})
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {unknown[0]!r}")
    return _build(cls, values)


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    given: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            given[field.name] = _build(hint, values)  # type: ignore[arg-type]
        elif field.name in values:
            given[field.name] = values[field.name]
    return cls(**given)
