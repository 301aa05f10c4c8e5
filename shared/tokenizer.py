"""Text to token ids and back, plus the model's chat template, without torch.

For a GGUF model the tokenizer is rebuilt from the file's vocabulary once (via transformers'
GGUF converter) and cached as a `tokenizer.json`; later starts load that file directly.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

from turnstile.shared.config import EngineConfig
from turnstile.shared.derived_files import derived_path, write_derived
from turnstile.shared.gguf_header import read_header
from turnstile.shared.model_info import ModelInfo, folder_chat_template


def _load_backend(model: Path) -> tokenizers.Tokenizer:
    if model.suffix != ".gguf":
        return tokenizers.Tokenizer.from_file(str(model / "tokenizer.json"))
    cached = derived_path(model, "tokenizer.json", (__file__,))  # a newer reading not hidden
    if not cached.exists():
        text = _converted(model).to_str()
        write_derived(cached, text.encode())
        return tokenizers.Tokenizer.from_str(text)
    return tokenizers.Tokenizer.from_file(str(cached))


def _converted(model: Path) -> tokenizers.Tokenizer:
    """A GGUF file's tokenizer by transformers' converter (slow to import: the first start
    only), from the vocabulary our header reader gives: transformers' `AutoTokenizer` reads the
    file twice with gguf's reader (6.3 s for SmolLM2's file, against 0.4 s here), for the same
    tokenizer."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    fields = read_header(model).fields
    names = GGUF_TOKENIZER_MAPPING["tokenizer"].items()
    vocabulary = {name: fields[f"tokenizer.{key}"] for key, name in names
                  if f"tokenizer.{key}" in fields}  # fmt: skip
    converted = convert_gguf_tokenizer(fields["general.architecture"], vocabulary)[0]
    _add_ends(converted, fields, vocabulary)
    return converted


def _add_ends(converted: tokenizers.Tokenizer, fields: dict, vocabulary: dict) -> None:
    """BOS and EOS around a text (`add_special_tokens`) where the file asks for them, as
    transformers' tokenizer adds them; a sentencepiece vocabulary that does not say otherwise
    starts with BOS (llama.cpp's rule)."""
    sentencepiece = vocabulary.get("tokenizer_type") == "llama"
    ends: dict[str, tuple[str, int]] = {}
    for end, default in (("bos", sentencepiece), ("eos", False)):
        key = f"{end}_token_id"
        if fields.get(f"tokenizer.ggml.add_{end}_token", default) and key in vocabulary:
            ends[end] = (vocabulary["tokens"][vocabulary[key]], vocabulary[key])
    if not ends:
        return
    bos, eos = (ends[end][0] if end in ends else "" for end in ("bos", "eos"))

    def around(text: str, kind: int) -> str:
        return " ".join(f"{part}:{kind}" for part in (bos, text, eos) if part)

    converted.post_processor = tokenizers.processors.TemplateProcessing(
        single=around("$A", 0), pair=f"{around('$A', 0)} {around('$B', 1)}",
        special_tokens=list(ends.values()),
    )  # fmt: skip


