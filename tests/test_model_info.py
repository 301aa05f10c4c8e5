from __future__ import annotations

from shared.model_info import embedded_model_path, read_model_info


def test_embedded_gguf_is_found_and_describes_smollm2() -> None:
    path = embedded_model_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    info = read_model_info(path)
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads) == (30, 576, 9, 3)
    assert (info.vocab_size, info.eos_token_id, info.max_model_len) == (49152, 2, 8192)
    assert info.tie_word_embeddings and not info.attention_bias
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template
