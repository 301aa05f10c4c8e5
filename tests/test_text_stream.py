from __future__ import annotations

import pytest

from turnstile.gateway_svc.text_stream import TextStream
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = embedded_model_path()
    return Tokenizer(path, read_model_info(path))


def stream_all(tokenizer: Tokenizer, ids: list[int], stops: list[str]) -> tuple[list[str], str]:
    stream = TextStream(tokenizer, stops)
    pieces = []
    for token in ids:
        pieces.append(stream.add(token))
        if stream.stopped:
            break
    pieces.append(stream.finish())
    return pieces, "".join(pieces)


def test_incremental_text_equals_a_full_decode_and_never_splits_a_character(
    tokenizer: Tokenizer,
) -> None:
    text = "Héllo wörld! 日本語のテキスト 🙂 ok"
    ids = tokenizer.encode(text)
    # Byte-level BPE splits these characters over several tokens.
    assert len(ids) > len(text.split())
    pieces, joined = stream_all(tokenizer, ids, [])
    assert joined == tokenizer.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("stop", ["wörld", "ld! 日", "🙂", "テキ"])
def test_stop_string_is_cut_exactly_even_across_tokens(tokenizer: Tokenizer, stop: str) -> None:
    text = "Héllo wörld! 日本語のテキスト 🙂 ok"
    pieces, joined = stream_all(tokenizer, tokenizer.encode(text), [stop, "never"])
    assert joined == text[: text.index(stop)]
    assert not any(stop in piece for piece in pieces)


def test_text_held_back_for_a_possible_stop_is_released_at_the_end(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abc def")
    _, joined = stream_all(tokenizer, ids, ["defg"])
    assert joined == "abc def"
