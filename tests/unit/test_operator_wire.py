"""Objects nested too deeply for Python's readers (issue 21 item 1): the operator's JSON reader
never raises on them and never returns more than its bound; `rljob plan` refuses them in one
line; and the refusal backoff holds against the RLJob's own events (item 2)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rljob_operator import wire
from rljob_operator.plan import PlanError, plan
from rljob_operator.spec_reader import MAX_DEPTH
from rljob_operator.workqueue import WorkQueue

ROOT = Path(__file__).resolve().parents[2]


def nested(levels: int, inner: str = "1") -> str:
    return '{"a": [' * levels + inner + "]}" * levels


@pytest.mark.parametrize(
    "text",
    [
        '{"a": [1, 2.5, -3e2, 1E+2, "x\\"y\\u00fc", true, false, null, {}, []], "b": {"c": "\u00fc"}}',
        "[]",
        '"s"',
        "-0",
        ' { "k" : [ ] , "l": {"m": [[1], [2, {"n": null}]]} } ',
        nested(40, '"]}{["'),
    ],
)
def test_the_capped_reader_reads_what_json_reads(text: str) -> None:
    assert wire.capped(text, wire.MAX_WIRE_DEPTH) == json.loads(text)
    assert wire.loads(text) == json.loads(text)
    assert wire.loads(text.encode()) == json.loads(text)


@pytest.mark.parametrize("levels", [60, 101, 300, 1200, 20000])
def test_deep_input_comes_back_cut_at_the_bound(levels: int) -> None:
    text = '{"metadata": {"name": "x"}, "spec": ' + nested(levels, '"]}"') + ', "after": 2}'
    value = wire.loads(text)  # json.loads raises RecursionError past about 990 levels
    assert value["metadata"] == {"name": "x"} and value["after"] == 2
    assert wire.depth(value) == min(2 * levels + 1, wire.MAX_WIRE_DEPTH)
    cut = json.dumps(value)  # everything downstream can handle it
    assert (wire.TOO_DEEP in cut) == (2 * levels + 1 > wire.MAX_WIRE_DEPTH)


@pytest.mark.parametrize("text", ["", "{", '{"a": }', '{"a": 1,}', "[1 2]", "nul", '{"a": 1} x', "[" * 2000])
def test_the_capped_reader_refuses_broken_json(text: str) -> None:
    with pytest.raises(ValueError):
        wire.capped(text, 100)


def test_kopf_and_aiohttp_still_have_the_places_that_are_pointed_at_the_reader() -> None:
    # A kopf or aiohttp upgrade that moves them must fail here, not in a cluster.
    import aiohttp
    from kopf._cogs.clients import api

    assert api.json is json or api.json is wire._KopfJson
    assert "json.loads(line" in Path(api.__file__).read_text()
    defaults = aiohttp.ClientResponse.json.__kwdefaults__
    assert defaults is not None and "loads" in defaults
    saved = (api.json, defaults["loads"])
    try:
        wire.tolerate_deep_objects_in_kopf()
        assert api.json.loads is wire.loads and defaults["loads"] is wire.loads  # type: ignore[attr-defined]
    finally:
        api.json, defaults["loads"] = saved  # type: ignore[attr-defined]


def test_plan_refuses_a_manifest_nested_too_deeply_with_its_path() -> None:
    manifest = json.loads(
        '{"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "deep"}, "spec": '
        '{"model": {"path": "m"}, "rollout": {"backend": "sglang:d1"}, "actor": {"backend": "fsdp:d1"}, '
        '"trainerConfig": {"taskArgs": {"turns": ' + '{"a": ' * 300 + "1" + "}" * 300 + "}}}}"
    )
    with pytest.raises(PlanError) as err:
        plan(manifest)
    (problem,) = err.value.errors
    assert problem.path == "spec.trainerConfig.taskArgs.turns.…"
    assert f"nested more than {MAX_DEPTH} levels deep" in problem.message


@pytest.mark.parametrize("levels", [300, 1200])
def test_rljob_plan_on_a_deep_manifest_is_a_message_and_exit_2(levels: int, tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text(
        '{"apiVersion": "treetrain.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "deep"}, "spec": '
        '{"model": {"path": "m"}, "rollout": {"backend": "sglang:d1"}, "actor": {"backend": "fsdp:d1"}, '
        '"trainerConfig": {"taskArgs": {"turns": ' + '{"a": ' * levels + "1" + "}" * levels + "}}}}"
    )
    done = subprocess.run([sys.executable, "-m", "rljob_operator.cli", "plan", str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    problems = [line for line in done.stderr.splitlines() if "nested" in line]
    assert len(problems) == 1, done.stderr


def test_a_held_key_is_not_brought_forward_by_its_own_events() -> None:
    # A refused RLJob's own status write (and its children's events) used to queue the next
    # pass at once: the 5 s -> 5 min backoff never applied. A spec change still does at once.
    key = ("ns", "refused")
    passes: list[float] = []

    async def main() -> None:
        queue = WorkQueue()

        async def worker(k: tuple[str, str]) -> None:
            passes.append(time.monotonic())
            if len(passes) == 1:
                queue.add(k)  # an event that comes while the pass runs (its own status write)
                queue.hold(k, 60.0)

        runner = asyncio.create_task(queue.run(worker))
        queue.add(key)
        while not passes:
            await asyncio.sleep(0.01)
        for _ in range(5):  # more ordinary events: the hold stands
            queue.add(key)
            await asyncio.sleep(0.05)
        assert len(passes) == 1 and queue.held(key)
        queue.add(key, urgent=True)  # the spec changed
        deadline = time.monotonic() + 60
        while len(passes) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        runner.cancel()

    asyncio.run(main())
    assert len(passes) == 2
