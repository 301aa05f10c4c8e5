"""Hugging Face transformers' static `generate` on the same prompts and model: the baseline the
benchmarks put beside Turnstile.

Prompts run in batches (left-padded when their lengths differ), EOS ignored, each batch as many
steps as its longest request. A logits processor stamps every step, so each request gets a time
to first token (all requests start at once, so later batches wait for earlier ones, as they
would behind a static server) and a time per output token.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_model

from turnstile.executor_svc.cpu_runtime import native_bf16_matmul
from turnstile.shared.derived_files import derived_path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HfRun:
    output_tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)  # per request
    tpot: list[float] = field(default_factory=list)  # per request

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def median_tpot_ms(self) -> float:
        return statistics.median(self.tpot) * 1000

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(self.ttft)


class _StepClock:
    """A logits processor that only records when each step's logits are ready."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def best_dtype() -> torch.dtype:
    """HF's fastest dtype on this CPU: bf16 only where torch multiplies it in hardware."""
    return torch.bfloat16 if native_bf16_matmul(torch.device("cpu")) else torch.float32


def load_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = _from_gguf(path).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    # Like ignore_eos: run past EOS (min_new_tokens would instead forbid EOS and change tokens).
    model.generation_config.eos_token_id = None
    return model.eval()


def _from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own reading of a GGUF file (float32), kept as a Hugging Face folder in the
    model's cache: its GGUF loader parses the vocabulary and maps the tensor names for ~27 s a
    load here, where the folder loads in ~2 s. Where the cache cannot be written, not kept."""
    import transformers
    from transformers import AutoModelForCausalLM

    folder = derived_path(path, f"hf-transformers-{transformers.__version__}")
    if folder.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.tmp")
    try:
        # transformers will not save a model it loaded from GGUF (it counts as quantized), so
        # its config less the GGUF marker and its weights (the tied embedding once).
        config = model.config.to_dict()
        del config["quantization_config"]
        partial.mkdir(parents=True)
        (partial / "config.json").write_text(json.dumps(config))
        save_model(model, str(partial / "model.safetensors"))
        partial.replace(folder)  # whole or not at all
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        log.warning("not caching %s: %s", folder, error)
    return model


def generate(
    model: torch.nn.Module, prompts: list[list[int]], output_lens: list[int], batch: int
) -> HfRun:
    from transformers import LogitsProcessorList

    run = HfRun()
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch):
            chunk = prompts[first : first + batch]
            wanted = output_lens[first : first + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device
            )
            clock = _StepClock()
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(wanted),
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
            stamps = clock.stamps
            for count in wanted:
                run.ttft.append(stamps[0] - started)
                if count > 1:
                    run.tpot.append((stamps[count - 1] - stamps[0]) / (count - 1))
            run.output_tokens += sum(wanted)
    run.seconds = time.perf_counter() - started
    return run
