"""`turnstile generate`: JSON lines in, JSON lines out, every line run together through the
same scheduler and executor code as the service (and the same request validation)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.gateway_svc.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    engine_request,
    model_sampling_defaults,
    parse,
    prompt_of,
)
from turnstile.gateway_svc.text_stream import TextStream
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.tokenizer import Tokenizer


def generate_file(
    source: Path, target: Path, config: RunnerConfig, scheduling: SchedulingConfig
) -> None:
    engine = OfflineEngine(config, scheduling)
    defaults = model_sampling_defaults(engine.runner.info.sampling_defaults)  # as served: auto
    tokenizer = Tokenizer(config.model_path, engine.runner.info)
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    records: list[dict] = []
    parsed: list[tuple[int, CompletionRequest | ChatCompletionRequest]] = []
    messages = []
    for number, line in enumerate(lines):
        record = json.loads(line)
        records.append(record)
        kind = ChatCompletionRequest if "messages" in record else CompletionRequest
        try:
            request = parse(line.encode(), kind)
            prompt_ids = prompt_of(request, tokenizer)
            message = engine_request(request, prompt_ids, engine.runner.max_model_len, defaults)
        except ApiError as exc:
            record.update(token_ids=[], text="", finish_reason="error", error=exc.message)
            continue
        parsed.append((number, request))
        messages.append(msgspec.structs.replace(message, req_id=len(messages)))
    for (number, request), result in zip(parsed, engine.generate(messages), strict=True):
        text = TextStream(tokenizer, request.stop_strings)
        pieces, kept = [], []
        for token in result.token_ids:
            kept.append(token)
            pieces.append(text.add(token))
            if text.stopped:
                break
        pieces.append(text.finish())
        finish_reason = "stop" if text.stopped else result.finish_reason
        records[number].update(token_ids=kept, text="".join(pieces), finish_reason=finish_reason)
        if result.error:
            records[number]["error"] = result.error
    with target.open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
