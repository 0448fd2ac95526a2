"""A rollout server's answer is checked where it is parsed: token ids inside the trained model's
vocabulary, a finite log-prob <= 0 for every token, as many log-probs as tokens. A bad answer is
a malformed one (RolloutError naming the server and the first problem): synchronous training
stops with one line (exit 1: the servers, not the config), never a traceback, never training on
NaN log-probs or a silently shortened sample. The servers here are the stand-ins of
helpers/rollout.py (small fakes of SGLang's and vLLM's documented answers), told to answer wrongly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.rollout import PARAMS, FakeServer
from suite_helpers import small

from treetrain.cli import main
from treetrain.rl.rollout import RolloutError, SGLangRollout, VLLMRollout

VOCAB = 512  # builtin:tiny-llama's

Rewrite = Callable[[list[int], list[float]], tuple[list[int], list[float]]]
BAD: dict[str, tuple[Rewrite, str]] = {
    "id past the vocabulary": (lambda t, lp: ([*t[:-1], 99_999], lp), "has id 99999, outside the model's vocabulary"),
    "negative id": (lambda t, lp: ([-1, *t[1:]], lp), "has id -1"),
    "NaN log-prob": (lambda t, lp: (t, [float("nan"), *lp[1:]]), "log-prob nan, not a finite number"),
    "infinite log-prob": (lambda t, lp: (t, [*lp[:-1], float("-inf")]), "log-prob -inf, not a finite number"),
    "positive log-prob": (lambda t, lp: (t, [2.0, *lp[1:]]), "log-prob 2.0, not a finite number <= 0"),
    "one log-prob for three tokens": (lambda t, lp: (t, lp[:1]), "3"),
}


@pytest.fixture(params=["sglang", "vllm"])
def server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    s = FakeServer(request.param)
    yield s
    s.close()


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_answer_is_refused_with_its_problem(server: FakeServer, case: str) -> None:
    rewrite, said = BAD[case]
    server.rewrite = rewrite
    kind = SGLangRollout if server.kind == "sglang" else VLLMRollout
    client = kind(endpoints=[server.url], retries=0)
    client.vocab_size = VOCAB
    with pytest.raises(RolloutError, match=r"bad answer|unexpected") as err:
        client.generate([[1, 2, 3]], PARAMS, seed=0)
    assert server.url in str(err.value) and said in str(err.value), str(err.value)


def test_a_good_answer_passes(server: FakeServer) -> None:
    kind = SGLangRollout if server.kind == "sglang" else VLLMRollout
    client = kind(endpoints=[server.url], retries=0)
    client.vocab_size = VOCAB
    (gen,) = client.generate([[1, 2, 3]], PARAMS, seed=0)
    assert len(gen.tokens) == len(gen.logprobs) == 3


def test_synchronous_training_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    server = FakeServer("sglang")
    server.rewrite = BAD["NaN log-prob"][0]
    try:
        raw: dict[str, Any] = small(tmp_path / "ckpt", steps=2)
        raw["trainer"]["rollout"] = {"maxStaleness": 0, "retries": 0}
        raw["rollout"] = {"servers": [{"url": server.url, "kind": "sglang"}], "weightSync": {"method": "disk"}}
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(raw))
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        code = main(["train", str(path)])
    finally:
        server.close()
    out, err = capsys.readouterr()
    assert code == 1  # the servers, not the config: a restarted pod tries again
    (line,) = [li for li in err.splitlines() if li.strip()]
    assert line.startswith("treetrain train: rollout failed: bad answer from " + server.url) and "nan" in line
    assert "step 1/2 | reward" not in out  # nothing trained on NaN log-probs
