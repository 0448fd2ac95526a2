"""treetrain.proxy.chat: token-in/token-out prompts on real chat templates, tool-call parsing, message checks.

The templates of Qwen2.5, Qwen3 and Llama 3.1 (tests/unit/chat_templates/, each naming its source) run on a copy of
the embedded SmolLM2 tokenizer; their special tokens are added to the copy so that they are single ids, as on the
real models. The replies are synthetic "sampled" ids: what matters is which ids each next prompt reuses.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from treetrain.engines.builtin import load_tokenizer
from treetrain.proxy.chat import FRESH_REASONS, ChatError, ChatRenderer, Prompt, Reply, Turn, normalize_messages
from treetrain.proxy.tools import parse_reply

TEMPLATES = Path(__file__).parent / "chat_templates"
SPECIAL = {
    "qwen2.5": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
    "qwen3": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
    "llama3.1": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    return load_tokenizer("builtin:smollm2-135m")


def template_text(name: str) -> str:
    """The fixture less its first line (the header naming the source)."""
    return (TEMPLATES / f"{name}.jinja").read_text().split("\n", 1)[1]


def tokenizer_for(base: Any, name: str) -> Any:
    tokenizer = copy.deepcopy(base)
    if name != "smollm2":
        tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[name]})
        tokenizer.chat_template = template_text(name)
    return tokenizer


def end_marker(name: str) -> str:
    return "<|eot_id|>" if name == "llama3.1" else "<|im_end|>"


def call_text(name: str, city: str) -> str:
    """A tool call written the way the family's model writes one."""
    if name == "llama3.1":
        return json.dumps({"name": "get_weather", "parameters": {"city": city}})
    return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "\n</tool_call>"


def sample(tokenizer: Any, text: str, name: str) -> list[int]:
    """Sampled ids for ``text``, ending with the end-of-turn token the sampler stops on (and keeps)."""
    return list(tokenizer.encode(text + end_marker(name), add_special_tokens=False))


def sdk_echo(reply: Reply) -> dict[str, Any]:
    """The assistant message as the openai SDK sends it back (``message.model_dump()``)."""
    from openai.types.chat import ChatCompletionMessage

    return ChatCompletionMessage.model_validate(reply.message()).model_dump()


class Session:
    """Drives a conversation the way the proxy does: each completion becomes a Turn of the history."""

    def __init__(self, renderer: ChatRenderer, tokenizer: Any, name: str) -> None:
        self.renderer, self.tokenizer, self.name = renderer, tokenizer, name
        self.history: list[Turn] = []

    def complete(self, messages: list[dict[str, Any]], text: str) -> tuple[Prompt, Reply, list[int]]:
        normalized = normalize_messages(messages)
        prompt = self.renderer.prompt(list(normalized), TOOLS, self.history)
        sampled = sample(self.tokenizer, text, self.name)
        reply = self.renderer.reply(sampled, "stop")
        reply_message = normalize_messages([reply.message()])[0]
        self.history.append(Turn(normalized, reply_message, tuple(prompt.tokens + sampled)))
        return prompt, reply, sampled


def fresh_text(renderer: ChatRenderer, messages: list[dict[str, Any]]) -> str:
    return renderer.tokenizer.decode(renderer.fresh(normalize_messages(messages), TOOLS), skip_special_tokens=False)


# ---------------------------------------------------------------- token in, token out


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "llama3.1"])
def test_a_tool_using_conversation_extends_the_sampled_tokens_exactly(smollm2: Any, name: str) -> None:
    tokenizer = tokenizer_for(smollm2, name)
    renderer = ChatRenderer(tokenizer)
    session = Session(renderer, tokenizer, name)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer questions about the weather."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    prompt, reply, _ = session.complete(messages, call_text(name, "Paris"))
    assert (prompt.parent, prompt.fresh_reason) == (None, None)
    assert reply.finish_reason == "tool_calls" and reply.tool_calls[0]["function"]["name"] == "get_weather"

    steps = [
        ({"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": '{"sky": "clear"}'}, "It is clear."),
        ({"role": "user", "content": "And in Rome?"}, call_text(name, "Rome")),
        ({"role": "tool", "tool_call_id": "", "content": '{"sky": "rain"}'}, "It rains in Rome."),
        ({"role": "user", "content": "Thanks!"}, "You are welcome."),
    ]
    for step, (new_message, text) in enumerate(steps):
        if new_message["role"] == "tool":
            new_message = dict(new_message, tool_call_id=reply.tool_calls[0]["id"])
        messages += [sdk_echo(reply), new_message]
        previous = session.history[-1]
        prompt, reply, _ = session.complete(messages, text)
        assert (prompt.parent, prompt.fresh_reason) == (len(session.history) - 2, None), step
        assert prompt.tokens[: len(previous.tokens)] == list(previous.tokens), step
        if name != "smollm2":  # its template writes no tool calls, so a fresh render would drop them
            # Exact, too: the same text as rendering the whole conversation from scratch.
            assert tokenizer.decode(prompt.tokens, skip_special_tokens=False) == fresh_text(renderer, messages), step