class Tokenizer:
    def __init__(
        self, model: Path, info: ModelInfo, template_kwargs: dict[str, Any] | None = None,
        given_template: bool = False,
    ) -> None:  # fmt: skip
        """`template_kwargs`: the chat template's defaults (a render's own win);
        `given_template`: the template is the server's (--chat-template), not the model's: a
        cross-encoder's pairs are written with it, as vLLM writes them."""
        self.backend = _load_backend(model)
        # What a tokenizer.json may set (sentence-transformers' often cut at 128 or 512) is
        # never applied to every text: truncation is a request's own (`truncated`), as HF's.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.info = info
        self.template_kwargs = template_kwargs or {}
        self.given_template = given_template
        self.vocab_size = self.backend.get_vocab_size()
        # No token stands for more characters than its longest vocabulary entry (x4 for a
        # normalizer that composes characters): a text over max_model_len times this is
        # refused before it is tokenized.
        self.max_chars_per_token = 4 * max(map(len, self.backend.get_vocab()))
        self._template = None
        if info.chat_template:
            self._template = chat_environment().from_string(info.chat_template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what the tokenizer adds around a text (Llama's BOS)."""
        # The batch call releases the GIL (encode holds it), so a gateway thread tokenizing a
        # long prompt leaves its event loop running.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """Two texts joined as the tokenizer joins a pair, with its special tokens (transformers'
        `tokenizer(text, text_pair)`): a cross-encoder's prompt, and where the tokens it types 1
        start (BERT's second text), -1 where it types none."""
        encoding = self.backend.encode_batch([(first, second)], add_special_tokens=True)[0]
        types = encoding.type_ids
        return encoding.ids, types.index(1) if 1 in types else -1

    def truncated(
        self, texts: tuple[str, ...], keep: int, add_special_tokens: bool = True
    ) -> tuple[list[int], int]:
        """A text or a pair's tokens as transformers' `tokenizer(*texts, truncation=True,
        max_length=keep)` gives them (vLLM's pooled truncation): the texts cut from the right
        to leave room for the special tokens, a pair's longer text first; and where the tokens
        typed 1 start (-1: none). Raises ValueError where the special tokens alone exceed it."""
        parts = self.backend.encode_batch(list(texts), add_special_tokens=False)
        pair = len(parts) == 2
        budget = keep - (self.backend.num_special_tokens_to_add(pair) if add_special_tokens else 0)
        if budget < 0:
            raise ValueError(f"keeping {keep} tokens leaves no room for the "
                             f"{keep - budget} special tokens")  # fmt: skip
        lengths = _longest_first([len(part.ids) for part in parts], budget)
        for part, length in zip(parts, lengths, strict=True):
            part.truncate(length)
        final = self.backend.post_process(parts[0], parts[1] if pair else None, add_special_tokens)
        return final.ids, final.type_ids.index(1) if 1 in final.type_ids else -1

    def clipped(self, text: str, limit: int) -> str:
        """The text cut after its `limit`-th token (`limit` >= 1; special tokens aside) at that
        token's last character, as vLLM's `truncate_text_to_tokens` cuts it."""
        while text:
            offsets = self.backend.encode_batch([text], add_special_tokens=False)[0].offsets
            if len(offsets) <= limit:
                break
            end = min(offsets[limit - 1][1], offsets[limit][0])
            text = text[: min(end, len(text) - 1)]
        return text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The conversation as the model's template writes it, as transformers'
        `apply_chat_template` does. A template that refuses it (its `raise_exception`, as
        Mistral's on roles that do not alternate) raises ValueError with its own message.
        `continue_final_message`: the text ends inside the last message, for the model to go on."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        variables = {
            "bos_token": "" if (bos := self.info.bos_token_id) is None else self.token_text(bos),
            "eos_token": self.token_text(self.info.eos_token_id),
            **self.template_kwargs,
            **template_kwargs,
        }
        try:
            text = self._template.render(
                variables, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # whatever the request makes the template raise
            raise ValueError(f"the chat template refused the messages: {exc}") from None
        if continue_final_message:
            final = messages[-1].get("content") or ""
            at = text.rfind(final.strip()) if final.strip() else -1
            if at < 0:
                raise ValueError("continue_final_message: the template does not write the last "
                                 "message's text")  # fmt: skip
            # Its trailing spaces too where the template kept them, as transformers does.
            kept = text[at : at + len(final.lstrip())] == final
            text = text[: at + len(final.lstrip() if kept else final.strip())]
        return text


def _longest_first(lengths: list[int], budget: int) -> list[int]:
    """The lengths `tokenizers` cuts texts to so that they total `budget` at most (its
    `longest_first`): a text alone to the budget; a pair's longer text alone where the shorter
    leaves it room, else both to half."""
    if len(lengths) == 1 or sum(lengths) <= budget:
        return [min(n, budget) for n in lengths]
    short, long = sorted(lengths)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short, long = budget // 2, budget // 2 + budget % 2
    return [long, short] if lengths[0] > lengths[1] else [short, long]


def served_tokenizer(
    engine: EngineConfig,
    info: ModelInfo,
    template_kwargs: dict[str, Any] | None = None,
    template: str | None = None,
) -> Tokenizer:
    """The tokenizer requests are read with: the model's, or --tokenizer's with its chat
    template (`template`, --chat-template's, over either); one whose vocabulary the model
    cannot embed is refused, by name."""
    if engine.tokenizer is None:
        own = info.chat_template
    else:
        folder = engine.tokenizer_path
        own = (folder_chat_template(folder) if folder.is_dir() else None) or info.chat_template
    served = dataclasses.replace(info, chat_template=template or own)
    tokenizer = Tokenizer(engine.tokenizer_path, served, template_kwargs, template is not None)
    if tokenizer.vocab_size > info.vocab_size:
        raise ValueError(
            f"--tokenizer {engine.tokenizer}: its vocabulary has {tokenizer.vocab_size} tokens, "
            f"the model embeds {info.vocab_size}"
        )
    return tokenizer


def read_template(template: str) -> str:
    """A chat template given as a file's path, or as the template itself (as vLLM's
    --chat-template); a path that names no file is a clear error, not a template."""
    path = Path(template)
    if any(mark in template for mark in ("{{", "{%")):
        return template
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {template}: {exc.strerror}") from None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own: jinja2's tojson escapes HTML characters, which templates do not want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in: its whitespace rules, loop
    controls, `raise_exception`, `strftime_now` and `tojson`."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
