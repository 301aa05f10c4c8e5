"""The native CPU kernels' build (kernels/native_build.py): it happens here, is cached by the
sources' digest, keeps what the sources ask of the compiler, and is None (the torch kernels
then) without a compiler or where it fails."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from turnstile.kernels import cpu_native, native_build


def test_the_library_builds_on_this_machine() -> None:
    """AVX2, FMA and gcc are here: the production path must be the native one, not a fallback."""
    assert {"avx2", "fma"} <= native_build.cpu_flags()
    assert cpu_native.library() is not None


def test_a_build_is_cached_by_source_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The library built for these sources and flags (by the test above, or `turnstile
    prepare`) is found again, not rebuilt; other flags name another, not built yet."""
    first = native_build.build()
    stamp = first.stat().st_mtime_ns
    assert native_build.build() == first and first.stat().st_mtime_ns == stamp
    # Other flags, another library: where nothing is built yet (so `build` compiles there).
    monkeypatch.setattr(native_build, "FLAGS", [*native_build.FLAGS, "-DTURNSTILE_TEST"])
    assert native_build.library_path() != first and not native_build.library_path().exists()


def _text_with_headers(source: Path) -> str:
    """A source's text and that of the local headers it includes, and theirs."""
    text, seen, queue = "", set(), [source]
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        body = path.read_text()
        text += body
        queue += [path.parent / name for name in re.findall(r'#include "([^"]+)"', body)]
    return text


@pytest.mark.slow  # compiles the sources again, a few seconds
def test_every_source_that_prefetches_still_does_once_compiled(tmp_path: Path) -> None:
    """gcc takes a function that only prefetches for one without effects and drops its calls:
    session 29's attention prefetch was never in the library (docs/benchmarks.md, session 30).
    Each source that asks for lines ahead is compiled as the library is, and its object must
    hold prefetch instructions."""
    asking = [s for s in native_build.SOURCES if "_mm_prefetch" in _text_with_headers(s)]
    assert {"attention.c", "attention_tiles.c", "gemm.c"} <= {s.name for s in asking}
    objects = native_build.compile_objects(asking, tmp_path)
    for source, compiled in zip(asking, objects, strict=True):
        code = subprocess.run(
            ["objdump", "-d", str(compiled)], capture_output=True, text=True, check=True
        ).stdout
        assert re.search(r"\sprefetch(t0|t1|t2|nta)\s", code), source.name


@pytest.mark.slow
def test_without_a_compiler_or_with_a_failing_build_the_library_is_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path))  # nothing built here yet
    try:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_native.shutil, "which", lambda _: None)
            cpu_native.library.cache_clear()
            assert cpu_native.library() is None
        assert "no C compiler" in caplog.text
        monkeypatch.setattr(native_build, "FLAGS", [*native_build.FLAGS, "-fno-such-flag"])
        cpu_native.library.cache_clear()
        assert cpu_native.library() is None
        assert "failed to build" in caplog.text and "no-such-flag" in caplog.text
    finally:
        cpu_native.library.cache_clear()  # the next caller gets the real build again
