from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from turnstile.executor_svc.model.rope import rope_rotations
from turnstile.shared.derived_files import derived_path, write_atomically, write_derived
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.tokenizer import Tokenizer


def test_embedded_gguf_is_found_and_describes_smollm2() -> None:
    path = embedded_model_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    info = read_model_info(path)
    assert (info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads) == (30, 576, 9, 3)
    assert (info.vocab_size, info.eos_token_id, info.max_model_len) == (49152, 2, 8192)
    assert info.tie_word_embeddings and not info.attention_bias
    assert info.chat_template is not None and "<|im_start|>" in info.chat_template


def test_eos_ids_and_sampling_defaults_come_from_config_and_generation_config(
    tmp_path: Path,
) -> None:
    from transformers import GenerationConfig, LlamaConfig

    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, eos_token_id=[5, 6]).save_pretrained(tmp_path)  # fmt: skip
    GenerationConfig(
        eos_token_id=[6, 9], do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1
    ).save_pretrained(tmp_path)
    info = read_model_info(tmp_path)
    assert (info.eos_token_id, info.all_eos_token_ids) == (5, (5, 6, 9))
    assert info.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    embedded = read_model_info(embedded_model_path())
    assert embedded.all_eos_token_ids == (embedded.eos_token_id,)


@pytest.mark.parametrize("legacy", [False, True])
def test_the_chat_template_is_read_where_transformers_puts_it(legacy: bool, tmp_path: Path) -> None:
    """transformers (4.43 on) saves it apart, in chat_template.jinja; older folders hold it in
    tokenizer_config.json."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG))
    words = tokenizers.models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(words))
    tokenizer.chat_template = template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    assert "chat_template" not in json.loads(config.read_text())
    if legacy:
        (tmp_path / "chat_template.jinja").unlink()
        config.write_text(json.dumps(json.loads(config.read_text()) | {"chat_template": template}))
    assert read_model_info(tmp_path).chat_template == template


def test_derived_caches_follow_the_model_files_content_not_its_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fresh venv installs the model with a new path and mtime; keying the dequantized
    weights by those left one 517 MB copy per install and filled the disk."""
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "cache"))
    first, second, changed = (tmp_path / name / "model.gguf" for name in ("a", "b", "c"))
    for path, content in ((first, b"weights"), (second, b"weights"), (changed, b"weightz")):
        path.parent.mkdir()
        path.write_bytes(content)
    os.utime(second, (1_000_000, 1_000_000))
    assert derived_path(first, "w") == derived_path(second, "w")
    assert derived_path(changed, "w") != derived_path(first, "w")
    # The digest is remembered per file identity; editing the file changes its mtime and misses.
    first.write_bytes(b"weightz")
    os.utime(first, ns=(first.stat().st_mtime_ns + 1, first.stat().st_mtime_ns + 1))
    assert derived_path(first, "w") == derived_path(changed, "w")


def test_a_cache_derived_by_older_code_is_neither_read_nor_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newer Turnstile reading a file differently (a key it now reads) must not be handed the
    older reading's cached copy; once the newer copy is written the older goes (a dequantized
    copy is as large as the model)."""
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "cache"))
    model, reader = tmp_path / "model.gguf", tmp_path / "reader.py"
    model.write_bytes(b"weights")
    reader.write_text("old reading")
    old = derived_path(model, "weights.safetensors", (str(reader),))
    assert write_derived(old, b"old")
    legacy = old.with_name("weights.safetensors")  # before caches were keyed by their readers
    legacy.write_bytes(b"older")
    other = old.with_name("tokenizer.json")
    other.write_bytes(b"kept")
    reader.write_text("new reading")
    new = derived_path(model, "weights.safetensors", (str(reader),))
    assert new != old and new.parent == old.parent and not new.exists()
    assert write_derived(new, b"new")
    assert sorted(p.name for p in new.parent.iterdir()) == sorted([new.name, other.name])


def test_a_cache_folder_that_is_a_file_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TURNSTILE_CACHE through a file: no folder can be made, and nothing raises (the partial
    file's removal once did, NotADirectoryError not being FileNotFoundError)."""
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "file" / "cache"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    path = derived_path(model, "weights.safetensors")  # its digest not remembered, not raising
    assert not write_derived(path, b"w") and not write_atomically(path, lambda p: None)


