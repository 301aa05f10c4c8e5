"""vLLM's serve flags where a deployment passes them: `--scheduling-policy` (our `--policy`),
`--default-chat-template-kwargs`, `--enable-force-include-usage` (with
`--enable-prompt-tokens-details`), `--max-logprobs`, `--override-generation-config` (the sampling
itself: test_choices_and_endpoints.py), `--tokenizer`, and a tool request decoded keeping special
tokens as vLLM's hermes parser has it, on a running stack through the official client; what the
flags do not take is refused at start by name."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts a stack

# The template greets with its `greeting` argument, which the flag gives by default.
TEMPLATE = "{{ greeting }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("template") / "greeting.jinja"
    template.write_text(TEMPLATE)
    flags = ["--scheduling-policy", "priority", "--chat-template", str(template),
             "--default-chat-template-kwargs", json.dumps({"greeting": "Ahoy"}),
             "--enable-force-include-usage", "--num-blocks", "128",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--max-logprobs", "30", "--trust-remote-code", "--enable-chunked-prefill",
             "--enable-prompt-tokens-details"]  # fmt: skip
    with launched_server(*flags) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


def _rendered(server: Server, **fields: object) -> str:
    root = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)
    messages = [{"role": "user", "content": "Hi"}]
    ids = root.post("/tokenize", cast_to=object, body={"messages": messages, **fields})["tokens"]
    return root.post("/detokenize", cast_to=object, body={"tokens": ids})["prompt"]


def test_the_default_chat_template_kwargs_render_unless_a_request_gives_its_own(
    server: Server,
) -> None:
    assert _rendered(server) == "Ahoy:Hi"
    assert _rendered(server, chat_template_kwargs={"greeting": "Hello"}) == "Hello:Hi"


def test_every_stream_ends_with_its_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    # --enable-prompt-tokens-details: what a usage always gives here
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_a_tool_request_keeps_special_tokens_as_vllms_hermes_parser_has_it(
    client: openai.OpenAI,
) -> None:
    """With tools, the answer is decoded keeping special tokens (a call's marker may be one);
    without, they are skipped. The model may only say <|im_start|> (id 1, a special token)."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                temperature=0, extra_body={"allowed_token_ids": [1]})  # fmt: skip
    with_tools = client.chat.completions.create(**args, tools=[tool])
    assert with_tools.choices[0].message.content == "<|im_start|>" * 3
    assert client.chat.completions.create(**args).choices[0].message.content == ""


def test_max_logprobs_bounds_every_logprobs_count_and_the_beam_width(
    client: openai.OpenAI,
) -> None:
    """30 here (vLLM's default, 20, elsewhere): 25 top logprobs come; 31 are refused by name,
    as 16 beams are (a step asks for 2n)."""
    answer = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logprobs=25)
    assert len(answer.choices[0].logprobs.top_logprobs[0]) == 25
    refusals = (({"logprobs": 31}, "logprobs"), ({"prompt_logprobs": 31}, "prompt_logprobs"),
                ({"use_beam_search": True, "n": 16}, "n"))  # fmt: skip
    for fields, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body=fields)
        assert refused.value.body["param"] == param
    beams = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=15,
                                      extra_body={"use_beam_search": True})  # fmt: skip
    assert len(beams.choices) == 15


def test_the_scheduling_policy_flag_is_our_policy(client: openai.OpenAI) -> None:
    """A priority is refused under the default fcfs (test_request_fields.py); here it runs."""
    answer = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": -1}
    )
    assert answer.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--override-generation-config", '{"num_beams": 4}'], "'num_beams' is not"),
        (["--override-generation-config", '{"temperature": 9}'], "Expected `float` <= 2"),
        (["--default-chat-template-kwargs", "{not json"], "is not a JSON object"),
        (["--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
        (["--ssl-certfile", "/no/such/cert.pem"], "--ssl-*: /no/such/cert.pem"),
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"], "2, required, is not supported"),
        (["--max-logprobs", "-2"], "--max-logprobs must be -1"),
        (["--no-enable-chunked-prefill"], "prompts are always computed in chunks"),
    ],
)
def test_a_value_these_flags_do_not_take_is_refused_before_anything_starts(
    flags: list[str], refusal: str
) -> None:
    done = subprocess.run([sys.executable, "-m", "turnstile.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and refusal in done.stderr


def _tokenizer_folder(folder: Path, extra_tokens: int = 0) -> Path:
    """SmolLM2's vocabulary without its merges (each text read a character a token: plainly
    not the model's own tokenizer), with a bare chat template; `extra_tokens` more than the
    model embeds."""
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import Tokenizer

    path = embedded_model_path()
    tokenizer = json.loads(Tokenizer(path, read_model_info(path)).backend.to_str())
    tokenizer["model"]["merges"] = []
    vocab = tokenizer["model"]["vocab"]
    for n in range(extra_tokens):
        vocab[f"<extra_{n}>"] = len(vocab)
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_tokenizer_reads_requests_with_another_folders_tokenizer_and_template(
    tmp_path: Path,
) -> None:
    """vLLM's --tokenizer, as its docs advise for a GGUF file: the gateway tokenizes with the
    folder's tokenizer and renders chats with its template, and a constrained answer (the
    executor's grammar over that vocabulary) still parses; a folder whose vocabulary the model
    cannot embed is refused before anything starts."""
    folder = _tokenizer_folder(tmp_path / "characters")
    with launched_server("--tokenizer", str(folder), "--num-blocks", "64") as server:
        root = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)
        assert root.post("/tokenize", cast_to=object, body={"prompt": "Hello"})["count"] == 5
        chat = {"messages": [{"role": "user", "content": "Hi"}]}
        assert root.post("/tokenize", cast_to=object, body=chat)["count"] == 2
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        choice = {"structured_outputs": {"choice": ["yes", "no"]}}
        answer = client.chat.completions.create(model=MODEL, **chat, extra_body=choice)
        assert answer.usage.prompt_tokens == 2
        assert answer.choices[0].message.content in ("yes", "no")
    too_many = _tokenizer_folder(tmp_path / "larger", extra_tokens=1)
    done = subprocess.run([sys.executable, "-m", "turnstile.cli", "serve", "--tokenizer",
                           str(too_many)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "the model embeds 49152" in done.stderr


def test_the_chat_template_is_the_flags_else_the_tokenizer_folders_else_the_models(
    tmp_path: Path,
) -> None:
    from turnstile.shared.config import EngineConfig
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import served_tokenizer

    folder = _tokenizer_folder(tmp_path / "characters")
    info = read_model_info(embedded_model_path())
    engine = EngineConfig(tokenizer=str(folder))
    own = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert served_tokenizer(engine, info).info.chat_template == own
    assert served_tokenizer(engine, info, template="{{ x }}").info.chat_template == "{{ x }}"
    assert served_tokenizer(EngineConfig(), info).info.chat_template == info.chat_template
