"""A GGUF file's tokenizer, built from its vocabulary by our header reader and transformers'
converter, is the one transformers' `AutoTokenizer` builds from the file: sentencepiece and
byte-level vocabularies, with and without the file's BOS and EOS flags."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.tokenizer import Tokenizer

LETTERS = [chr(c) for c in range(97, 123)]
TEXT = "hello world, he said"


def _sentencepiece(writer: gguf.GGUFWriter) -> None:
    pieces = ["<unk>", "<s>", "</s>", "▁", *LETTERS, *("▁" + c for c in LETTERS),
              "he", "ll", "▁he", "llo", "▁hello", "▁world", "or", "ld", ","]  # fmt: skip
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(len(pieces) - 3)])
    writer.add_token_types([2, 3, 3] + [1] * (len(pieces) - 3))


def _byte_level(writer: gguf.GGUFWriter) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["h e", "l l", "Ġ w", "o r", "l d", "Ġ he", "ll o", "he llo", "Ġw or"]
    tokens = [*bytes_to_unicode().values(), *(m.replace(" ", "") for m in merges),
              "<|begin_of_text|>", "<|end_of_text|>"]  # fmt: skip
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")  # Llama 3's
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(merges)


@pytest.mark.parametrize(
    ("vocabulary", "flags"),
    [
        (_sentencepiece, {}),  # llama.cpp's rule: BOS unless the file says otherwise
        (_sentencepiece, {"add_bos_token": False}),
        (_sentencepiece, {"add_bos_token": True, "add_eos_token": True}),
        (_byte_level, {}),
        (_byte_level, {"add_bos_token": True}),  # Llama 3's files
    ],
)
def test_a_gguf_files_tokenizer_is_the_one_transformers_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vocabulary: object, flags: dict[str, bool]
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "vocabulary.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    vocabulary(writer)  # type: ignore[operator]
    count = len(writer.kv_data[0]["tokenizer.ggml.tokens"].value)
    ids = (
        {"bos": 1, "eos": 2}
        if vocabulary is _sentencepiece
        else {"bos": count - 2, "eos": count - 1}
    )
    writer.add_bos_token_id(ids["bos"])
    writer.add_eos_token_id(ids["eos"])
    for name, value in flags.items():
        writer.add_bool(f"tokenizer.ggml.{name}", value)
    for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 8), ("attention.head_count", 1)):  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)  # AutoTokenizer reads a config
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = Tokenizer(path, read_model_info(embedded_model_path())).backend
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name).backend_tokenizer
    assert json.loads(ours.to_str()) == json.loads(theirs.to_str())
    encoded = ours.encode(TEXT, add_special_tokens=True).ids
    assert encoded == theirs.encode(TEXT, add_special_tokens=True).ids
    assert (encoded[0] == ids["bos"]) == flags.get("add_bos_token", vocabulary is _sentencepiece)
    assert (encoded[-1] == ids["eos"]) == flags.get("add_eos_token", False)
