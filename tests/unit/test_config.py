"""The trainer config schema (treetrain.config): one set of rules for the trainer, `rljob plan`
and the operator. Torch-free: nothing here builds a model."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rljob_operator.plan import PlanError, plan
from treetrain import config as C
from treetrain.config.reference import table

ROOT = Path(__file__).resolve().parents[2]


def minimal(**sections: Any) -> dict[str, Any]:
    return {"model": {"path": "builtin:tiny-llama"}, **sections}


def problems(raw: Any, **kwargs: Any) -> dict[str, str]:
    with pytest.raises(C.ConfigError) as info:
        C.validate(raw, **kwargs)
    return dict(info.value.problems)


def test_defaults_fill_everything_not_written() -> None:
    cfg = C.validate(minimal())
    assert cfg.actor.backend == "fsdp:d1" and cfg.actor.tree_training.block_size == C.DEFAULT_BLOCK_SIZE
    assert cfg.trainer.optimizer.lr == 1e-6 and cfg.rollout.servers == []


def test_camel_and_snake_case_keys_are_both_read() -> None:
    camel = C.validate(minimal(trainer={"groupsPerStep": 3, "optimizer": {"maxGradNorm": 0.5}}))
    snake = C.validate(minimal(trainer={"groups_per_step": 3, "optimizer": {"max_grad_norm": 0.5}}))
    assert camel == snake and camel.trainer.groups_per_step == 3


@pytest.mark.parametrize(
    ("raw", "path", "hint"),
    [
        (minimal(trainer={"lr": 1e-6}), "trainer.lr", "did you mean trainer.optimizer.lr?"),
        (minimal(optimizer={"lr": 1e-6}), "optimizer", "did you mean trainer.optimizer?"),
        (minimal(trainer={"optimizr": {}}), "trainer.optimizr", "did you mean trainer.optimizer?"),
        (minimal(actor={"tree_trainin": {}}), "actor.tree_trainin", "did you mean actor.treeTraining?"),
        (minimal(trainer={"loss": {"kl": 1}}), "trainer.loss.kl", "valid keys: clipEps, clipEpsHigh"),
        (minimal(maxTokensPerMicrobatch=64), "maxTokensPerMicrobatch", "actor.treeTraining.maxTokensPerMicrobatch"),
    ],
)
def test_unknown_keys_say_where_they_belong(raw: dict[str, Any], path: str, hint: str) -> None:
    found = problems(raw)
    assert path in found and found[path].startswith("unknown key"), found
    assert hint in found[path]


def test_every_problem_at_once_even_across_broken_sections() -> None:
    # The actor's tree section is broken (a bad attention name), yet its backend is still
    # judged; the trainer section has a typo, yet its task is still checked.
    raw = minimal(
        actor={"backend": "fsdp:c2d4", "treeTraining": {"attention": "flash"}},
        trainer={"lr": 1, "task": "builtin:chess"},
    )
    assert set(problems(raw)) == {
        "actor.treeTraining.attention", "actor.backend", "trainer.lr", "trainer.task",
    }  # fmt: skip


def test_a_broken_key_is_not_judged_at_its_default() -> None:
    # algorithm is broken: the GRPO/critic rule must not fire against the default "grpo".
    found = problems(minimal(critic={}, trainer={"algorithm": "PPO"}))
    assert list(found) == ["trainer.algorithm"]


def test_yaml_reads_exponent_floats_as_numbers() -> None:
    # PyYAML (YAML 1.1) reads `1e-6` as a string; a config file must not depend on the dot.
    assert C.read_yaml("lr: 1e-6\nb: 2.5E+3\nc: '1e-6'\nd: 7\n", "t") == {"lr": 1e-6, "b": 2500.0, "c": "1e-6", "d": 7}


def test_sizes_no_run_needs_are_refused() -> None:
    # groupsPerStep: 1e12 was accepted
    found = problems(minimal(trainer={"groupsPerStep": 10**12, "groupSize": 10**6, "steps": 10**9}))
    assert set(found) == {"trainer.groupsPerStep", "trainer.groupSize", "trainer.steps"}
    assert "less than or equal to" in found["trainer.groupsPerStep"]


def test_strict_types_refuse_strings_for_numbers() -> None:
    assert "trainer.steps" in problems(minimal(trainer={"steps": "10"}))
    assert "actor.treeTraining.enabled" in problems(minimal(actor={"treeTraining": {"enabled": "yes"}}))


def test_overrides_are_checked_like_the_keys_they_replace() -> None:
    cfg = C.validate(minimal(), overrides={"trainer.steps": 7, "checkpoint.dir": "/c"})
    assert cfg.trainer.steps == 7 and cfg.checkpoint.dir == "/c"
    assert "trainer.steps" in problems(minimal(), overrides={"trainer.steps": 0})


def test_launch_facts_come_from_the_environment() -> None:
    _, launch = C.validate_with_launch(minimal(), env={"TREETRAIN_RESTART": "2", "KUBERNETES_SERVICE_HOST": "x"})
    assert launch == C.Launch(restart=2, in_pod=True)
    assert "TREETRAIN_RESTART" in problems(minimal(), env={"TREETRAIN_RESTART": "-1"})


def test_engine_support_is_one_table() -> None:
    """The parser, config validation (and so admission: ``rljob plan`` validates with it) and
    ``build_engine`` (tests/unit/test_engine_core.py) read one registry, each engine's
    description: every letter on every engine parses and runs exactly as its letters say, and
    the config's engines() is that, not a table of its own."""
    from treetrain.alloc.registry import names, spec_of

    letter_field = {"d": "dp", "t": "tp", "p": "pp", "c": "cp", "e": "ep"}
    assert C.check_training_backend("fsdp:d2t2").world_size == 4
    engines = C.engines()
    assert tuple(engines) == names("training")
    for backend in names("training"):
        row = spec_of(backend).letters
        assert engines[backend].built == row.built
        assert engines[backend].refused == {letter_field[k]: why for k, why in row.not_yet.items()}
        for letter in "dtpce":
            dims = f"d2{letter}2" if letter == "e" else f"{letter}2"
            assert _parses(f"{backend}:{dims}") == (letter in row.accepted), (backend, letter)
            assert _runs(f"{backend}:{dims}") == (row.built and letter in row.runs), (backend, letter)
            if letter in row.not_yet:
                with pytest.raises(ValueError, match=re.escape(row.not_yet[letter])):
                    C.check_training_backend(f"{backend}:{dims}")
    for backend, phrase in [
        ("fsdp:c2d4", "context parallelism is not supported by the FSDP engine"),
        ("fsdp:c2", "context parallelism"),
        ("vllm:d2", "inference backend"),
    ]:
        with pytest.raises(ValueError, match=phrase):
            C.check_training_backend(backend)


