"""``POST /v1/responses`` (treetrain.proxy.responses) through the openai SDK's ``responses.create`` and
through the OpenAI Agents SDK's default model (its OpenAIProvider picks the Responses API), offline
with tracing off. The Generate is SCRIPTED (a real <tool_call> reply, then an answer): the 135M
model does not call tools on demand. Tokenizer, template, server and both SDKs are real."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
from agents.models.openai_provider import OpenAIProvider
from openai import AsyncOpenAI, OpenAI
from proxy_helpers import SMOL, Scripted, chained, check_sample, new_session, qwen_renderer, request, samples, serving

from treetrain.engines import builtin
from treetrain.proxy.chat import ChatRenderer

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "2 + 3 = 5."
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return builtin.load_tokenizer(SMOL)


@pytest.fixture(scope="module")
def renderer(smollm2: Any) -> ChatRenderer:
    return ChatRenderer(smollm2)


def test_responses_create_calls_a_tool_and_the_next_turn_extends_its_tokens(renderer: ChatRenderer) -> None:
    script = Scripted(renderer, [CALL, ANSWER])
    with serving(script, renderer) as server:
        sid, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            first = client.responses.create(
                model="policy", instructions="Add with the add tool.", input="What is 2 + 3?", tools=[ADD]
            )
            (call,) = [item for item in first.output if item.type == "function_call"]
            follow = [
                {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]},
                *(item.model_dump(exclude_none=True) for item in first.output),
                {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
            ]
            second = client.responses.create(
                model="policy", instructions="Add with the add tool.", input=follow, tools=[ADD]
            )
        records = samples(server, sid, key)
        snap = server.stats.snapshot()
    assert first.status == "completed" and first.id.startswith("resp_") and first.object == "response"
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3}) and call.call_id.startswith("call_")
    assert second.output_text == ANSWER and [item.type for item in second.output] == ["message"]
    assert second.output[0].content[0].type == "output_text"  # type: ignore[union-attr]
    for resp, rec in zip((first, second), records, strict=True):
        check_sample(rec)
        assert rec["completion_id"] == resp.id
        assert resp.usage is not None and sum(rec["loss_mask"]) == resp.usage.output_tokens
        assert len(rec["input_ids"]) == resp.usage.total_tokens
    assert chained(records) and snap["fresh_renders"] == {"edited": 0, "template": 0}
    second_prompt = renderer.tokenizer.decode(script.calls[1][0])
    assert second_prompt.startswith("<|im_start|>system\nAdd with the add tool.")
    assert second_prompt.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"), second_prompt[-200:]


def test_responses_tool_choice_named_is_forced(smollm2: Any) -> None:
    qwen = qwen_renderer(smollm2)
    script = Scripted(qwen, [' {"a": 1, "b": 1}}\n</tool_call>'])
    with serving(script, qwen) as server:
        sid, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            resp = client.responses.create(
                model="m", input="1 + 1?", tools=[ADD], tool_choice={"type": "function", "name": "add"}
            )
        (rec,) = samples(server, sid, key)
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 1}
    opening = qwen.call_opening("add")[1]
    assert script.calls[0][0][-len(opening) :] == opening  # prompt side: not trained
    assert rec["input_ids"][-sum(rec["loss_mask"]) :] == script.tokens(' {"a": 1, "b": 1}}\n</tool_call>')


def test_a_reply_cut_by_max_output_tokens_is_incomplete(renderer: ChatRenderer) -> None:
    with serving(Scripted(renderer, ["a long answer that goes on"]), renderer) as server:
        _, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            resp = client.responses.create(model="m", input="Talk.", max_output_tokens=3, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 3 and resp.temperature == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
    ],
)
def test_what_responses_does_not_support_gets_400_naming_it(
    renderer: ChatRenderer, extra: dict[str, Any], param: str
) -> None:
    with serving(Scripted(renderer, ["x"]), renderer) as server:
        _, key = new_session(server)
        status, _, got = request(server.url, "POST", "/v1/responses", {"model": "m", "input": "hi", **extra}, key=key)
    assert status == 400 and got["error"]["param"] == param, got
    assert param.split(".")[0] in got["error"]["message"]


def test_a_streamed_response_is_the_same_response_as_events(renderer: ChatRenderer) -> None:
    script = Scripted(renderer, [CALL, ANSWER])
    with serving(script, renderer) as server:
        _, key = new_session(server)
        with OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
            with client.responses.create(model="m", input="What is 2 + 3?", tools=[ADD], stream=True) as stream:
                calls = [e.type for e in stream]
            with client.responses.create(model="m", input="2 + 3?", stream=True) as stream:
                events = list(stream)
    assert calls[:2] == ["response.created", "response.in_progress"] and calls[-1] == "response.completed"
    assert "response.function_call_arguments.done" in calls
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed" and deltas == final.output_text == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_agents_sdk_default_model_runs_through_the_responses_api(renderer: ChatRenderer) -> None:
    """``Agent(model="...")`` with the SDK's OpenAIProvider: its default is the Responses API. Run
    twice: ``Runner.run`` and ``Runner.run_streamed`` (streamed events)."""
    set_tracing_disabled(True)
    script = Scripted(renderer, [CALL, ANSWER])
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    with serving(script, renderer) as server:
        sid, key = new_session(server)

        async def run(streamed: bool) -> str:
            async with AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
                agent = Agent(name="adder", instructions="Add numbers with the add tool.", tools=[add], model="policy")
                config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
                if not streamed:
                    return str((await Runner.run(agent, "What is 2 + 3?", run_config=config)).final_output)
                result = Runner.run_streamed(agent, "What is 2 + 3?", run_config=config)
                kinds = {event.type async for event in result.stream_events()}
                assert "raw_response_event" in kinds
                return str(result.final_output)

        final = asyncio.run(run(streamed=False))
        records = samples(server, sid, key)
        snap = server.stats.snapshot()
        script.calls.clear()  # the streamed run: the same script again
        streamed = asyncio.run(run(streamed=True))
        assert len(samples(server, sid, key)) == 4
    assert final == streamed == ANSWER and seen == [(2, 3), (2, 3)]
    assert (
        snap["durations"]["responses"]["buckets"][-1] == 2 and snap["durations"]["chat_completions"]["buckets"][-1] == 0
    )
    assert len(records) == 2 and chained(records) and snap["fresh_renders"] == {"edited": 0, "template": 0}
    for rec in records:
        check_sample(rec)
    second_prompt = renderer.tokenizer.decode(script.calls[1][0])
    assert second_prompt.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"), second_prompt[-200:]
    assert "Add numbers with the add tool." in second_prompt


def test_responses_errors_reach_the_sdk_as_bad_requests(renderer: ChatRenderer) -> None:
    with serving(Scripted(renderer, ["x"]), renderer) as server:
        _, key = new_session(server)
        client = OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        with client, pytest.raises(openai.BadRequestError, match="previous_response_id is not supported"):
            client.responses.create(model="m", input="hi", previous_response_id="resp_1")
