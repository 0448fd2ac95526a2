"""Every request option of the proxy is honoured or refused (treetrain.proxy.options): tool_choice
required / named / none, logprobs and top_logprobs, response_format, and the fields it does not
honour. The Generate is SCRIPTED (the 135M model does not call tools on demand): what it returns
is what a model would sample after the prompt it is given, so a forced tool-call opening is
followed by the rest of the call. Tokenizer, chat templates, server and openai SDK are real."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI
from proxy_helpers import (
    CALCULATOR,
    SCRIPTED_LOGPROB,
    SMOL,
    Scripted,
    chained,
    check_sample,
    new_session,
    qwen_renderer,
    request,
    samples,
    serving,
)

from treetrain.engines import builtin
from treetrain.proxy.chat import HERMES_CALL_OPENING, ChatRenderer

USER = [{"role": "user", "content": "What is 2+3?"}]
NAMED = {"type": "function", "function": {"name": "calculator"}}
# What the model writes after the forced opening '<tool_call>\n{"name": "calculator", "arguments":'.
AFTER_NAMED = ' {"expression": "2+3"}}\n</tool_call>'
# ... and after the opening of any call, '<tool_call>\n{"name": "'.
AFTER_REQUIRED = 'calculator", "arguments": {"expression": "1"}}\n</tool_call>'
NON_ASCII = "Café 中文 🦜 ok"  # the parrot is three tokens of partial UTF-8


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return builtin.load_tokenizer(SMOL)


@pytest.fixture(scope="module")
def smol(smollm2: Any) -> ChatRenderer:
    return ChatRenderer(smollm2)


@pytest.fixture(scope="module")
def qwen(smollm2: Any) -> ChatRenderer:
    return qwen_renderer(smollm2)


@pytest.fixture
def clients() -> Iterator[Any]:
    made: list[OpenAI] = []

    def make(url: str, key: str) -> OpenAI:
        made.append(OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_a_named_tool_choice_starts_the_reply_with_that_call(qwen: ChatRenderer, clients: Any) -> None:
    """The template's tool-call opening and the name are prompt (the model saw them, nobody trains
    them); the sample trains exactly the sampled rest; the next turn extends it token for token."""
    script = Scripted(qwen, [AFTER_NAMED, "It is 5."])
    with serving(script, qwen) as server:
        sid, key = new_session(server)
        client = clients(server.url, key)
        messages: list[dict[str, Any]] = list(USER)
        first = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], tool_choice=NAMED)
        message = first.choices[0].message
        assert message.tool_calls, message
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"},
        ]
        second = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR])
        records = samples(server, sid, key)
        fresh = server.stats.snapshot()["fresh_renders"]
    text, opening = qwen.call_opening("calculator")
    assert text == '<tool_call>\n{"name": "calculator", "arguments":'  # read off the Qwen2.5 template
    call = message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    prompt = script.calls[0][0]
    assert prompt[-len(opening) :] == opening
    sampled = script.tokens(AFTER_NAMED)
    assert records[0]["input_ids"] == [*prompt, *sampled]
    assert sum(records[0]["loss_mask"]) == len(sampled) == first.usage.completion_tokens
    assert first.usage.prompt_tokens == len(prompt)
    assert second.choices[0].message.content == "It is 5."
    for rec in records:
        check_sample(rec)
    assert chained(records) and fresh == {"edited": 0, "template": 0}


def test_tool_choice_required_forces_a_call_on_a_template_without_tool_calls(smol: ChatRenderer) -> None:
    """SmolLM2's template writes no tool calls: the opening is the Hermes one the reply parser reads."""
    script = Scripted(smol, [AFTER_REQUIRED])
    with serving(script, smol) as server:
        sid, key = new_session(server)
        body = {"messages": USER, "tools": [CALCULATOR], "tool_choice": "required"}
        status, _, got = request(server.url, "POST", "/v1/chat/completions", body, key=key)
        (rec,) = samples(server, sid, key)
    assert status == 200, got
    text, opening = smol.call_opening(None)
    assert text == HERMES_CALL_OPENING[0]
    (call,) = got["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "1"}'}
    assert script.calls[0][0][-len(opening) :] == opening
    assert rec["input_ids"][-sum(rec["loss_mask"]) :] == script.tokens(AFTER_REQUIRED)
    check_sample(rec)


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt_and_the_reply(qwen: ChatRenderer) -> None:
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    script = Scripted(qwen, [call])
    with serving(script, qwen) as server:
        _, key = new_session(server)
        body: dict[str, Any] = {"messages": USER, "tools": [CALCULATOR]}
        none = request(server.url, "POST", "/v1/chat/completions", body | {"tool_choice": "none"}, key=key)[2]
        auto = request(server.url, "POST", "/v1/chat/completions", body, key=key)[2]
    with_none, with_auto = (qwen.tokenizer.decode(c[0]) for c in script.calls)
    assert "calculator" not in with_none and "calculator" in with_auto  # the tool schema only with auto
    assert "tool_calls" not in none["choices"][0]["message"] and none["choices"][0]["message"]["content"] == call
    assert none["choices"][0]["finish_reason"] == "stop" and auto["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"tool_choice": "required"}, "tool_choice required needs at least one tool"),
        ({"tools": [CALCULATOR], "tool_choice": {"type": "function", "function": {"name": "web"}}}, "not among"),
        ({"tools": [CALCULATOR], "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, "tool_choice must"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "only function tools"),
    ],
)
def test_tool_choices_that_cannot_be_met_get_400(smol: ChatRenderer, extra: dict[str, Any], says: str) -> None:
    with serving(Scripted(smol, ["x"]), smol) as server:
        _, key = new_session(server)
        status, _, got = request(server.url, "POST", "/v1/chat/completions", {"messages": USER, **extra}, key=key)
    assert status == 400 and says in got["error"]["message"], got


def test_logprobs_are_the_sampled_tokens_own(smol: ChatRenderer, clients: Any) -> None:
    script = Scripted(smol, [NON_ASCII])
    with serving(script, smol) as server:
        sid, key = new_session(server)
        client = clients(server.url, key)
        got = client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=0)
        without = client.chat.completions.create(model="m", messages=USER)
        stream = client.chat.completions.create(model="m", messages=USER, logprobs=True, stream=True)
        chunks = list(stream)
        with pytest.raises(openai.BadRequestError, match="no top-k alternatives") as err:
            client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=2)
        assert err.value.body["param"] == "top_logprobs"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="needs logprobs: true"):
            client.chat.completions.create(model="m", messages=USER, top_logprobs=0)
        rec = samples(server, sid, key)[0]
    entries = got.choices[0].logprobs.content
    k = sum(rec["loss_mask"])
    assert len(entries) == k == got.usage.completion_tokens
    assert [e.logprob for e in entries] == rec["logprobs"][-k:] == [SCRIPTED_LOGPROB] * k
    assert all(e.top_logprobs == [] for e in entries)
    # Exact bytes per token, even where a token holds part of a character (its text is then "\ufffd").
    stop = smol.tokenizer.decode([rec["input_ids"][-1]])  # the end token the script closes with
    assert b"".join(bytes(e.bytes) for e in entries) == f"{NON_ASCII}{stop}".encode()
    assert any(e.token == "\ufffd" for e in entries)
    assert [smol.tokenizer.decode([t]) for t in rec["input_ids"][-k:]] == [e.token for e in entries]
    assert without.choices[0].logprobs is None
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_legacy_completion_logprobs(smol: ChatRenderer, clients: Any) -> None:
    with serving(Scripted(smol, ["Hello there."]), smol) as server:
        _, key = new_session(server)
        client = clients(server.url, key)
        got = client.completions.create(model="m", prompt="Say hello:", logprobs=0)
        with pytest.raises(openai.BadRequestError, match="no top-k alternatives"):
            client.completions.create(model="m", prompt="Say hello:", logprobs=1)
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == got.usage.completion_tokens
    stop = smol.tokenizer.decode([smol.stop_token_ids[-1]])
    assert "".join(lp.tokens) == f"Hello there.{stop}" and lp.token_logprobs == [SCRIPTED_LOGPROB] * len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/chat/completions", {"presence_penalty": 1}, "presence_penalty"),
        ("/v1/chat/completions", {"logit_bias": {"1": 5}}, "logit_bias"),
        ("/v1/chat/completions", {"parallel_tool_calls": False}, "parallel_tool_calls"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"functions": [CALCULATOR["function"]]}, "functions"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
    ],
)
def test_options_not_honoured_get_400_naming_them(
    smol: ChatRenderer, route: str, extra: dict[str, Any], param: str
) -> None:
    base = {"messages": USER} if route == "/v1/chat/completions" else {"prompt": "Hi"}
    with serving(Scripted(smol, ["x"]), smol) as server:
        _, key = new_session(server)
        status, headers, got = request(server.url, "POST", route, base | extra, key=key)
    assert status == 400 and got["error"]["param"] == param and param in got["error"]["message"], got
    assert headers["x-should-retry"] == "false"


def test_options_at_their_defaults_and_informational_fields_are_accepted(smol: ChatRenderer) -> None:
    accepted = {
        "response_format": {"type": "text"},
        "frequency_penalty": 0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "parallel_tool_calls": True,
        "user": "agent-7",
        "metadata": {"run": "1"},
        "store": False,
        "service_tier": "auto",
        "tools": None,  # null is "not sent"
    }
    with serving(Scripted(smol, ["fine"]), smol) as server:
        _, key = new_session(server)
        status, _, got = request(server.url, "POST", "/v1/chat/completions", {"messages": USER, **accepted}, key=key)
        text = request(server.url, "POST", "/v1/completions", {"prompt": "Hi", "echo": False, "best_of": 1}, key=key)
    assert status == 200 and got["choices"][0]["message"]["content"] == "fine", got
    assert text[0] == 200, text
