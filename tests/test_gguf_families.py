"""Each family's GGUF file, proven against transformers: the random checkpoint of
`test_model_families.py`, written as GGUF with the `gguf` package as llama.cpp converts it
(`gguf_convert.py`), generates what transformers generates from the checkpoint (fp32, chunked,
with a preemption; top logprobs to 1e-4). A file asking for what is not read is refused at start,
naming the key or tensor. A load reports its progress."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf_convert import write_gguf
from test_model_families import _checkpoint, generates_what_transformers_generates

from turnstile.executor_svc.model import load_progress
from turnstile.executor_svc.model.weights import load_weights
from turnstile.kernels.quantized_weights import QuantizedWeight
from turnstile.shared.model_info import read_model_info

pytestmark = pytest.mark.slow  # loads transformers


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's files read and dequantized in a cache of its own, not left in the user's."""
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "cache"))


# Mistral and Mixtral are llama.cpp's "llama" architecture; Qwen3-MoE with experts on every
# layer, as llama.cpp's qwen3moe has them.
FAMILIES = ["linear", "llama3", "yarn", "mistral", "qwen2", "qwen3", "phi3", "phi4mini", "gemma2",
            "gemma3", "granite", "mixtral", "qwen3_moe", "olmo2"]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_gguf_file_generates_what_transformers_generates(
    family: str, tmp_path: Path
) -> None:
    model = _checkpoint(family, dense_layers=())
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / f"{family}.gguf")
    generates_what_transformers_generates(path, model, family, "cpu")


def test_a_smollm3_gguf_file_skips_rope_on_every_fourth_layer(tmp_path: Path) -> None:
    """llama.cpp stores no key for SmolLM3's layers without RoPE and fixes them at every fourth,
    transformers' default: a four-layer checkpoint's last layer."""
    import transformers
    from test_model_families import SHAPE

    config = transformers.SmolLM3Config(**{**SHAPE, "num_hidden_layers": 4}, pad_token_id=0)
    assert config.no_rope_layers == [1, 1, 1, 0]
    model = transformers.SmolLM3ForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "smollm3.gguf")
    assert read_model_info(path).nope_layers == (3,)
    generates_what_transformers_generates(path, model, "smollm3", "cpu")


@pytest.mark.parametrize(
    ("arch", "key", "value", "named"),
    [
        ("olmoe", None, None, "general.architecture = 'olmoe'"),
        ("llama", "llama.rope.scaling.type", "longrope", "llama.rope.scaling.type = 'longrope'"),
        (
            "llama",
            "llama.rope.scaling.type",
            "yarn",
            "llama.rope.scaling.original_context_length = None",
        ),
        (
            "qwen2",
            "qwen2.rope.scaling.yarn_log_multiplier",
            0.1,
            "qwen2.rope.scaling.yarn_log_multiplier = 0.1",
        ),
        ("qwen3moe", "qwen3moe.expert_shared_count", 1, "qwen3moe.expert_shared_count = 1"),
        ("llama", "llama.expert_gating_func", 2, "llama.expert_gating_func = 2"),
        ("phi3", "phi3.rope.dimension_count", 5, "phi3.rope.dimension_count = 5"),
        ("llama", "llama.rope.dimension_count", 6, "llama.rope.dimension_count = 6"),
    ],
)
def test_a_gguf_file_asking_for_what_is_not_read_is_refused_by_name(
    arch: str, key: str | None, value: object, named: str, tmp_path: Path
) -> None:
    from turnstile.shared.model_support import UnsupportedModel

    writer = gguf.GGUFWriter(tmp_path / "model.gguf", arch)
    writer.add_embedding_length(64)
    writer.add_head_count(8)
    if isinstance(value, str):
        writer.add_string(key, value)  # type: ignore[arg-type]
    elif isinstance(value, float):
        writer.add_float32(key, value)  # type: ignore[arg-type]
    elif value is not None:
        writer.add_uint32(key, value)  # type: ignore[arg-type]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match=f"model.gguf: {named}"):
        read_model_info(tmp_path / "model.gguf")


def test_a_load_reports_its_progress_by_file_and_by_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Lines while a sharded folder's files and a GGUF file's tensors load (every one here:
    the quiet first second and the pause between lines set to 0)."""
    monkeypatch.setattr(load_progress, "QUIET_S", 0.0)
    monkeypatch.setattr(load_progress, "EVERY_S", 0.0)
    _checkpoint("qwen2").save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    shards = len(list((tmp_path / "hf").glob("*.safetensors")))
    assert shards > 1
    gguf_path = write_gguf(tmp_path / "hf", tmp_path / "model.gguf")
    tensors = len(gguf.GGUFReader(gguf_path).tensors)
    caplog.set_level("INFO", logger=load_progress.__name__)
    for path in (tmp_path / "hf", gguf_path):
        load_weights(path, read_model_info(path))
    lines = [r.getMessage() for r in caplog.records if r.name == load_progress.__name__]
    assert lines[0].startswith(f"loading hf: 1/{shards} files")
    assert lines[shards - 1].startswith(f"loading hf: {shards}/{shards} files (100%")
    assert lines[-1].startswith(f"loading model.gguf: {tensors}/{tensors} tensors (100%")
    assert len(lines) == shards + tensors + 1  # the GGUF's: one before each tensor, one at the end


@pytest.mark.parametrize(("family", "positions"), [("phi3", [3, 255, 256, 511]),
                                                   ("llama3", [3, 40, 200, 511])])  # fmt: skip
def test_a_gguf_files_rope_factors_rotate_each_position_as_transformers_does(
    family: str, positions: list[int], tmp_path: Path
) -> None:
    """Llama 3's scaling read back from each frequency's divisor, Phi-3's longrope from its
    factor tensors and attention factor (the long factors past 256 positions, which the
    generation test above does not reach): transformers' rotary embedding, position by
    position (3e-5: transformers' float32 frequencies, times 511, drift 1e-5 from exact)."""
    import torch

    from turnstile.executor_svc.model.rope import rope_rotations

    model = _checkpoint(family)
    model.save_pretrained(tmp_path / "hf")
    rotations = rope_rotations(read_model_info(write_gguf(tmp_path / "hf", tmp_path / "m.gguf")))
    for position in positions:
        cos, sin = model.model.rotary_emb(torch.zeros(1, 1, 128), torch.tensor([[position]]))
        half = cos.shape[-1] // 2
        torch.testing.assert_close(rotations[position].real, cos[0, 0, :half], atol=3e-5, rtol=0)
        torch.testing.assert_close(rotations[position].imag, sin[0, 0, :half], atol=3e-5, rtol=0)


def test_a_quantized_phi3_files_fused_matrices_are_split_in_their_blocks(tmp_path: Path) -> None:
    """Phi-3's qkv and gate-up matrices kept in their Q8_0 blocks are split by rows as the
    dequantized file's are: each part's blocks hold the dequantized part's values."""
    import torch

    _checkpoint("phi3").save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    info = read_model_info(path)
    dense, kept = load_weights(path, info), load_weights(path, info, quantized=True)
    assert dense.keys() == kept.keys()
    names = ("self_attn.q", "self_attn.k", "self_attn.v", "mlp.gate", "mlp.up")
    parts = [f"model.layers.{i}.{p}_proj.weight" for i in range(info.num_layers) for p in names]
    for name in parts:
        assert isinstance(kept[name], QuantizedWeight), name
        torch.testing.assert_close(kept[name].dequantize(), dense[name], atol=0, rtol=0)