def _parses(backend: str) -> bool:
    from treetrain.alloc import AllocationError, parse

    try:
        parse(backend)
    except AllocationError:
        return False
    return True


def _runs(backend: str) -> bool:
    """Whether ``backend`` passes validation (training: the engine-support table too)."""
    from treetrain.alloc import AllocationError, parse

    try:
        if backend.startswith(("sglang", "vllm")):
            parse(backend)
        else:
            C.check_training_backend(backend)
    except (AllocationError, ValueError):
        return False
    return True


def test_the_readme_letter_table_is_what_validation_accepts() -> None:
    """Each engine column of the README's letter table says what the parser and the
    engine-support table accept (a letter alone at size 2, beside d2 for e: e adds no GPUs)."""
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `")]
    header = next(line for line in readme.splitlines() if line.startswith("| letter |"))
    columns = [c.strip() for c in header.strip("|").split("|")][2:]
    assert columns == ["sglang, vllm", "fsdp", "megatron, archon"]
    assert len(rows) == 5
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        letter = cells[0].strip("`")
        dims = f"d2{letter}2" if letter == "e" else f"{letter}2"
        for column, mark in zip(columns, cells[2:], strict=True):
            for engine in column.split(", "):
                assert _runs(f"{engine}:{dims}") == (mark == "✓"), f"README says {mark} for {letter} on {engine}"


def test_the_trainer_config_reference_in_the_docs_is_generated() -> None:
    doc = (ROOT / "docs" / "trainer.md").read_text()
    begin = doc.index("-->\n", doc.index("<!-- BEGIN generated")) + 4
    end = doc.index("<!-- END generated -->")
    assert doc[begin:end] == table(), "docs/trainer.md is stale: run python docs/generate.py"


# -- what the operator writes, the trainer reads unchanged ----------------------------------

EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
BLOCKS = (16, 64, 128)


@dataclass(frozen=True)
class BackendCase:
    """A training backend string and what ENGINE_LETTERS alone says of it (never the parser)."""

    text: str
    parses: bool
    runs: bool
    world_size: int
    alignment: int  # t * c: what a micro-batch cap must be a multiple of (with the block)


def _text(sizes: dict[str, int]) -> str:
    return "".join(f"{letter}{size}" for letter, size in sizes.items() if size > 1) or "d1"


