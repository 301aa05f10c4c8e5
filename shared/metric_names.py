"""Our Prometheus series under vLLM's names (`--metrics-names vllm`): `vllm:` in place of
`turnstile:` and each sample labelled with the model's name and engine 0, as vLLM labels its
own, so that dashboards, alerts, autoscalers and routers written for vLLM read them unchanged."""

from __future__ import annotations

import re

# A series' name where a line starts, or after HELP or TYPE; `{` where its labels start.
_NAME = re.compile(rb"^(# (?:HELP|TYPE) )?turnstile:([A-Za-z_:][A-Za-z0-9_:]*)(\{)?", re.M)


def as_vllms(text: bytes, model_name: str) -> bytes:
    """`text` (Prometheus's text format) with every `turnstile:` series renamed `vllm:`, and
    `model_name` and `engine="0"` added to every sample's labels."""
    value = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    labels = f'model_name="{value}",engine="0"'.encode()

    def renamed(found: re.Match[bytes]) -> bytes:
        comment, name, brace = found.groups()
        if comment:
            return comment + b"vllm:" + name
        return b"vllm:" + name + b"{" + labels + (b"," if brace else b"}")

    return _NAME.sub(renamed, text)
