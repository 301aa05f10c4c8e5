"""gpt-oss as llama.cpp's converter writes it (architecture `gpt-oss`, `gguf_convert.py`): its
sinks, biases, yarn RoPE and every other layer sliding, as no key but the window says; in
float32 it generates what transformers generates from the checkpoint. Its experts in MXFP4
(GGML type 39) stay in their blocks on the cpu backend and compute what the same blocks of
OpenAI's checkpoint compute (`test_gpt_oss.py` holds those to transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
from conftest import fixed_length_requests
from gguf_convert import write_gguf
from test_fused_decode_layers import same_generations
from test_gpt_oss import _as_mxfp4, _gpt_oss
from test_model_families import PROMPTS, generates_what_transformers_generates

from turnstile.executor_svc.backends.block_experts import BlockExperts
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.gguf_info import gguf_fields
from turnstile.shared.protocol import SamplingParams
from turnstile.shared.settings import build

pytestmark = pytest.mark.slow  # loads transformers


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "cache"))


def test_a_gpt_oss_gguf_file_generates_what_transformers_generates(tmp_path: Path) -> None:
    model = _gpt_oss(tmp_path / "hf", swiglu_limit=7.0)  # no key holds it: llama.cpp fixes 7
    path = write_gguf(tmp_path / "hf", tmp_path / "gpt-oss.gguf")
    fields = gguf_fields(path)
    assert fields["layer_windows"] == (24, 0) and fields["rope_scaling"]["truncate"] is False
    assert fields["attention_sinks"] and fields["chat_format"] == "harmony"
    assert (fields["swiglu_limit"], fields["swiglu_alpha"]) == (7.0, 1.702)
    generates_what_transformers_generates(path, model, "gpt_oss", "cpu")


def test_a_gpt_oss_gguf_files_mxfp4_experts_compute_on_their_blocks(tmp_path: Path) -> None:
    """The file's MXFP4 experts kept, their bytes the file's: the same tokens and logprobs as
    OpenAI's checkpoint of the same blocks, alike alone and batched."""
    _gpt_oss(tmp_path / "dense", swiglu_limit=7.0)
    _as_mxfp4(tmp_path / "dense", tmp_path / "mxfp4")
    path = write_gguf(tmp_path / "mxfp4", tmp_path / "gpt-oss-mxfp4.gguf")
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    results = {}
    for model in (path, tmp_path / "mxfp4"):
        config = build(RunnerConfig, model=str(model), num_blocks=64, max_num_seqs=4)
        engine = OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=64))
        assert all(isinstance(layer.experts, BlockExperts) for layer in engine.runner.model.layers)

        def generate(prompts: list[list[int]], engine: OfflineEngine = engine) -> list[Any]:
            return engine.generate(fixed_length_requests(prompts, SamplingParams(logprobs=5), 24))

        results[model] = generate(PROMPTS)
        same_generations([generate([p])[0] for p in PROMPTS], results[model], atol=0)
    same_generations(*results.values(), atol=1e-5)


def test_a_gpt_oss_gguf_file_ends_where_its_generation_config_would(tmp_path: Path) -> None:
    """<|return|>, <|endoftext|> and <|call|> end an answer, the file's eos first."""
    writer = gguf.GGUFWriter(tmp_path / "ends.gguf", "gpt-oss")
    for key, value in (("context_length", 64), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 64), ("attention.head_count", 2)):  # fmt: skip
        writer.add_uint32(f"gpt-oss.{key}", value)
    writer.add_float32("gpt-oss.attention.layer_norm_rms_epsilon", 1e-5)
    tokens = ["a", "<|endoftext|>", "b", "<|return|>", "<|call|>", "<|end|>"]
    writer.add_token_list(tokens)
    writer.add_eos_token_id(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_fields(tmp_path / "ends.gguf")["eos_token_ids"] == (3, 1, 4)


def test_a_gpt_oss_gguf_files_tokenizer_is_its_vocabularys(tmp_path: Path) -> None:
    """Built from the file's vocabulary (transformers' reader of the whole file fails on its
    yarn keys): the embedded model's vocabulary in a gpt-oss file tokenizes as that model."""
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import Tokenizer

    source = gguf.GGUFReader(embedded_model_path())
    writer = gguf.GGUFWriter(tmp_path / "vocabulary.gguf", "gpt-oss")
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(32.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_model_info(embedded_model_path())
    ours, theirs = (Tokenizer(path, info) for path in (tmp_path / "vocabulary.gguf",
                                                        embedded_model_path()))  # fmt: skip
    text = "Hello, world! 12345 <|im_start|>user\n  spaces\tand ünïcödé"
    assert ours.encode(text) == theirs.encode(text) and len(ours.encode(text)) > 10