@pytest.mark.slow
def test_a_cache_that_cannot_be_written_is_skipped_whole(tmp_path: Path) -> None:
    """A full disk must not stop a start: a process whose files may not grow past 64 KB (a real
    write failure, EFBIG, from RLIMIT_FSIZE) converts the tokenizer (2 MB) and still encodes
    text, dequantizes the weights (540 MB, streamed to the file) and still has them, and
    leaves no partial file behind."""
    child = textwrap.dedent(
        """
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        from turnstile.shared.model_info import embedded_model_path, read_model_info
        from turnstile.shared.tokenizer import Tokenizer
        from turnstile.executor_svc.model.weights import load_weights
        path = embedded_model_path()
        print(len(load_weights(path, read_model_info(path))))
        print(Tokenizer(path, read_model_info(path)).encode("Hello, world"))
        """
    )
    cache = tmp_path / "cache"
    env = {**os.environ, "TURNSTILE_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    path = embedded_model_path()
    tensors, encoded = done.stdout.strip().splitlines()[-2:]
    assert encoded == str(Tokenizer(path, read_model_info(path)).encode("Hello, world"))
    assert int(tensors) == 272  # SmolLM2's 30 layers' 9 tensors, the embedding and final norm
    assert re.search(r"not caching \S*/tokenizer-[0-9a-f]{12}\.json", done.stderr)
    assert "File too large" in done.stderr  # the weights' failure, as safetensors words it
    written = [p.name for p in cache.rglob("*") if p.is_file()]
    assert not [n for n in written if n.startswith(("tokenizer", "weights")) or n.endswith(".tmp")]


BASE_CONFIG = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "max_position_embeddings": 1024,
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model_type": "deepseek_v3"}, "model_type"),  # multi-head latent attention: not here
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"model_type": "gemma3_text", "query_pre_attn_scalar": 64,
          "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
         "rope_parameters.sliding_attention.rope_type"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "rope_scaling.rope_type"),
        ({"partial_rotary_factor": 0.3125}, "partial_rotary_factor"),  # 5 of 16 dims: odd
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
         "rope_scaling.original_max_position_embeddings"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)  # fmt: skip
def test_a_config_asking_for_what_is_not_implemented_is_refused_by_field(
    tmp_path: Path, change: dict, field: str
) -> None:
    import json

    from turnstile.shared.model_support import UnsupportedModel

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | change))
    with pytest.raises(UnsupportedModel, match=f"config.json: {field} = "):
        read_model_info(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"model_type": "mistral", "sliding_window": None},  # Mistral v0.2 on: no window
        # Phi-3's older format: longrope's original context beside rope_scaling
        {
            "model_type": "phi3",
            "original_max_position_embeddings": 256,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
            },
        },
        {"model_type": "qwen2", "attention_bias": True},  # Qwen2's qkv bias
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ],
)
def test_a_config_whose_features_are_implemented_or_inert_is_read(
    tmp_path: Path, change: dict
) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | change))
    info = read_model_info(tmp_path)
    assert info.num_layers == 2
    rope_rotations(info)  # its RoPE table builds


@pytest.mark.parametrize(
    ("change", "windows"),
    [
        ({"model_type": "mistral", "sliding_window": 256}, (256, 256)),
        ({"model_type": "mistral", "sliding_window": 4096}, ()),  # wider than the context
        ({"model_type": "qwen2", "sliding_window": 256, "use_sliding_window": False}, ()),
        ({"model_type": "qwen3", "sliding_window": 256, "use_sliding_window": True,
          "max_window_layers": 1}, (0, 256)),
        ({"model_type": "qwen3", "sliding_window": 256, "use_sliding_window": True,
          "layer_types": ["sliding_attention", "full_attention"]}, (256, 0)),
    ],
)  # fmt: skip
def test_each_layers_sliding_window_is_read_as_transformers_reads_it(
    tmp_path: Path, change: dict, windows: tuple[int, ...]
) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | change))
    assert read_model_info(tmp_path).layer_windows == windows


def test_serve_refuses_an_unsupported_model_before_starting_anything(tmp_path: Path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG | {"model_type": "deepseek_v3"}))
    done = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "serve", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "model_type = 'deepseek_v3' is not supported" in done.stderr


def test_a_hugging_face_id_is_found_in_the_local_cache_and_a_missing_one_named(
    tmp_path: Path,
) -> None:
    """org/name resolves to its snapshot in the Hugging Face cache (main, or a --revision),
    served under that id; a model not there stops `serve` naming the cache it looked in."""
    import json

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    for ref, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        (repo / "snapshots" / commit).mkdir(parents=True)
        config = BASE_CONFIG | {"num_hidden_layers": 2 if ref == "main" else 3}
        (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    child = textwrap.dedent(
        """
        from turnstile.shared.config import EngineConfig
        from turnstile.shared.model_info import read_model_info, served_name
        for revision in (None, "v2"):
            path = EngineConfig(model="acme/tiny-llama", revision=revision).model_path
            print(served_name(path), path.name, read_model_info(path).num_layers)
        """
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == [f"acme/tiny-llama {'a' * 40} 2",
                                           f"acme/tiny-llama {'b' * 40} 3"]  # fmt: skip
    missing = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "serve", "--model", "acme/absent"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1
    assert "acme/absent is neither a path nor in the Hugging Face cache" in missing.stderr
    assert str(tmp_path / "hub") in missing.stderr