def test_qwen3_chains_through_tool_results_and_counts_a_new_question_as_template(smollm2: Any) -> None:
    """Qwen3 keeps the <think> of the replies since the last question and drops older ones: a tool loop chains,
    the next user question cannot (the template rewrites the earlier turns)."""
    tokenizer = tokenizer_for(smollm2, "qwen3")
    renderer = ChatRenderer(tokenizer)
    session = Session(renderer, tokenizer, "qwen3")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    _, reply, _ = session.complete(
        messages, "<think>\nI should look it up.\n</think>\n\n" + call_text("qwen3", "Paris")
    )
    assert reply.reasoning == "I should look it up." and reply.tool_calls and reply.content is None

    echo = sdk_echo(reply)
    echo.pop("reasoning_content", None)  # SDKs may drop it: the sampled ids hold the reasoning anyway
    messages += [echo, {"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": "clear"}]
    previous = session.history[-1]
    prompt, reply, _ = session.complete(messages, "<think>\nIt says clear.\n</think>\n\nIt is clear.")
    assert (prompt.parent, prompt.fresh_reason) == (0, None)
    assert prompt.tokens[: len(previous.tokens)] == list(previous.tokens)
    assert reply.reasoning == "It says clear." and reply.content == "It is clear."

    messages += [sdk_echo(reply), {"role": "user", "content": "And Rome?"}]
    prompt, _, _ = session.complete(messages, "Rain.")
    assert (prompt.parent, prompt.fresh_reason) == (None, "template")
    assert tokenizer.decode(prompt.tokens, skip_special_tokens=False) == fresh_text(renderer, messages)
    assert "I should look it up." not in tokenizer.decode(prompt.tokens)  # the template dropped it


def test_qwen3_chains_a_reply_sampled_without_thinking(smollm2: Any) -> None:
    """Rendered last, a Qwen3 reply gets an empty <think> block that the same reply inside a longer conversation
    does not: the template check fails, but the recorded ids are still an exact prefix of the fresh render."""
    tokenizer = tokenizer_for(smollm2, "qwen3")
    renderer = ChatRenderer(tokenizer)
    session = Session(renderer, tokenizer, "qwen3")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    _, reply, _ = session.complete(messages, call_text("qwen3", "Paris"))
    assert reply.reasoning is None
    messages += [sdk_echo(reply), {"role": "tool", "tool_call_id": reply.tool_calls[0]["id"], "content": "clear"}]
    previous = session.history[-1]
    prompt, _, _ = session.complete(messages, "Clear.")
    assert (prompt.parent, prompt.fresh_reason) == (0, None)
    assert prompt.tokens[: len(previous.tokens)] == list(previous.tokens)
    assert tokenizer.decode(prompt.tokens, skip_special_tokens=False) == fresh_text(renderer, messages)


@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "qwen3", "llama3.1"])
def test_an_edited_reply_is_a_fresh_render_counted_as_edited(smollm2: Any, name: str) -> None:
    tokenizer = tokenizer_for(smollm2, name)
    session = Session(ChatRenderer(tokenizer), tokenizer, name)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hi."}]
    _, reply, _ = session.complete(messages, "Hi!")
    edited = dict(sdk_echo(reply), content="Hello!")
    prompt, _, _ = session.complete([*messages, edited, {"role": "user", "content": "Again."}], "Hi!")
    assert (prompt.parent, prompt.fresh_reason) == (None, "edited")
    # An assistant message the proxy never returned (a few-shot example) is the same case.
    few_shot = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}, *messages]
    prompt, _, _ = session.complete(few_shot, "Hi!")
    assert (prompt.parent, prompt.fresh_reason) == (None, "edited")
    assert set(FRESH_REASONS) == {"edited", "template"}


