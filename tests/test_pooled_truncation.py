"""vLLM's truncation of pooled prompts (`gateway_svc/pooled_truncation.py`): a text or a pair cut
as transformers' tokenizer cuts it (`Tokenizer.truncated`: special tokens kept, a pair's longer
text first), held to transformers on random texts and limits for BERT (pairs typed), XLM-R and
a Qwen3 classifier's tokenizer; `truncation_side` slicing instead, types moved alike."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from turnstile.bench import random_encoder, random_llama
from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.pooled_truncation import Truncation
from turnstile.shared.model_info import read_model_info
from turnstile.shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    made = tmp_path_factory.mktemp("truncation")
    return {"bert": random_encoder.encoder(made / "bert"),
            "xlmr": random_encoder.encoder(made / "xlmr", "XLMRoberta"),
            "qwen": random_llama.classifier(made / "qwen")}  # fmt: skip


def words(draw: random.Random) -> str:
    return " ".join(f"w{draw.randrange(5, 500)}" for _ in range(draw.randrange(1, 30)))


@pytest.mark.parametrize("name", ["bert", "xlmr", "qwen"])
def test_texts_and_pairs_are_cut_as_transformers_cuts_them(
    folders: dict[str, Path], name: str
) -> None:
    import transformers

    folder = folders[name]
    ours = Tokenizer(folder, read_model_info(folder))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    draw = random.Random(0)
    for _ in range(200):
        keep = draw.randrange(4, 60)
        for texts in ((words(draw),), (words(draw), words(draw))):
            expected = theirs(*texts, truncation=True, max_length=keep)
            ids, second = ours.truncated(texts, keep)
            assert ids == expected["input_ids"], (texts, keep)
            types = expected.get("token_type_ids") or [0]
            assert second == (types.index(1) if 1 in types else -1)


def test_a_side_slices_the_tokens_and_moves_the_types(folders: dict[str, Path]) -> None:
    tokenizer = Tokenizer(folders["bert"], read_model_info(folders["bert"]))
    pair = ("w5 w6 w7", "w8 w9")  # [CLS] w5 w6 w7 [SEP] w8 w9 [SEP]: typed 1 from 5
    assert Truncation(4, "left").texts(tokenizer, pair) == ([2, 8, 9, 2], 1)
    assert Truncation(4, "right").texts(tokenizer, pair) == ([1, 5, 6, 7], -1)
    assert Truncation(6, "right").texts(tokenizer, pair) == ([1, 5, 6, 7, 2, 8], 5)
    assert Truncation(6, None).texts(tokenizer, pair) == ([1, 5, 6, 2, 8, 2], 4)
    assert Truncation(2, None).ids([7, 8, 9]) == [7, 8]  # ids: their first k
    assert Truncation(2, "left").ids([7, 8, 9]) == [8, 9]
    with pytest.raises(ApiError, match="no room for the 3 special tokens"):
        Truncation(2, None).texts(tokenizer, pair)


def test_a_tokenizer_json_s_own_truncation_and_padding_are_not_applied(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """sentence-transformers' tokenizer.json files often keep a truncation (and padding) their
    export set: transformers applies neither unless asked, nor does the gateway."""
    folder = tmp_path / "bert"
    shutil.copytree(folders["bert"], folder)
    written = json.loads((folder / "tokenizer.json").read_text())
    written["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                             "stride": 0}  # fmt: skip
    written["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_id": 0,
                          "pad_to_multiple_of": None, "pad_type_id": 0,
                          "pad_token": "w0"}  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(written))
    tokenizer = Tokenizer(folder, read_model_info(folder))
    assert tokenizer.encode("w5 w6 w7 w8 w9", add_special_tokens=True) == [1, 5, 6, 7, 8, 9, 2]
