"""Every request body our SGLang client sends, checked against SGLang's own request classes.

SGLang has no CPU path, so no real SGLang server runs in these tests: the client is tested
against stand-ins (tests/unit/test_rl_rollout.py, tests/unit/weight_standin.py). What keeps those
stand-ins honest is this file: the pinned SGLang (0.5.23, installed ``--no-deps`` into the vLLM
venv by tests/vllm/build; it does not import without its GPU dependencies) is read as source,
and every key we send must be a field of the request class its route parses (``io_struct.py``),
or of ``SamplingParams`` for ``/generate``'s ``sampling_params``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from real_vllm import BUILD_HINT, venv_python

from treetrain.rl.rollout import BucketRequest, GroupRequest, SamplingParams, SGLangRollout

# Route -> the request class its handler takes (sglang/srt/entrypoints/http_server.py).
ROUTES = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}


def _sglang_source() -> Path:
    py = venv_python()
    if py is None:
        pytest.fail(f"the vLLM venv (which holds SGLang's source) is not built: {BUILD_HINT}", pytrace=False)
    (site,) = py.parent.parent.glob("lib/python3*/site-packages")
    return site / "sglang" / "srt"


def _fields(path: Path) -> dict[str, set[str]]:
    """Class name -> its annotated fields, its bases' (in the same file) included."""
    tree = ast.parse(path.read_text())
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {
                s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def all_of(name: str) -> set[str]:
        return own.get(name, set()).union(*(all_of(b) for b in bases.get(name, [])))

    return {name: all_of(name) for name in own}


def _sent() -> list[tuple[str, dict[str, Any]]]:
    """Every (route, body) the client sends for a generation, a disk sync and a distributed sync."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def transport(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        path = url.removeprefix("http://sglang")
        sent.append((path, body or {}))
        if path == "/generate":
            meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]]}
            return 200, {"meta_info": meta}
        return 200, {"success": True, "message": ""}

    client = SGLangRollout(endpoints=["http://sglang"], transport=transport)
    client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, stop_token_ids=(2,)), seed=3)
    client.update_weights("/checkpoints/weights/v00000001", 1)
    group = GroupRequest(address="10.0.0.1", port=29600, world_size=2, name="g", backend="nccl", timeout_s=60)
    client.join_group("http://sglang", group, 1)
    assert client.pause("http://sglang")
    bucket = BucketRequest(
        group=group, names=["w"], dtypes=["bfloat16"], shapes=[[2, 2]], version=2, first=True, last=True
    )
    client.receive_bucket("http://sglang", bucket)
    client.resume("http://sglang")
    client.leave_group("http://sglang", group)
    return sent


def test_every_sglang_request_key_is_a_field_of_sglangs_request_class() -> None:
    src = _sglang_source()
    classes = _fields(src / "managers" / "io_struct.py")
    sampling = _fields(src / "sampling" / "sampling_params.py")["SamplingParams"]
    sent = _sent()
    assert {path for path, _ in sent} == set(ROUTES), "a route the client calls has no request class listed here"
    for path, body in sent:
        fields = classes[ROUTES[path]]
        unknown = set(body) - fields
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of SGLang's {ROUTES[path]}"
        if path == "/generate":
            unknown = set(body["sampling_params"]) - sampling
            assert not unknown, f"/generate sampling_params: {sorted(unknown)} are not fields of SamplingParams"
    # The fields SGLang requires (no default) are all sent.
    for path, body in sent:
        assert _required(src / "managers" / "io_struct.py", ROUTES[path]) <= set(body), path


def _required(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {
        s.target.id
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is None
    }