def test_sampled_ids_are_reused_even_when_their_text_would_tokenize_otherwise(smollm2: Any) -> None:
    tokenizer = tokenizer_for(smollm2, "smollm2")
    renderer = ChatRenderer(tokenizer)
    odd = [*tokenizer.encode("Hel", add_special_tokens=False), *tokenizer.encode("lo world", add_special_tokens=False)]
    sampled = [*odd, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert tokenizer.encode(tokenizer.decode(sampled), add_special_tokens=False) != sampled  # a non-canonical split
    messages = normalize_messages([{"role": "user", "content": "Greet."}])
    first = renderer.prompt(list(messages), None, [])
    reply = renderer.reply(sampled, "stop")
    assert reply.content == "Hello world"
    history = [Turn(messages, normalize_messages([reply.message()])[0], tuple(first.tokens + sampled))]
    follow = [*messages, reply.message(), {"role": "user", "content": "Again."}]
    prompt = renderer.prompt(follow, None, history)
    assert prompt.parent == 0
    assert prompt.tokens[: len(first.tokens) + len(sampled)] == first.tokens + sampled


def test_a_reply_cut_by_the_length_limit_gets_the_end_of_turn_appended(smollm2: Any) -> None:
    tokenizer = tokenizer_for(smollm2, "smollm2")
    renderer = ChatRenderer(tokenizer)
    messages = normalize_messages([{"role": "user", "content": "Count."}])
    first = renderer.prompt(list(messages), None, [])
    sampled = list(tokenizer.encode("one two thr", add_special_tokens=False))
    reply = renderer.reply(sampled, "length")
    assert (reply.content, reply.finish_reason) == ("one two thr", "length")
    history = [Turn(messages, normalize_messages([reply.message()])[0], tuple(first.tokens + sampled))]
    prompt = renderer.prompt([*messages, reply.message(), {"role": "user", "content": "Go on."}], None, history)
    assert prompt.parent == 0
    tail = tokenizer.decode(prompt.tokens[len(first.tokens) + len(sampled) :], skip_special_tokens=False)
    assert tail == "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"


def test_the_latest_matching_turn_is_extended(smollm2: Any) -> None:
    """Two completions of the same prompt (a retry): the request continues the one whose reply it carries."""
    tokenizer = tokenizer_for(smollm2, "smollm2")
    renderer = ChatRenderer(tokenizer)
    session = Session(renderer, tokenizer, "smollm2")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Pick a number."}]
    _, first, _ = session.complete(messages, "Seven.")
    session.complete(messages, "Three.")
    session.complete(messages, "Seven.")
    prompt, _, _ = session.complete([*messages, sdk_echo(first), {"role": "user", "content": "Why?"}], "Luck.")
    assert prompt.parent == 2


def test_concurrent_sessions_render_as_a_serial_run(smollm2: Any) -> None:
    """The server renders from many threads with one renderer (one tokenizer)."""
    from concurrent.futures import ThreadPoolExecutor

    tokenizer = tokenizer_for(smollm2, "qwen2.5")
    renderer = ChatRenderer(tokenizer)

    def conversation(i: int) -> list[list[int]]:
        session = Session(renderer, tokenizer, "qwen2.5")
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Question {i}?"}]
        prompts = []
        for turn in range(4):
            prompt, reply, _ = session.complete(messages, f"Answer {i}.{turn} " * (turn + 1))
            prompts.append(prompt.tokens)
            messages += [sdk_echo(reply), {"role": "user", "content": f"More {turn}?"}]
        return prompts

    serial = [conversation(i) for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(conversation, range(8))) == serial


@pytest.mark.parametrize(
    ("name", "opening", "after_name"),
    [
        ("smollm2", '<tool_call>\n{"name": "', '", "arguments":'),  # writes no calls: the Hermes opening
        ("qwen2.5", '<tool_call>\n{"name": "', '", "arguments":'),
        ("qwen3", '<think>\n\n</think>\n\n<tool_call>\n{"name": "', '", "arguments":'),
        ("llama3.1", '{"name": "', '", "parameters":'),
    ],
)
def test_the_forced_tool_call_opening_is_read_off_the_template(
    smollm2: Any, name: str, opening: str, after_name: str
) -> None:
    """tool_choice required / named: the reply starts with the opening; opening + what the model then
    writes reads as the call."""
    tokenizer = tokenizer_for(smollm2, name)
    renderer = ChatRenderer(tokenizer)
    assert renderer.call_opening(None)[0] == opening
    text, ids = renderer.call_opening("get_weather")
    assert text == opening + "get_weather" + after_name
    assert ids == list(tokenizer.encode(text, add_special_tokens=False))
    rest = ' {"city": "Paris"}}' + ("\n</tool_call>" if "tool_call" in opening else "")
    reply = renderer.reply([*ids, *sample(tokenizer, rest, name)], "stop")
    assert [c["function"] for c in reply.tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_stop_tokens_and_fresh_render(smollm2: Any) -> None:
    stops = ChatRenderer(tokenizer_for(smollm2, "smollm2")).stop_token_ids
    assert stops[0] == smollm2.eos_token_id == smollm2.convert_tokens_to_ids("<|im_end|>")
    assert set(stops) == {smollm2.eos_token_id, smollm2.convert_tokens_to_ids("<|endoftext|>")}
    llama = tokenizer_for(smollm2, "llama3.1")
    renderer = ChatRenderer(llama)
    assert llama.convert_tokens_to_ids("<|eot_id|>") in renderer.stop_token_ids
    assert llama.convert_tokens_to_ids("<|eom_id|>") in renderer.stop_token_ids
    messages = normalize_messages([{"role": "user", "content": "Hi"}])
    text = llama.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    prompt = renderer.prompt(list(messages), [], [])  # no tools: the same as None
    assert prompt == Prompt(list(llama.encode(text, add_special_tokens=False)), None, None)
    assert prompt.tokens.count(llama.bos_token_id) == 1  # the template writes the BOS; encoding adds none
    assert renderer.render_text_prompt("Once upon a time") == list(llama.encode("Once upon a time"))


def test_a_conversation_the_template_refuses_is_a_chat_error(smollm2: Any) -> None:
    renderer = ChatRenderer(tokenizer_for(smollm2, "llama3.1"))
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for i in range(2)
    ]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(ChatError, match="only supports single tool-calls"):
        renderer.prompt(messages, TOOLS, [])
    no_template = copy.deepcopy(smollm2)
    no_template.chat_template = None
    with pytest.raises(ChatError, match="no chat template"):
        ChatRenderer(no_template).prompt([{"role": "user", "content": "Hi"}], None, [])


# ---------------------------------------------------------------- replies


def test_one_tool_call(smollm2: Any) -> None:
    renderer = ChatRenderer(smollm2)
    reply = renderer.reply(sample(smollm2, call_text("qwen2.5", "Paris"), "smollm2"), "stop")
    assert reply.content is None and reply.finish_reason == "tool_calls"
    (call,) = reply.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_two_tool_calls_with_text_around() -> None:
    text = (
        'Let me check both.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    )
    parsed = parse_reply(text)
    assert parsed.content == "Let me check both."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"x": 1}, {"y": [2]}]
    assert parsed.tool_calls[0]["id"] != parsed.tool_calls[1]["id"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>',  # broken JSON
        '<tool_call>{"name": "a"}</tool_call><tool_call>not json</tool_call>',  # one good, one broken
        '<tool_call>\n{"name": "a", "arguments": {"x":',  # cut by the length limit
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',  # arguments not an object
        "<tool_call>[1, 2]</tool_call>",
    ],
)
def test_a_broken_tool_call_stays_text(smollm2: Any, text: str) -> None:
    reply = ChatRenderer(smollm2).reply(sample(smollm2, text, "smollm2"), "stop")
    assert (reply.content, reply.tool_calls, reply.finish_reason) == (text, [], "stop")


