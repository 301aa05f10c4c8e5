"""Files derived from a model file and kept beside it in Turnstile's cache (dequantized
weights, the tokenizer, the parsed GGUF header), keyed by the file's content and by the code
that derived them."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where artifacts derived from a model file are kept (dequantized weights, tokenizer)."""
    return Path(os.environ.get("TURNSTILE_CACHE") or Path.home() / ".cache" / "turnstile")


def derived_path(model: Path, name: str, readers: tuple[str, ...] = ()) -> Path:
    """A cache file derived from `model`, keyed by the file's content: a changed model misses,
    and the same model installed again (a fresh venv: new path, new mtime) hits, so the cache
    holds one copy of the dequantized weights per model, not one per install. With `readers`,
    the source files of the code deriving it, also keyed by their content: a newer reading is
    never hidden by an older one's file (which `write_derived` then removes)."""
    if readers:
        kind, dot, suffix = name.partition(".")
        code = hashlib.sha256(b"".join(Path(f).read_bytes() for f in readers)).hexdigest()
        name = f"{kind}-{code[:12]}{dot}{suffix}"
    return cache_dir() / f"{model.stem}-{content_digest(model)[:16]}" / name


def write_derived(path: Path, data: bytes | Callable[[Path], None]) -> bool:
    """`write_atomically`, then the files an older reading derived alike removed."""
    if not write_atomically(path, data):
        return False
    kind = path.name.partition("-")[0]
    for older in path.parent.glob(f"{kind}*{path.suffix}"):
        if older != path and older.name.startswith((f"{kind}-", f"{kind}.")):
            older.unlink(missing_ok=True)
    return True


def content_digest(model: Path) -> str:
    """SHA-256 of the file, remembered per (path, size, mtime, inode): hashing a large file is
    slow, and every service process asks at start."""
    stat = model.stat()
    identity = f"{model.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    memo = cache_dir() / "digests" / hashlib.sha256(identity.encode()).hexdigest()[:32]
    if memo.exists():
        return memo.read_text()
    with model.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    write_atomically(memo, digest.encode())
    return digest


def write_atomically(path: Path, data: bytes | Callable[[Path], None]) -> bool:
    """Store a cache file whole or not at all: `data`, or what `data(partial)` writes to the
    path it is given (raising OSError where it cannot). A cache is an optimisation: when it
    cannot be written (a full disk), the partial file goes and the caller carries on."""
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if callable(data):
            data(partial)
        else:
            partial.write_bytes(data)
        partial.replace(path)
    except OSError as error:
        with contextlib.suppress(OSError):  # a cache folder that is a file has no partial
            partial.unlink(missing_ok=True)
        log.warning("not caching %s: %s", path, error)
        return False
    return True
