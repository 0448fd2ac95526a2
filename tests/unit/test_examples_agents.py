"""The agent examples: examples/agents/calculator_agent.py against a scripted OpenAI-compatible
server and against the in-process proxy (token in, token out across its tool turn), the RLJob
that trains it through the operator's plan and admission, the two trainer configs and their
rows, and (slow) both trainer examples run shortened, their reward rising."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import openai
import pytest
import yaml

from rljob_operator.plan import Limits, PlanError, plan
from treetrain.config import load
from treetrain.rl.agent import load_agent
from treetrain.rl.rollout import Generation, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from json_http import JSONHandler  # noqa: E402
from suite_helpers import subprocess_env  # noqa: E402

AGENTS = ROOT / "examples" / "agents"
ROW = {
    "question": "A crate holds 12 boxes of 30 pencils, and 4 boxes are sold. How many are left?",
    "answer": "#### 240",
}


@pytest.fixture
def calc(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example module, imported the way the trainer imports trainer.agent."""
    monkeypatch.syspath_prepend(str(AGENTS))
    agent = load_agent("calculator_agent:run")
    import calculator_agent

    assert agent is calculator_agent.run
    return calculator_agent


# ---------------------------------------------------------------------------
# The calculator and the score


@pytest.mark.parametrize(
    ("expression", "value"),
    [("(12 + 30) * 4", "168"), ("7 / 2", "3.5"), ("2 ** 10", "1024"), ("2^3", "8"), ("-3 + +2", "-1"), ("10 % 4", "2")],
)
def test_the_calculator_evaluates_arithmetic(calc: ModuleType, expression: str, value: str) -> None:
    assert calc.tool_result(json.dumps({"expression": expression})) == value


