"""Every benchmark module imports: most run only by hand or on a GPU, so an import that a
refactor broke would otherwise surface at the next measurement."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"))
def test_the_module_imports(name: str) -> None:
    importlib.import_module(f"bench.{name}")
