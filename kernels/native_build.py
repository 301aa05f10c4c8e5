"""The native CPU kernels' build: the sources compiled with the system C compiler, each on a
core of its own, linked into one shared library cached by a digest of the sources and flags."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from turnstile.shared.derived_files import cache_dir

log = logging.getLogger(__name__)

NATIVE = Path(__file__).parent / "native"
SOURCES = sorted(NATIVE.glob("*.c"))
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
FLAGS += ["-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types"]  # gcc 14
LIBRARIES = ["-lm"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def library_path() -> Path:
    """Where the build of these sources with these flags is cached."""
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for source in sorted(NATIVE.glob("*.[ch]")):
        digest.update(source.read_bytes())
    return cache_dir() / "native" / f"turnstile-{digest.hexdigest()[:16]}.so"


def build(compiler: str = "cc") -> Path:
    """Compile the sources into a shared library in the cache, unless it is already there."""
    target = library_path()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            objects = compile_objects(SOURCES, Path(folder), compiler)
            _run([compiler, *FLAGS, *map(str, objects), *LIBRARIES, "-o", str(partial)])
        partial.replace(target)
        log.info("built the native CPU kernels: %s", target)
    return target


def compile_objects(sources: list[Path], folder: Path, compiler: str = "cc") -> list[Path]:
    """Each source compiled as the library's are, to an object in `folder`, as many at once as
    there are cores (one command for them all compiles one after another)."""
    flags = [flag for flag in FLAGS if flag != "-shared"]
    objects = [folder / f"{source.stem}.o" for source in sources]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        commands = [[compiler, *flags, "-c", str(source), "-o", str(target)]
                    for source, target in zip(sources, objects, strict=True)]  # fmt: skip
        list(pool.map(_run, commands))  # the first failure raises, its stderr with it
    return objects


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)
