"""`turnstile generate`: JSON lines in, JSON lines out, every line run together through the
same scheduler and executor code as the service (and the same request validation). A line's
`model` names the served model or a `--lora-modules` adapter; its output constraint
(`response_format`, `structured_outputs`, a forced tool call) and `truncate_prompt_tokens`
hold as served. What a line's record cannot carry (logprobs, echo, a stream) is refused on that
line, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.gateway_svc.classify import check_generates
from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.openai_api import (
    engine_request,
    hidden_token_ids,
    parse,
    prompts_of,
    truncated,
)
from turnstile.gateway_svc.reasoning import answer_thinks
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.gateway_svc.sampling_fields import RequestDefaults, model_sampling_defaults
from turnstile.gateway_svc.served_models import ServedModels
from turnstile.gateway_svc.structured_output import grammar_of
from turnstile.gateway_svc.text_stream import TextStream
from turnstile.gateway_svc.tool_calls import forced_call, tool_mode
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.lora import adapters
from turnstile.shared.model_info import served_name
from turnstile.shared.protocol import AddRequest
from turnstile.shared.tokenizer import Tokenizer, served_tokenizer

# Fields a line's record has no place for: refused unless left out, null or false.
UNWRITTEN = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "stream")


def _message(
    request: CompletionRequest | ChatCompletionRequest, served: ServedModels,
    tokenizer: Tokenizer, engine: OfflineEngine, defaults: RequestDefaults,
) -> AddRequest:  # fmt: skip
    """The line's request for the scheduler, as the gateway builds it; ApiError if it cannot
    run offline."""
    check_generates(tokenizer.info, served.base)  # a classifier, or --runner pooling
    for name in UNWRITTEN:
        if (value := getattr(request, name, None)) is not None and value is not False:
            raise ApiError(400, f"{name}: generate writes tokens and text only", param=name)
    lora = served.lora(request.model)
    chat = isinstance(request, ChatCompletionRequest)
    tools = tool_mode(request, None) if chat else None
    constraint = grammar_of(request, forced_call(request, tools) if chat else None)
    prompts = truncated(prompts_of(request, tokenizer), request, engine.runner.max_model_len)
    if len(prompts) > 1 or (request.n or 1) > 1:
        raise ApiError(400, "generate runs one prompt and one choice per line")
    answer_thinks(request, None, prompts[0], tokenizer)  # no reasoning parser offline
    return engine_request(
        request, prompts[0], engine.runner.max_model_len, tokenizer, defaults,
        grammar=None if constraint is None else constraint[1], lora=lora,
    )  # fmt: skip


def generate_file(
    source: Path, target: Path, config: RunnerConfig, scheduling: SchedulingConfig
) -> None:
    engine = OfflineEngine(config, scheduling)
    names = [served_name(config.model_path)]
    served = ServedModels(
        names, adapters(config.lora, engine.runner.info), engine.runner.max_model_len
    )
    defaults = model_sampling_defaults(engine.runner.info.sampling_defaults)  # as served: auto
    tokenizer = served_tokenizer(config.engine, engine.runner.info)
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
            message = _message(request, served, tokenizer, engine, defaults)
        except ApiError as exc:
            record.update(token_ids=[], text="", finish_reason="error", error=exc.message)
            continue
        parsed.append((number, request))
        messages.append(msgspec.structs.replace(message, req_id=len(messages)))
    for (number, request), result in zip(parsed, engine.generate(messages), strict=True):
        text = TextStream(
            tokenizer,
            request.stop_strings,
            request.skip_special_tokens,
            request.include_stop_str_in_output,
        )
        pieces, kept = [], []
        hidden = hidden_token_ids(request, tokenizer.info.all_eos_token_ids)
        for token in result.token_ids:
            kept.append(token)
            pieces.append("" if token in hidden else text.add(token))
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
