"""Each family's GGUF file, proven against transformers: the random checkpoint of
`test_model_families.py`, written as GGUF with the `gguf` package as llama.cpp converts it
(`gguf_convert.py`), generates what transformers generates from the checkpoint (fp32, chunked,
with a preemption; top logprobs to 1e-4). A file asking for what is not read is refused at start,
naming the key or tensor."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_convert import write_gguf
from test_model_families import _checkpoint, generates_what_transformers_generates

pytestmark = pytest.mark.slow  # loads transformers


# Mistral and Mixtral are llama.cpp's "llama" architecture; Qwen3-MoE with experts on every
# layer, as llama.cpp's qwen3moe has them.
@pytest.mark.parametrize(
    "family", ["linear", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
)
def test_a_family_gguf_file_generates_what_transformers_generates(
    family: str, tmp_path: Path
) -> None:
    model = _checkpoint(family, dense_layers=())
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / f"{family}.gguf")
    generates_what_transformers_generates(path, model, family, "cpu")


@pytest.mark.parametrize(
    ("arch", "key", "value", "named"),
    [
        ("phi3", None, None, "general.architecture = 'phi3'"),
        ("llama", "llama.rope.scaling.type", "yarn", "llama.rope.scaling.type = 'yarn'"),
        ("qwen3moe", "qwen3moe.expert_shared_count", 1, "qwen3moe.expert_shared_count = 1"),
        ("llama", "llama.expert_gating_func", 2, "llama.expert_gating_func = 2"),
        ("llama", None, None, "tensor rope_freqs.weight"),
    ],
)
def test_a_gguf_file_asking_for_what_is_not_read_is_refused_by_name(
    arch: str, key: str | None, value: object, named: str, tmp_path: Path
) -> None:
    from turnstile.shared.model_info import read_model_info
    from turnstile.shared.model_support import UnsupportedModel

    writer = gguf.GGUFWriter(tmp_path / "model.gguf", arch)
    if isinstance(value, str):
        writer.add_string(key, value)  # type: ignore[arg-type]
    elif value is not None:
        writer.add_uint32(key, value)  # type: ignore[arg-type]
    writer.add_tensor("rope_freqs.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match=f"model.gguf: {named}"):
        read_model_info(tmp_path / "model.gguf")
