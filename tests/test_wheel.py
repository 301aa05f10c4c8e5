"""The built wheel: one top-level package, `turnstile`, and, installed into a fresh virtual
environment outside the checkout, a stack that serves from a `--config` file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import free_ports, healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = (
    "turnstile",
    "shared",
    "scheduler_svc",
    "executor_svc",
    "gateway_svc",
    "kernels",
    "bench",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(ROOT)],
        check=True,
    )  # fmt: skip
    return next(out.glob("turnstile-*.whl"))


def test_the_wheel_holds_one_top_level_package_with_every_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {
        "turnstile",
        wheel.name.split("-py")[0] + ".dist-info",
    }
    for folder in FOLDERS:
        for source in (ROOT / folder).rglob("*.py"):
            inside = source.relative_to(ROOT / folder)
            prefix = "turnstile" if folder == "turnstile" else f"turnstile/{folder}"
            assert f"{prefix}/{inside}" in names
    assert "turnstile/kernels/native/gemm.c" in names  # compiled where it runs


def test_the_installed_wheel_serves_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True
    )
    # The dependencies come from this environment (torch alone would be GBs to download); added
    # after the install, so that pip never sees this checkout's editable install.
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TURNSTILE_LOG": "WARNING"}
    where = subprocess.run(
        [python, "-c", "import turnstile.scheduler_svc as m; print(m.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=env,
    ).stdout  # fmt: skip
    assert where.startswith(site)

    port = free_ports(1)[0]
    config = tmp_path / "serve.yaml"
    config.write_text(f"port: {port}\nnum-blocks: 64\nmax-num-seqs: 4\n")
    serve = subprocess.Popen(
        [venv / "bin" / "turnstile", "serve", "--config", str(config)], cwd=tmp_path, env=env
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not healthy(url):
            assert serve.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answer = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert answer.usage.completion_tokens == 4 and answer.choices[0].text
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0