def test_no_tool_calls_and_llama_style_calls() -> None:
    assert parse_reply("Just words.").content == "Just words."
    assert parse_reply('{"answer": 42}').tool_calls == []  # JSON, but not a call
    llama = parse_reply('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert llama.content is None
    assert llama.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}


def test_reasoning() -> None:
    parsed = parse_reply("<think>\nStep one.\n</think>\n\nThe answer.")
    assert (parsed.reasoning, parsed.content) == ("Step one.", "The answer.")
    opened_by_template = parse_reply("Step one.\n</think>\n\nThe answer.")  # the prompt ended with <think>
    assert (opened_by_template.reasoning, opened_by_template.content) == ("Step one.", "The answer.")
    cut = parse_reply("<think>\nStill thinking")
    assert (cut.reasoning, cut.content) == ("Still thinking", "")
    assert parse_reply("No thoughts.").reasoning is None
    assert Reply("x", [], "why", "stop").message() == {"role": "assistant", "content": "x", "reasoning_content": "why"}


def test_the_tokenizers_own_response_parser_is_used_when_it_has_one(smollm2: Any) -> None:
    tokenizer = copy.deepcopy(smollm2)
    tokenizer.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "thinking": {"open": "<think>", "close": "</think>"},
            "tool_calls": {
                "open": "<tool_call>",
                "close": "</tool_call>",
                "content": "json",
                "repeats": True,
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {},
        },
    }
    renderer = ChatRenderer(tokenizer)
    text = '<think>hmm</think>Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    reply = renderer.reply(sample(tokenizer, text, "smollm2"), "stop")
    assert (reply.reasoning, reply.content, reply.finish_reason) == ("hmm", "Sure.", "tool_calls")
    assert reply.tool_calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    broken = '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>'  # its parser raises: ours keeps the text
    assert renderer.reply(sample(tokenizer, broken, "smollm2"), "stop").content == broken
    # A template whose generation prompt opens the thinking block (Qwen3 thinking models): the parser gets that
    # prompt as context, so the reply's first part is read as reasoning.
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>'"
    )
    reply = ChatRenderer(tokenizer).reply(sample(tokenizer, "hmm</think>The answer.", "smollm2"), "stop")
    assert (reply.reasoning, reply.content) == ("hmm", "The answer.")


