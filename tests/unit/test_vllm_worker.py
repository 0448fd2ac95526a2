"""The pure parts of our vLLM worker extension: tied names and the safetensors directory reader.

The loading itself runs against the real vLLM server (tests/vllm/test_real_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from treetrain.rl.vllm_worker import TiedWeights, safetensors_weights, tied_names, with_tied

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.lm_head = torch.nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def test_tied_names_groups_the_names_of_one_tensor() -> None:
    assert tied_names(Tied()) == [(EMBED, HEAD)]
    assert tied_names(torch.nn.Linear(2, 2)) == []


def test_a_tied_name_missing_from_the_weights_follows_its_twin() -> None:
    e, n = torch.randn(5, 3), torch.randn(3)
    out = list(with_tied([(EMBED, e), ("norm.weight", n)], TiedWeights([(EMBED, HEAD)]), last=True))
    assert [name for name, _ in out] == [EMBED, "norm.weight", HEAD]
    assert out[-1][1] is e
    both = [(EMBED, e), (HEAD, e.clone())]  # both named (the trainer's own state dict): nothing added
    assert [name for name, _ in with_tied(both, TiedWeights([(EMBED, HEAD)]), last=True)] == [EMBED, HEAD]


def test_tied_names_are_completed_after_the_last_bucket_only() -> None:
    """The embedding in the first bucket, the twin in none: it comes with the last bucket; a
    twin sent in a later bucket is not sent twice."""
    e = torch.randn(5, 3)
    tied = TiedWeights([(EMBED, HEAD)])
    assert [n for n, _ in with_tied([(EMBED, e)], tied, last=False)] == [EMBED]
    assert [n for n, _ in with_tied([("norm.weight", torch.ones(3))], tied, last=True)] == ["norm.weight", HEAD]
    tied = TiedWeights([(EMBED, HEAD)])
    assert [n for n, _ in with_tied([(EMBED, e)], tied, last=False)] == [EMBED]
    assert [n for n, _ in with_tied([(HEAD, e)], tied, last=True)] == [HEAD]


def test_safetensors_weights_reads_the_shards_the_index_lists(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert {n: t.tolist() for n, t in safetensors_weights(tmp_path)} == {"a": [1.0, 1.0]}
    save_file({"b": torch.zeros(1)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(1)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [n for n, _ in safetensors_weights(tmp_path)] == ["b", "c"]  # the stray model.safetensors ignored
