"""A tool-using agent for ``trainer.agent: calculator_agent:run``, written against the plain openai SDK.

It sends a row's question with one tool, ``calculator``, runs the calls the model makes (a small
arithmetic evaluator, never ``eval``), sends the results back and, when the model answers without
a tool call, scores that answer against ``row["answer"]`` with treetrain's ``builtin:math``
(GSM8K's ``#### N`` convention). The trainer trains on every completion the proxy recorded for
the run, with the returned reward.

Before the question go two worked examples, as earlier turns of the conversation: a question, the
calculator call, the tool's result, the answer. The embedded 135M model never writes a tool call
from a description alone (its chat template does not show ``tools``), but after two examples it
solves about one row in five before training (a right call, then the result repeated): enough
for RL to have something to reinforce (examples/trainer-agent.yaml).
The proxy did not write those assistant turns, so each run's first request counts as one
``edited`` fresh render; it had nothing to extend anyway, and the later turns extend it token for
token.

Each assistant message goes back into the conversation exactly as the endpoint returned it: the
proxy then extends the earlier prompt's tokens with the sampled ones instead of re-rendering the
conversation (docs/agents.md, "Token in, token out").

Apart from the score, nothing here is treetrain-specific: pointed at any OpenAI-compatible
server it runs the same.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import operator
from collections.abc import Callable
from typing import Any

import openai

from treetrain.rl.rewards import math_reward

SYSTEM = (
    "You are a helpful assistant with a calculator tool. Use it for the arithmetic, then answer with just the number."
)
# (question, expression, result): the worked examples every run starts with (see the module's docstring).
EXAMPLES = (
    ("Ana buys 12 boxes with 34 pencils in each. How many pencils does Ana buy?", "12 * 34", "408"),
    ("There are 57 rows with 21 trees on each. How many trees are there?", "57 * 21", "1197"),
)
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "For example (12 + 30) * 4"}},
            "required": ["expression"],
        },
    },
}
MAX_EXPRESSION = 200  # characters the evaluator reads
MAX_EXPONENT = 64  # 10 ** 64 is plenty for school arithmetic; 9 ** 9 ** 9 would hang the agent
MAX_MAGNITUDE = 1e18

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message goes back to the model."""


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression; CalculatorError for anything else (names, calls,
    huge powers), so a model's mistake costs one tool message, never the run."""
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    value = _value(tree.body)
    if abs(value) > MAX_MAGNITUDE or not math.isfinite(value):
        raise CalculatorError("the result is out of range")
    return value


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))  # type: ignore[no-any-return]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
            raise CalculatorError("the result is out of range")
        return result  # type: ignore[no-any-return]
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def tool_result(arguments: str) -> str:
    """What one calculator call answers: the value, or an error the model can read and retry on."""
    try:
        args = json.loads(arguments)
        expression = args["expression"]
        if not isinstance(expression, str):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return 'error: arguments must be JSON {"expression": "..."}'
    try:
        value = calculate(expression)
    except CalculatorError as err:
        return f"error: {err}"
    return _show(value)


def _show(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(round(value, 10)) if isinstance(value, float) else str(value)


def score(reply: str | None, answer: Any) -> float:
    """1.0 when the reply's final answer (after its last ``####``, else the whole reply) equals the
    row's as mathematics (``builtin:math``); the row's answer is a GSM8K ``... #### 72`` string or a
    number."""
    return math_reward(reply or "", None if answer is None else str(answer))


def question(row: dict[str, Any]) -> str:
    """GSM8K's ``question`` column, else ``prompt``."""
    for key in ("question", "prompt"):
        if isinstance(row.get(key), str):
            return str(row[key])
    raise ValueError(f"the row has no question or prompt string (keys: {sorted(row)})")


def worked_examples() -> list[dict[str, Any]]:
    """EXAMPLES as conversation turns. Each call is in ``tool_calls`` (OpenAI's message rules want one
    before a tool message) and, as the text the model writes, in ``content``: the embedded model's
    chat template shows only content."""
    messages: list[dict[str, Any]] = []
    for i, (text, expression, result) in enumerate(EXAMPLES):
        arguments = json.dumps({"expression": expression})
        call = {"id": f"example_{i}", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        written = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
        messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": written, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": result},
            {"role": "assistant", "content": result},
        ]
    return messages


async def run(client: openai.AsyncOpenAI, row: dict[str, Any], *, model: str = "policy", max_turns: int = 3) -> float:
    """One episode: up to ``max_turns`` completions; the reward of the first reply without a tool
    call, or 0.0 when the model is still calling tools after ``max_turns``. ``model``: the trainer's
    proxy serves one model under any name; give the real name for another server."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        *worked_examples(),
        {"role": "user", "content": question(row)},
    ]
    for _ in range(max_turns):
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[CALCULATOR],
            temperature=1.0,  # type: ignore[arg-type]
        )
        message = completion.choices[0].message
        # Exactly the fields the endpoint returned (nothing filled in, nothing dropped).
        messages.append(message.model_dump(exclude_unset=True))
        if not message.tool_calls:
            # Off the event loop: the other runs of the step share it.
            return await asyncio.to_thread(score, message.content, row.get("answer"))
        for call in message.tool_calls:
            result = (
                tool_result(call.function.arguments) if call.function.name == "calculator" else "error: no such tool"
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