@st.composite
def training_backends(draw: st.DrawFn, runnable_only: bool = False) -> BackendCase:
    """Every training engine with every letter (d, t, p, c, e), plain or hybrid
    ``(attn:...|ffn:...)``; ``runnable_only``: only what the table says the engine runs.
    Sizes keep the expert grid whole (e divides the GPUs), so only the letters decide."""
    from treetrain.alloc.registry import names, spec_of

    backend = draw(st.sampled_from(names("training")))
    row = spec_of(backend).letters
    pool = row.runs if runnable_only else "dtpce"
    hybrid = draw(st.booleans()) and (row.hybrid or not runnable_only)
    attn = {letter: draw(st.sampled_from((1, 2))) if letter in pool else 1 for letter in "dtpc"}
    world = math.prod(attn.values())
    e = 2 if "e" in pool and draw(st.booleans()) and (world // attn["p"]) % 2 == 0 else 1
    used = {letter for letter, size in {**attn, "e": e}.items() if size > 1}
    runs_letters = row.built and not used & set(row.not_yet)
    if hybrid:
        etp = 2 if draw(st.booleans()) and world % (attn["p"] * 2 * e) == 0 else 1
        ffn = {"d": world // (attn["p"] * etp * e), "p": attn["p"], "t": etp, "e": e}
        text = f"{backend}:(attn:{_text(attn)}|ffn:{_text(ffn)})"
        parses = row.hybrid
    else:
        text = f"{backend}:{_text({**attn, 'e': e})}"
        parses = used <= set(row.accepted)
    return BackendCase(text, parses, parses and runs_letters, world, attn["t"] * attn["c"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_backends())
def test_admission_validation_and_the_parser_do_what_the_table_says(case: BackendCase) -> None:
    assert _parses(case.text) == case.parses, case
    assert _runs(case.text) == case.runs, case
    manifest = copy.deepcopy(EXAMPLE)
    manifest["spec"]["actor"] = {"backend": case.text}
    try:
        plan(manifest)
    except PlanError:
        admitted = False
    else:
        admitted = True
    assert admitted == case.runs, case


@st.composite
def rljobs(draw: st.DrawFn) -> dict[str, Any]:
    """Valid RLJob manifests over the fields that reach the trainer config."""
    actor = draw(training_backends(runnable_only=True))
    block = draw(st.sampled_from(BLOCKS))
    align = math.lcm(block, actor.alignment)
    tree = {
        "enabled": draw(st.booleans()),
        "maxTokensPerMicrobatch": align * draw(st.integers(1, 64)),
        "attention": draw(st.sampled_from(("auto", "sparse", "dense", "flex", "triton"))),
        "blockSize": block,
        "padToMaximum": draw(st.booleans()),
    }
    algorithm = draw(st.sampled_from(("grpo", "ppo")))
    trainer: dict[str, Any] = {"algorithm": algorithm}
    if draw(st.booleans()):
        trainer["steps"] = draw(st.integers(1, 10_000))
    if draw(st.booleans()):
        trainer["optimizer"] = {"lr": draw(st.floats(1e-8, 1e-2)), "betas": [0.9, draw(st.floats(0.9, 0.999))]}
    if draw(st.booleans()):
        trainer["loss"] = {"clipEps": draw(st.floats(0.05, 0.3)), "klCoef": 0.0, "dualClip": 3.0}
    if draw(st.booleans()):
        trainer["task"] = "my_pkg.tasks:make"
        trainer["taskArgs"] = {"split": draw(st.text(max_size=8)), "n": draw(st.integers(-5, 5))}
    if draw(st.booleans()):
        trainer["rollout"] = {"temperature": draw(st.floats(0.1, 2.0)), "topP": draw(st.floats(0.1, 1.0))}
    spec: dict[str, Any] = copy.deepcopy(EXAMPLE["spec"])
    spec["actor"] = {"backend": actor.text, "treeTraining": tree}
    spec["trainerConfig"] = trainer
    spec["rollout"] = {"backend": draw(st.sampled_from(("sglang:d2t4", "vllm:d1t8", "sglang:d4t2")))}
    if draw(st.booleans()):
        spec["additionalRollouts"] = [{"name": "small", "backend": "vllm:d2t2", "port": 8000}]
    if algorithm == "ppo":
        spec["critic"] = {"backend": draw(st.sampled_from(("", f"fsdp:d{actor.world_size}")))}
    if draw(st.booleans()):
        spec["ref"] = {}
    spec["checkpoint"] = {"intervalSteps": draw(st.integers(1, 1000))}
    spec["model"] = {"path": draw(st.sampled_from(("Qwen/Qwen3-8B", "builtin:tiny-llama", "org/m")))}
    return {**EXAMPLE, "metadata": {"name": "job", "namespace": "ml"}, "spec": spec}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rljobs())
def test_every_config_the_operator_writes_is_accepted_by_the_trainer_unchanged(manifest: dict[str, Any]) -> None:
    try:
        p = plan(manifest)
    except PlanError as err:  # pragma: no cover - the strategy makes valid RLJobs only
        raise AssertionError(f"a valid RLJob was refused: {err}") from None
    (config_map,) = [o for o in p.objects if o["kind"] == "ConfigMap"]
    text = config_map["data"]["config.yaml"]
    # What the trainer pod does: read the mounted file with the pod's environment (no overrides).
    read, _ = C.validate_with_launch(C.read_yaml(text, "config.yaml"), env={"TREETRAIN_RESTART": "0"})
    assert read == p.config
    assert C.dump_yaml(read) == text  # and writes it back byte for byte


# -- rljob plan and treetrain train refuse the same mistakes in the same words ---------------

MISTAKES = {
    "misplaced trainerConfig key": ({"trainerConfig": {"steps": 10, "lr": 1e-6}}, {"trainer": {"steps": 10, "lr": 1e-6}}),
    "micro-batch cap off the block": (
        {"actor": {"backend": "fsdp:d8", "treeTraining": {"maxTokensPerMicrobatch": 1000}}},
        {"actor": {"backend": "fsdp:d8", "treeTraining": {"maxTokensPerMicrobatch": 1000}}},
    ),
    "engine cannot run it": ({"actor": {"backend": "fsdp:d4c2"}}, {"actor": {"backend": "fsdp:d4c2"}}),
    "unknown attention backend": (
        {"actor": {"backend": "fsdp:d8", "treeTraining": {"attention": "flash"}}},
        {"actor": {"backend": "fsdp:d8", "treeTraining": {"attention": "flash"}}},
    ),
}  # fmt: skip


@pytest.mark.parametrize("mistake", MISTAKES)
def test_rljob_plan_and_treetrain_train_refuse_a_mistake_in_the_same_words(
    mistake: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rljob_operator.cli import main as rljob
    from rljob_operator.plan import rljob_path
    from treetrain.cli import main as treetrain

    for name in C.ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    spec, trainer_file = MISTAKES[mistake]
    manifest = copy.deepcopy(EXAMPLE)
    manifest["spec"].update(spec)
    (tmp_path / "rljob.yaml").write_text(yaml.safe_dump(manifest))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"path": "builtin:tiny-llama"}, **trainer_file}))

    assert rljob(["plan", str(tmp_path / "rljob.yaml")]) == 2
    planned = [line.strip()[2:] for line in capsys.readouterr().err.splitlines() if line.strip().startswith("- ")]
    assert treetrain(["train", str(tmp_path / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    trained = [line.strip()[2:] for line in err.splitlines() if line.strip().startswith("- ")]
    assert len(planned) == len(trained) == 1, (planned, trained)
    path, _, message = trained[0].partition(": ")
    # The same message; the path (and a suggested path) named as the RLJob field.
    assert planned[0] == f"{rljob_path(path)}: {message}".replace(
        "did you mean trainer.", "did you mean spec.trainerConfig."
    )


# -- datasets, rewards, agents ----------------------------------------------------------------

SMOL = {"path": "builtin:smollm2-135m"}
DATA = {"path": "examples/gsm8k/train.jsonl", "promptField": "question"}


def test_a_dataset_run_reads_its_keys() -> None:
    cfg = C.validate(
        {
            "model": SMOL,
            "trainer": {
                "dataset": {**DATA, "shuffle": False},
                "reward": "builtin:regex",
                "rewardArgs": {"pattern": r"#### (?P<answer>\d+)"},
                "maxNewTokens": 64,
                "eval": {"dataset": {"path": "examples/gsm8k/test.jsonl", "promptField": "question"}, "everySteps": 2},
                "proxy": {"port": 0, "maxSessions": 8},
            },
        }
    )
    t = cfg.trainer
    assert t.dataset is not None and t.dataset.prompt_field == "question" and t.dataset.split == "train"
    assert t.eval is not None and t.eval.every_steps == 2 and t.eval.samples == 32
    assert t.max_new_tokens == 64 and t.proxy.max_sessions == 8 and t.proxy.idle_timeout_seconds == 600.0
    agent = C.validate({"model": SMOL, "trainer": {"agent": "my_pkg.agents:run", "dataset": DATA}})
    assert agent.trainer.agent == "my_pkg.agents:run" and agent.trainer.reward is None


@pytest.mark.parametrize(
    ("trainer", "path", "phrase"),
    [
        ({"agent": "pkg.mod:run"}, "trainer.agent", "needs trainer.dataset"),
        ({"agent": "pkg.mod", "dataset": DATA}, "trainer.agent", "must be of the form package.module:function"),
        ({"dataset": DATA}, "trainer.reward", "a dataset run without an agent needs a reward"),
        ({"reward": "builtin:math"}, "trainer.reward", "needs trainer.dataset"),
        ({"dataset": DATA, "reward": "builtin:math", "task": "builtin:parity"}, "trainer.task", "remove task"),
        ({"dataset": DATA, "reward": "builtin:math", "taskArgs": {"turns": 2}}, "trainer.taskArgs", "remove it"),
        ({"dataset": DATA, "reward": "builtin:chess"}, "trainer.reward", "unknown built-in reward 'builtin:chess'"),
        ({"dataset": DATA, "reward": "not-an-import"}, "trainer.reward", "package.module:function"),
        ({"dataset": DATA, "reward": "builtin:regex"}, "trainer.rewardArgs.pattern", "needs rewardArgs.pattern"),
        (
            {"dataset": DATA, "reward": "builtin:regex", "rewardArgs": {"pattern": "(unclosed"}},
            "trainer.rewardArgs.pattern",
            "not a valid regular expression",
        ),
        (
            {"dataset": DATA, "reward": "builtin:math", "rewardArgs": {"tolerance": 1}},
            "trainer.rewardArgs.tolerance",
            "builtin:math takes no argument 'tolerance'",
        ),
        ({"rewardArgs": {"pattern": "x"}}, "trainer.rewardArgs", "set without trainer.reward"),
        ({"eval": {"dataset": DATA}}, "trainer.eval", "needs trainer.agent or trainer.reward"),
        (
            {"dataset": DATA, "reward": "builtin:math", "maxNewTokens": 4096, "maxEpisodeTokens": 1024},
            "trainer.maxNewTokens",
            "4096 is more than trainer.maxEpisodeTokens (1024)",
        ),
        ({"maxNewTokens": 600, "maxEpisodeTokens": 512}, "trainer.maxNewTokens", "lower maxNewTokens"),
        ({"dataset": {"path": ""}, "reward": "builtin:math"}, "trainer.dataset.path", "at least 1 character"),
        ({"dataset": {"promptField": "q"}, "reward": "builtin:math"}, "trainer.dataset.path", "required"),
        ({"proxy": {"port": 70000}}, "trainer.proxy.port", "less than or equal to 65535"),
    ],
)
def test_dataset_reward_and_agent_rules(trainer: dict[str, Any], path: str, phrase: str) -> None:
    found = problems({"model": SMOL, "trainer": trainer})
    assert path in found, found
    assert phrase in found[path]


def test_the_reply_length_rule_spares_task_runs() -> None:
    # A task has its own reply length: maxNewTokens (512 by default) is not judged against a small maxEpisodeTokens.
    assert C.validate(minimal(trainer={"maxEpisodeTokens": 24})).trainer.max_episode_tokens == 24


def test_a_dataset_needs_a_model_with_a_tokenizer() -> None:
    found = problems(minimal(trainer={"dataset": DATA, "reward": "builtin:exact"}))
    assert list(found) == ["trainer.dataset"] and "needs a model with a tokenizer" in found["trainer.dataset"]


def test_a_hub_id_passes_the_config_and_is_refused_at_load_time() -> None:
    # The config cannot see the pod's files: only an empty path is refused here.
    cfg = C.validate({"model": SMOL, "trainer": {"dataset": {"path": "openai/gsm8k"}, "reward": "builtin:math"}})
    assert cfg.trainer.dataset is not None and cfg.trainer.dataset.path == "openai/gsm8k"


def test_the_built_in_task_table_matches_the_task_constructors() -> None:
    """config.tasks (what validation reads, below rl) and rl.task.BUILTIN_TASKS (what the
    trainer builds) name the same tasks, with the same arguments, types and tokenizer need."""
    import inspect
    import typing

    from treetrain.config.tasks import BUILTIN_TASKS as CHECKED
    from treetrain.rl.task import BUILTIN_TASKS as BUILT

    assert list(CHECKED) == list(BUILT)
    for name, factory in BUILT.items():
        params = inspect.signature(factory).parameters
        hints = typing.get_type_hints(factory)
        tokenizer = params.get("tokenizer")
        assert CHECKED[name].needs_tokenizer == (tokenizer is not None and tokenizer.default is inspect.Parameter.empty)
        assert dict(CHECKED[name].args) == {p: hints[p] for p in params if p != "tokenizer"}, name
