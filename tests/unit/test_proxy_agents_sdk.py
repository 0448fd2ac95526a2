"""An agent written with the OpenAI Agents SDK (``agents``) runs against the proxy unchanged: it
calls its tool, gets the result back to the model and answers; the session's samples chain.
The Generate is SCRIPTED (a real <tool_call> reply, then an answer): the 135M model does not
call tools on demand."""

from __future__ import annotations

import asyncio

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from proxy_helpers import SMOL, Scripted, chained, check_sample, new_session, samples, serving

from treetrain.engines import builtin
from treetrain.proxy.chat import ChatRenderer

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "2 + 3 = 5."


def test_an_agents_sdk_agent_calls_its_tool_through_the_proxy() -> None:
    set_tracing_disabled(True)
    renderer = ChatRenderer(builtin.load_tokenizer(SMOL))
    script = Scripted(renderer, [CALL, ANSWER])
    seen: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    with serving(script, renderer) as server:
        sid, key = new_session(server)

        async def run() -> str:
            async with AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as client:
                model = OpenAIChatCompletionsModel(model="proxy-model", openai_client=client)
                agent = Agent(name="adder", instructions="Add numbers with the add tool.", tools=[add], model=model)
                result = await Runner.run(agent, "What is 2 + 3?")
                return str(result.final_output)

        final = asyncio.run(run())
        records = samples(server, sid, key)
        fresh = server.stats.snapshot()["fresh_renders"]
    assert final == ANSWER and seen == [(2, 3)]
    assert len(records) == 2 and chained(records)
    for rec in records:
        check_sample(rec)
    # The tool's result reached the model, as a tool turn after the sampled call.
    second_prompt = renderer.tokenizer.decode(script.calls[1][0])
    assert second_prompt.endswith("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"), second_prompt[-200:]
    assert "Add numbers with the add tool." in second_prompt
    assert fresh == {"edited": 0, "template": 0}
