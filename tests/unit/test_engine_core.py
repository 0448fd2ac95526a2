"""The engine core, the same on every engine (one process each): stats named ``*_max`` are
maxima over micro-batches, a resume reproduces the next step exactly (every RNG state
included), a torn newest checkpoint is unreadable (the trainer's fallback), a sharded
safetensors folder without an index loads, and the shared pieces (one ``pad_tree``, one
gradient norm, one safetensors reader) keep their contracts."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from tree_helpers import one_tree, tiny_model

from treetrain.config import ModelSettings, OptimizerSettings, TreeTrainingSettings
from treetrain.engines import EngineConfigError, build_engine
from treetrain.engines import checkpoint_files as files
from treetrain.engines.base import Engine
from treetrain.engines.batch import TokenFields, TrainBatch
from treetrain.engines.contract import MicroBatchOutput
from treetrain.engines.errors import CheckpointUnreadableError
from treetrain.engines.grads import global_norm, grad_norm
from treetrain.engines.source import SafetensorsFiles
from treetrain.tree import pad_tree

BACKENDS = ["fsdp:d1", "archon:d1", "megatron:d1"]
# Several sequences sharing prefixes, split over at least two micro-batches.
SEQS = [
    [1, 9, 12, 30, 31, 32, 33, 34],
    [1, 9, 12, 40, 41, 42],
    [1, 9, 50, 51, 52, 53, 54],
    [2, 7, 7, 8, 60, 61],
    [2, 7, 7, 8, 70, 71, 72, 73, 74],
    [3, 5, 80, 81, 82],
]
TREE = TreeTrainingSettings(max_tokens_per_mb=16, block_size=8)
OPTIM = OptimizerSettings(lr=1e-2, max_grad_norm=0.5)


pytestmark = pytest.mark.usefixtures("megatron_one_process")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _engine(backend: str, path: str = "builtin:tiny-llama") -> Engine:
    return build_engine(ModelSettings(path=path, seed=3), backend, tree=TREE, optimizer=OPTIM)


def _batch(seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    n = [len(s) - 1 for s in SEQS]
    return TrainBatch(
        sequences=SEQS,
        loss_mask=[(torch.rand(k, generator=g) > 0.2).float() for k in n],
        fields=TokenFields(advantages=[1.0 + torch.rand(k, generator=g) for k in n]),  # the probe
    )


class ProbeLoss:
    """The mean log-prob, plus a probe's sum and maximum over the masked tokens."""

    needs_entropy = False

    def __call__(
        self, out: MicroBatchOutput, loss_mask: torch.Tensor, inputs: TokenFields[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert out.logprobs is not None
        probe = inputs.need("advantages") * loss_mask  # > 0 where trained, 0 elsewhere
        return -(out.logprobs * loss_mask).sum(), {"probe": probe.sum(), "probe_max": probe.max()}


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_stats_are_maxima_and_every_rng_state_is_restored(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(backend)
    batch = _batch(0)
    stats = engine.forward_backward(batch, ProbeLoss())
    assert stats.micro_batches >= 2
    masked = [p * m for p, m in zip(batch.fields.need("advantages"), batch.loss_mask, strict=True)]
    want_max = max(float(p.max()) for p in masked)
    want_mean = sum(float(p.sum()) for p in masked) / batch.num_loss_tokens()
    assert stats.stats["probe_max"] == pytest.approx(want_max, rel=1e-6)
    assert stats.stats["probe"] == pytest.approx(want_mean, rel=1e-6)
    engine.zero_grad()

    # CUDA generators (faked here) are saved and restored like the CPU ones, on every engine.
    cuda = [torch.randint(0, 255, (16,), dtype=torch.uint8)]
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(files, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    monkeypatch.setattr(files, "_megatron_tracker", lambda: None)
    engine.save(tmp_path / "ck", {"k": 1})
    want = (torch.rand(3), random.random())
    assert engine.load(tmp_path / "ck") == {"k": 1}
    assert (torch.rand(3), random.random()) == (pytest.approx(want[0]), want[1])
    assert len(restored) == 1 and torch.equal(restored[0][0], cuda[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_is_exact_and_a_torn_newest_checkpoint_is_unreadable(backend: str, tmp_path: Path) -> None:
    loss = ProbeLoss()
    a = _engine(backend)
    a.forward_backward(_batch(0), loss)
    a.step()
    a.save(tmp_path / "one", {"step": 1})
    want_rand = torch.rand(4)
    stats = a.forward_backward(_batch(1), loss)
    norm = a.step()
    a.save(tmp_path / "two", {"step": 2})
    want = _state(a)

    # The recipe of the issue: the newest checkpoint's largest file cut in half.
    largest = max((f for f in (tmp_path / "two").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    b = _engine(backend)
    with pytest.raises(CheckpointUnreadableError, match="cannot be read"):
        b.load(tmp_path / "two")
    assert b.load(tmp_path / "one") == {"step": 1} and b.steps == 1
    assert torch.equal(torch.rand(4), want_rand)
    again = b.forward_backward(_batch(1), loss)
    assert (again.loss, again.stats) == (stats.loss, stats.stats)
    assert b.step() == norm
    got = _state(b)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("backend", ["archon:d1", "megatron:d1"])  # FSDP: transformers' own loader
def test_a_sharded_folder_without_an_index_loads(backend: str, tmp_path: Path) -> None:
    model = tiny_model("llama", seed=4)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    (tmp_path / "model.safetensors.index.json").unlink()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = _engine(backend, str(tmp_path))
    got = engine.forward(SEQS)
    with torch.no_grad():
        for seq, logp in zip(SEQS, got, strict=True):
            ids = torch.tensor(seq)
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
            want = torch.log_softmax(logits, -1).gather(1, ids[1:, None])[:, 0]
            torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)


def test_the_safetensors_reader_names_a_folder_without_weights(tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError, match=str(tmp_path)):
        SafetensorsFiles(tmp_path)


def test_pad_tree_pads_keeps_or_refuses() -> None:
    tree = one_tree([[1, 2, 3, 4], [1, 2, 5], [6, 7]], block=4)
    assert pad_tree(tree, tree.padded_len) is tree
    with pytest.raises(ValueError, match="never cut"):
        pad_tree(tree, tree.padded_len - 1)
    padded = pad_tree(tree, tree.padded_len + 5)
    n = tree.padded_len
    assert padded.padded_len == n + 5 and padded.num_tokens == tree.num_tokens
    assert padded.input_ids[:n] == tree.input_ids and padded.token_end[:n] == tree.token_end
    assert padded.token_end[n:] == list(range(n + 1, n + 6))  # each padding token sees itself only
    assert padded.token_node[n:] == [-1] * 5 and padded.position_ids[n:] == [0] * 5


def test_one_gradient_norm_counts_every_distinct_tensor_once() -> None:
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(k, generator=g) for k in (5, 7, 3))
    # One process: a piece held by two ranks counts half its square (the other half is theirs).
    got = global_norm([(a, 1), (b, 2), (c, 1), (torch.zeros(0), 4)])
    want = (a.square().sum() + b.square().sum() / 2 + c.square().sum()).sqrt()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got.dtype == torch.float32 and global_norm([]).item() == 0.0
    with pytest.raises(ValueError, match="at least one rank"):
        global_norm([(a, 0)])
    params = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))]
    params[0].grad, params[1].grad = a.clone(), None
    torch.testing.assert_close(grad_norm(params), a.norm(), rtol=1e-6, atol=0)


def test_megatron_cuda_tracker_states_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tracker:
        def __init__(self) -> None:
            self.states = {"model-parallel-rng": torch.randint(0, 255, (8,), dtype=torch.uint8)}
            self.set: list[Any] = []

        def get_states(self) -> dict[str, torch.Tensor]:
            return dict(self.states)

        def set_states(self, states: dict[str, torch.Tensor]) -> None:
            self.set.append(states)

    tracker = Tracker()
    monkeypatch.setattr(files, "_megatron_tracker", lambda: tracker)
    meta = {"steps": 0, "extra": {}, "rng": files.rng_state()}
    files.check_meta(meta, Path("rank0.pt"))
    files.restore_rng(meta)
    assert torch.equal(tracker.set[0]["model-parallel-rng"], tracker.states["model-parallel-rng"])
    meta["rng"]["cuda_tracker"] = {"model-parallel-rng": [1, 2]}
    with pytest.raises(EngineConfigError, match="cuda_tracker"):
        files.check_meta(meta, Path("rank0.pt"))


def _max_stats_on_two_ranks() -> None:
    """Every rank reports the batch's figures: data ranks reduced (``d2``), the last stage's
    figures sent to the first (``p2``)."""
    from treetrain.engines.megatron.parallel import reset_megatron

    batch = _batch(0)
    masked = [p * m for p, m in zip(batch.fields.need("advantages"), batch.loss_mask, strict=True)]
    want_max = max(float(p.max()) for p in masked)
    want_mean = sum(float(p.sum()) for p in masked) / batch.num_loss_tokens()
    for backend in ("megatron:d2", "megatron:p2", "archon:p2", "fsdp:d2"):
        reset_megatron()
        stats = _engine(backend).forward_backward(batch, ProbeLoss())
        assert stats.stats["probe_max"] == pytest.approx(want_max, rel=1e-6), backend
        assert stats.stats["probe"] == pytest.approx(want_mean, rel=1e-6), backend


@pytest.mark.slow
def test_max_stats_are_the_batch_maxima_on_every_rank() -> None:
    from helpers import spawn_ranks

    spawn_ranks(_max_stats_on_two_ranks, 2)


@pytest.mark.parametrize("engine", ["fsdp", "megatron", "archon"])
def test_build_engine_refuses_what_the_engine_table_says(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """build_engine reads the engine's description in the registry, which config validation and
    admission read, for a string and for the Allocation the trainer passes: a letter the
    engine does not run is refused with its reason; one it runs gets as far as joining (one
    process, so the world size of 2 is what stops it)."""
    from treetrain.alloc import AllocationError, parse, spec_of

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    row = spec_of(engine).letters
    for letter in "tpce":
        spec = f"{engine}:d2{letter}2" if letter == "e" else f"{engine}:{letter}2"
        if letter not in row.accepted:
            with pytest.raises(AllocationError):
                build_engine("builtin:tiny-llama", spec)
            continue
        for backend in (spec, parse(spec)):
            with pytest.raises(ValueError) as err:
                build_engine("builtin:tiny-llama", backend)
            if letter in row.runs:
                assert "processes" in str(err.value), (spec, str(err.value))
            else:
                assert row.not_yet[letter] in str(err.value), (spec, str(err.value))