# ---------------------------------------------------------------- normalize_messages


def test_the_sdk_echo_of_a_reply_normalizes_to_the_reply() -> None:
    from openai.types.chat import ChatCompletionMessage

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    reply = Reply(content=None, tool_calls=[call], reasoning="because", finish_reason="tool_calls")
    ours = normalize_messages([reply.message()])
    dumped = ChatCompletionMessage.model_validate(reply.message()).model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    agents_style = {"role": "assistant", "content": None, "tool_calls": [dict(call, extra_content=None)]}
    assert normalize_messages([dumped]) == ours
    assert normalize_messages([agents_style])[0] == {k: v for k, v in ours[0].items() if k != "reasoning"}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalize_messages([parts]) == ({"role": "user", "content": "ab"},)
    empty = normalize_messages([{"role": "assistant", "content": ""}, {"role": "assistant", "tool_calls": []}])
    assert empty == ({"role": "assistant", "content": None},) * 2
    assert normalize_messages(list(normalize_messages([dumped]))) == ours  # idempotent


def test_the_agents_sdk_reconstruction_of_a_reply_matches_it(smollm2: Any) -> None:
    """The OpenAI Agents SDK turns a reply into output items and back into a message (dropping the reasoning)."""
    from agents.models.chatcmpl_converter import Converter
    from openai.types.chat import ChatCompletionMessage

    renderer = ChatRenderer(smollm2)
    for text in [
        "<think>Hm.</think>Let me see." + call_text("qwen2.5", "Oslo"),
        "Plain words.",
        call_text("x", "Rome"),
    ]:
        reply = renderer.reply(sample(smollm2, text, "smollm2"), "stop")
        items = Converter.message_to_output_items(ChatCompletionMessage.model_validate(reply.message()))
        (rebuilt,) = Converter.items_to_messages([item.model_dump(exclude_unset=True) for item in items])
        ours = normalize_messages([reply.message()])[0]
        history = [Turn(normalize_messages([{"role": "user", "content": "Go."}]), ours, (1, 2, 3))]
        follow = [{"role": "user", "content": "Go."}, dict(rebuilt), {"role": "user", "content": "More."}]
        assert renderer.prompt(follow, None, history).parent == 0, text


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ("hello", "messages:"),
        ([], "messages:"),
        (["hi"], "messages[0]:"),
        ([{"role": "robot", "content": "x"}], "messages[0].role:"),
        ([{"role": "user"}], "messages[0].content:"),
        ([{"role": "user", "content": None}], "messages[0].content:"),
        ([{"role": "user", "content": 3}], "messages[0].content:"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]:"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": "r"}], "messages[1].tool_call_id:"),
        ([{"role": "assistant", "tool_calls": {"id": "x"}}], "messages[0].tool_calls:"),
        (
            [{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}],
            "messages[0].tool_calls[0].id:",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name:",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 1}}]}],
            "messages[0].tool_calls[0].function.arguments:",
        ),
        ([{"role": "assistant", "content": "x", "reasoning_content": 1}], "messages[0].reasoning_content:"),
    ],
)
def test_malformed_messages_are_refused_naming_the_field(messages: Any, field: str) -> None:
    with pytest.raises(ChatError) as err:
        normalize_messages(messages)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_normalizing_a_long_conversation_is_linear() -> None:
    """100k messages (the server caps bodies far lower): one pass, no quadratic join or copy."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}] * 3}] * 100_000
    assert len(normalize_messages(messages)) == 100_000