@pytest.mark.parametrize(
    ("expression", "words"),
    [
        ("__import__('os').system('true')", "not Call"),
        ("open('/etc/passwd')", "not Call"),
        ("x + 1", "not Name"),
        ("().__class__", "not Attribute"),
        ("9 ** 9 ** 9", "exponent"),
        ("1 / 0", "division by zero"),
        ("1e400", "out of range"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
def test_the_calculator_runs_no_code_and_answers_errors(calc: ModuleType, expression: str, words: str) -> None:
    result = calc.tool_result(json.dumps({"expression": expression}))
    assert result.startswith("error: ") and words in result, result


def test_bad_tool_arguments_are_an_answer_not_a_crash(calc: ModuleType) -> None:
    for arguments in ("not json", "{}", '{"expression": 3}'):
        assert calc.tool_result(arguments).startswith("error: arguments must be JSON")


def test_the_score_reads_gsm8k_answers(calc: ModuleType) -> None:
    assert calc.score("so 12 * 20 = 240\n#### 240", "4 * 60\n#### 240") == 1.0
    assert calc.score("The answer is 1,240.", "#### 1240") == 1.0  # no ####: math-verify reads the whole reply
    assert calc.score("#### 241", "#### 240") == 0.0
    assert calc.score("no number", "#### 240") == 0.0
    assert calc.score(None, 240) == 0.0
    assert calc.score("#### 3.5", 3.5) == 1.0


# ---------------------------------------------------------------------------
# Against a scripted OpenAI-compatible server


class ScriptedChat(JSONHandler):
    """Answers /v1/chat/completions with ``replies`` in turn; records each request body."""

    replies: ClassVar[list[dict[str, Any]]] = []
    bodies: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self._body()
        self.bodies.append(body)
        message = self.replies[min(len(self.bodies), len(self.replies)) - 1]
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        self._reply(
            200,
            {
                "id": f"chatcmpl-{len(self.bodies)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )


def _call(expression: str, call_id: str = "call_1") -> dict[str, Any]:
    arguments = json.dumps({"expression": expression})
    return {"id": call_id, "type": "function", "function": {"name": "calculator", "arguments": arguments}}


@pytest.fixture
def scripted() -> Iterator[tuple[str, type[ScriptedChat]]]:
    handler = type("Handler", (ScriptedChat,), {"replies": [], "bodies": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def _play(calc: ModuleType, url: str, row: dict[str, Any], key: str = "sk-test", **kwargs: Any) -> float:
    async def go() -> float:
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=60) as client:
            return float(await calc.run(client, row, **kwargs))

    return asyncio.run(go())


def test_the_agent_calls_the_tool_sends_the_result_back_and_scores(
    calc: ModuleType, scripted: tuple[str, type[ScriptedChat]]
) -> None:
    url, handler = scripted
    first = {"role": "assistant", "content": None, "tool_calls": [_call("12 * 30 - 4 * 30", "call_a")]}
    handler.replies = [first, {"role": "assistant", "content": "12*30 - 4*30 = 240\n#### 240"}]
    assert _play(calc, url, ROW) == 1.0
    assert len(handler.bodies) == 2
    request = handler.bodies[0]
    assert request["tools"] == [calc.CALCULATOR] and request["model"] == "policy"
    # The system prompt, the worked examples (question, call, result, answer), then the row's question.
    examples = ["user", "assistant", "tool", "assistant"] * len(calc.EXAMPLES)
    assert [m["role"] for m in request["messages"]] == ["system", *examples, "user"]
    assert request["messages"][-1]["content"] == ROW["question"]
    n = len(request["messages"])
    follow = handler.bodies[1]["messages"]
    assert follow[:n] == request["messages"]
    assert follow[n] == first  # the assistant message exactly as returned: no field added or dropped
    assert follow[n + 1] == {"role": "tool", "tool_call_id": "call_a", "content": "240"}


def test_the_worked_examples_are_calls_the_proxy_reads_and_the_calculator_answers(calc: ModuleType) -> None:
    """Each example's call, written as text, is what the proxy's parser turns into the same tool
    call; its result is what the calculator answers; no example is a row of the data."""
    from treetrain.proxy.tools import parse_reply

    messages = calc.worked_examples()
    calls = [m for m in messages if m["role"] == "assistant" and "tool_calls" in m]
    assert len(calls) == len(calc.EXAMPLES) == 2
    for message, (_, expression, result) in zip(calls, calc.EXAMPLES, strict=True):
        parsed = parse_reply(message["content"])
        assert parsed.content is None and len(parsed.tool_calls) == 1
        (call,) = message["tool_calls"]
        assert parsed.tool_calls[0]["function"] == call["function"]
        assert json.loads(call["function"]["arguments"]) == {"expression": expression}
        assert calc.tool_result(call["function"]["arguments"]) == result
    questions = {json.loads(line)["question"] for line in (AGENTS / "train.jsonl").read_text().splitlines()}
    assert not questions & {text for text, _, _ in calc.EXAMPLES}


def test_a_wrong_answer_scores_0_and_a_model_that_never_stops_calling_is_cut(
    calc: ModuleType, scripted: tuple[str, type[ScriptedChat]]
) -> None:
    url, handler = scripted
    handler.replies = [{"role": "assistant", "content": "#### 7"}]
    assert _play(calc, url, ROW) == 0.0
    handler.bodies.clear()
    handler.replies = [{"role": "assistant", "content": None, "tool_calls": [_call("1 + 1"), _call("x", "call_2")]}]
    assert _play(calc, url, ROW, max_turns=3) == 0.0
    assert len(handler.bodies) == 3
    examples = len(calc.worked_examples())
    tools = [m for m in handler.bodies[-1]["messages"][examples:] if m["role"] == "tool"]
    assert [t["content"] for t in tools] == ["2", "error: only numbers and + - * / // % ** are allowed, not Name"] * 2


# ---------------------------------------------------------------------------
# Against the trainer's proxy (in-process, a scripted generate on the real tokenizer)


class ScriptedGenerate:
    """A Generate that answers the k-th call with ``replies[k]``, closed by the end-of-turn token."""

    def __init__(self, renderer: Any, replies: list[str]) -> None:
        self.renderer, self.replies = renderer, replies
        self.prompts: list[list[int]] = []

    def __call__(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Generation]:
        text = self.replies[min(len(self.prompts), len(self.replies) - 1)]
        self.prompts.extend(list(p) for p in prompts)
        tokens = [*self.renderer.tokenizer.encode(text, add_special_tokens=False), self.renderer.stop_token_ids[-1]]
        return [Generation(list(tokens), [-0.5] * len(tokens), "stop", [3] * len(tokens)) for _ in prompts]


def test_the_agent_through_the_proxy_extends_its_tokens_across_the_tool_turn(calc: ModuleType) -> None:
    from treetrain.engines.builtin import load_tokenizer
    from treetrain.proxy.chat import ChatRenderer
    from treetrain.proxy.server import ProxyServer, RLService

    renderer = ChatRenderer(load_tokenizer("builtin:smollm2-135m"))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 30 - 4 * 30"}}</tool_call>'
    generate = ScriptedGenerate(renderer, [call, "That is 240.\n#### 240"])
    server = ProxyServer(RLService(generate=generate, renderer=renderer, model_name="builtin:smollm2-135m"))
    server.start("127.0.0.1", 0)
    try:
        session = server.service.open_session(seed=1)
        assert _play(calc, server.url + "/v1", ROW, key=session.api_key) == 1.0
        (first, second), _ = server.service.samples(session.id)
        stats = server.stats.snapshot()
    finally:
        server.close()
    # The second prompt is the first prompt, its sampled tokens, then only the rendered tool message.
    assert generate.prompts[1][: len(first.input_ids)] == first.input_ids
    # The first request holds the worked examples, assistant turns the proxy did not write: one
    # `edited` render (it had nothing to extend); the tool turn extends it token for token.
    assert stats["fresh_renders"] == {"edited": 1, "template": 0}
    assert second.input_ids[: len(first.input_ids)] == first.input_ids
    assert sum(first.loss_mask) == len(renderer.tokenizer.encode(call, add_special_tokens=False)) + 1
    assert len(second.input_ids) == len(second.loss_mask) == len(second.logprobs) == len(second.versions)


# ---------------------------------------------------------------------------
# The RLJob and the trainer configs


def test_the_agent_rljob_is_valid_for_rljob_plan() -> None:
    manifest = yaml.safe_load((ROOT / "examples" / "rljob-agent.yaml").read_text())
    p = plan(manifest)
    assert p.config is not None and p.config.trainer.agent == "calculator_agent:run"
    assert p.openai_endpoint() == "http://calc-trainer-0.calc-trainer.default.svc:8000/v1"
    job = next(o for o in p.objects if o["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    assert {"name": "data", "configMap": {"name": "calc-rows"}} in pod["volumes"]
    # The dataset paths are files of the mounted ConfigMap: its keys are the example files' names.
    for path in (p.config.trainer.dataset.path, p.config.trainer.eval.dataset.path):  # type: ignore[union-attr]
        assert path.startswith("/data/") and (ROOT / "examples" / "agents" / path.removeprefix("/data/")).is_file()
    # The same manifest under an operator that pins modules: listed, it passes; not listed, refused.
    assert plan(manifest, limits=Limits(task_modules=("calculator_agent",))).objects
    with pytest.raises(PlanError) as info:
        plan(copy.deepcopy(manifest), limits=Limits(task_modules=("acme.agents",)))
    assert [e.path for e in info.value.errors] == ["spec.trainerConfig.agent"]


@pytest.mark.parametrize("name", ["trainer-agent.yaml", "trainer-gsm8k.yaml"])
def test_the_trainer_configs_parse_and_their_rows_exist(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the configs' dataset paths are relative to the repository root
    config, _ = load(ROOT / "examples" / name, env={})
    t = config.trainer
    assert config.model.path == "builtin:smollm2-135m" and t.reward == "builtin:math"
    assert t.dataset is not None and t.eval is not None
    assert (t.agent == "calculator_agent:run") is (name == "trainer-agent.yaml")
    for settings in (t.dataset, t.eval.dataset):
        rows = [json.loads(line) for line in Path(settings.path).read_text().splitlines()]
        assert rows and all(isinstance(r[settings.prompt_field], str) for r in rows)
        assert all(r[settings.answer_field].rpartition("#### ")[2].isdigit() for r in rows)


def test_the_sdk_session_in_docs_agents_runs_as_written() -> None:
    """docs/agents.md's openai SDK example, against the in-process proxy (its address swapped in)."""
    from treetrain.engines.builtin import load_tokenizer
    from treetrain.proxy.chat import ChatRenderer
    from treetrain.proxy.server import ProxyServer, RLService

    doc = (ROOT / "docs" / "agents.md").read_text()
    code = doc.split("The same with the openai SDK", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'base = "http://127.0.0.1:8000"' in code
    renderer = ChatRenderer(load_tokenizer("builtin:smollm2-135m"))
    generate = ScriptedGenerate(renderer, ["7 * 6 = 42.", "84."])
    server = ProxyServer(RLService(generate=generate, renderer=renderer, model_name="builtin:smollm2-135m"))
    server.start("127.0.0.1", 0)
    try:
        scope: dict[str, Any] = {}
        exec(compile(code.replace("http://127.0.0.1:8000", server.url), "docs/agents.md", "exec"), scope)
        stats = server.stats.snapshot()
    finally:
        server.close()
    samples = scope["samples"]
    assert len(samples) == 2 and stats["fresh_renders"] == {"edited": 0, "template": 0}
    assert server.service.samples(scope["session"]["id"])[1] == 1.0


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_agent_rows_are_make_data_output_and_need_the_calculator() -> None:
    make_data = _module(AGENTS / "make_data.py")
    for name, n, seed in (("train", 64, 0), ("test", 16, 1)):
        rows = [json.loads(line) for line in (AGENTS / f"{name}.jsonl").read_text().splitlines()]
        assert rows == make_data.rows(n, seed), f"rerun examples/agents/make_data.py ({name})"
        for row in rows:
            work, _, result = row["answer"].partition("\n#### ")
            a, b = (int(x) for x in work.split(" = ")[0].split(" * "))
            assert 11 <= a <= 99 and 11 <= b <= 99 and int(result) == a * b
            assert f" {a} " in row["question"] and f" {b} " in row["question"]


def test_the_easy_word_problems_are_one_small_addition_asking_for_the_number() -> None:
    make_data = _module(ROOT / "examples" / "gsm8k" / "make_data.py")
    for row in make_data.rows(64, 0):
        assert row["question"].endswith(" Answer with just the number.")
        work, _, result = row["answer"].partition("\n#### ")
        a, b = (int(x) for x in work.split(" = ")[0].split(" + "))
        assert a + b == int(result) <= 21


# ---------------------------------------------------------------------------
# The trainer examples learn (shortened runs of the embedded model on the CPU)


def _run_short(name: str, steps: int, tmp_path: Path, **env: str) -> list[float]:
    """examples/NAME for ``steps`` steps, no evaluation, no checkpoint but the last; the reward of
    each step, read from steps.jsonl."""
    raw = yaml.safe_load((ROOT / "examples" / name).read_text())
    t = raw["trainer"]
    t["steps"] = steps
    t.pop("eval")  # evaluation is one more rollout: the training reward is what is asserted
    t["logSamples"] = t["groupsPerStep"] * t["groupSize"]
    t["dataset"]["path"] = str(ROOT / t["dataset"]["path"])
    raw["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "intervalSteps": steps}
    config = tmp_path / name
    config.write_text(yaml.safe_dump(raw))
    # 3 to 5 minutes each while other jobs shared this 2-core machine: the deadline is for a hang,
    # not a speed test.
    out = subprocess.run(
        [sys.executable, "-m", "treetrain.cli", "train", str(config), "--metrics-port", "0", "--no-compare"],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tmp_path,
        env={**subprocess_env(outside_a_pod=True), **env},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    return [float(r["reward"]) for r in records]


def _rises(rewards: list[float]) -> bool:
    """The last two steps' mean is at least 0.1 above the first step's reward. Measured on this
    2-core machine with seeds 0, 1, 2 (model, trainer and data together): the dataset example
    0.19-0.22 at step 1, 0.42-0.56 over steps 3-4; the agent 0.06-0.25 at step 1, 0.53-0.75 over
    steps 3-4."""
    return sum(rewards[-2:]) / 2 >= rewards[0] + 0.1


@pytest.mark.slow
def test_the_dataset_example_learns_the_easy_word_problems(tmp_path: Path) -> None:
    rewards = _run_short("trainer-gsm8k.yaml", 4, tmp_path)
    assert _rises(rewards), rewards


@pytest.mark.slow
def test_the_agent_example_learns_to_use_the_calculator(tmp_path: Path) -> None:
    # Four steps: the agent's runs share the proxy's batches in the order their calls arrive, so a
    # run's samples depend on timing (same seed, step 1 read 0.06 and 0.25 in two runs side by
    # side); three steps once ended at 0.31, 0.25 under load. Four ended 0.44, 0.62 and 0.62, 0.88.
    rewards = _run_short("trainer-agent.yaml", 4, tmp_path, PYTHONPATH=str(AGENTS))
    assert _rises(rewards), rewards
    # The reward comes through the tool: in the last step, the episodes that score are (nearly all)
    # of two completions or more, the call and then the answer (a bare guess of a two-digit product
    # is rare, not impossible).
    samples = [json.loads(line) for line in (tmp_path / "ckpt" / "samples.jsonl").read_text().splitlines()]
    scored = [s["turns"] for s in samples if s["step"] == len(rewards) and s["reward"] == 1.0]
    assert scored and sum(turns >= 2 for turns in scored) >= 0.8 * len(scored), scored
