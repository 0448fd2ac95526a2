"""The memory estimator (treetrain.alloc.memory) and ``treetrain memory``: hand-counted
parameters of a tiny config under each engine's sharding, roles, MoE, ZeRO-1, the layer
split, the precision rule and ``auto``, what fits instead, and the CLI's JSON, exit codes,
suggestions and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from treetrain.alloc import memory as mem
from treetrain.alloc import parse
from treetrain.alloc.memory import MemoryInputError, ModelShape, estimate, split_min_max
from treetrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
# h 8, I 16, 2 layers, 2 heads of 4 (2 kv heads), vocab 32: every count below is by hand.
TINY: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}
EMB = 32 * 8
LAYER = 8 + 4 * 8 * 8 + 8 + 3 * 16 * 8  # norms, q k v o, w1 w3 w2 = 656
TOTAL = EMB + 2 * LAYER + 8 + EMB  # 1832
TENSORS = 1 + 2 * 9 + 1 + 1


def moe_tiny() -> dict[str, Any]:
    return {
        **TINY,
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def static(backend: str, config: dict[str, Any] | None = None, **kw: Any) -> mem.RankMemory:
    return estimate(config or TINY, parse(backend), tokens=64, **kw).largest


def test_tiny_counts_single_rank() -> None:
    r = static("fsdp:d1", dtype="float32")
    assert r.param_count == TOTAL == mem.total_params(ModelShape.from_config(TINY))
    assert (r.parameters, r.gradients) == (4 * TOTAL, 4 * TOTAL)
    assert r.optimizer == 2 * 4 * TOTAL + 4 * TENSORS  # exp_avg, exp_avg_sq and a step per tensor
    bf16 = static("fsdp:d1", dtype="bfloat16")
    # fp32 master weights on one rank too: FSDP2 casts them to bf16 over a one-rank mesh.
    assert (bf16.param_dtype, bf16.parameters, bf16.optimizer) == ("float32", 4 * TOTAL, r.optimizer)


def test_tied_embeddings_count_once_and_split_over_stages() -> None:
    tied = {**TINY, "tie_word_embeddings": True}
    assert static("fsdp:d1", tied, dtype="float32").param_count == TOTAL - EMB
    # Two stages: the first keeps the embedding, the last its own copy as the head.
    plan = estimate(tied, parse("megatron:p2"), tokens=64, dtype="float32")
    assert [r.param_count for r in plan.ranks] == [EMB + LAYER, LAYER + 8 + EMB]


def test_sharding_rules_of_each_engine() -> None:
    # FSDP d2: fp32 master weights, every tensor's dim 0 halved.
    d2 = static("fsdp:d2", dtype="bfloat16")
    assert (d2.param_dtype, d2.param_count) == ("float32", TOTAL // 2)
    # FSDP t2: attention and FFN split, embedding and head replicated.
    assert static("fsdp:t2").param_count == EMB + 2 * (16 + (4 * 64 + 3 * 128) // 2) + 8 + EMB
    # Megatron and Archon t2 split the vocabulary too.
    vocab_split = EMB // 2 + 2 * (16 + (4 * 64 + 3 * 128) // 2) + 8 + EMB // 2
    assert static("megatron:t2").param_count == vocab_split == static("archon:t2").param_count
    # Megatron replicates over data ranks (fp32 parameters, full AdamW today); Archon d2 shards.
    assert static("megatron:d2").param_count == TOTAL
    assert static("archon:d2").param_count == TOTAL // 2
    assert static("archon:c2").param_count == TOTAL // 2  # context ranks shard like data ranks
    assert static("megatron:c2").param_count == TOTAL


def test_roles() -> None:
    ref = static("fsdp:d1", role="ref", dtype="float32")
    assert (ref.parameters, ref.gradients, ref.optimizer) == (4 * TOTAL, 0, 0)
    critic = static("fsdp:d1", role="critic", dtype="float32")
    assert critic.param_count == TOTAL - EMB + 8 + 1  # value head weight [1, h] and bias
    assert ref.activations < static("fsdp:d1", dtype="float32").activations  # nothing kept for a backward


def test_moe_expert_sharding() -> None:
    moe = moe_tiny()
    attn = 8 + 4 * 64 + 8 + 4 + 4  # norms, q k v o, q/k norms
    experts = 3 * 4 * 4 * 8
    whole = EMB + 2 * (attn + 4 * 8 + experts) + 8 + EMB
    assert static("megatron:d1", moe).param_count == whole
    # e2 over two ranks: each holds half the experts (megatron: dense weights replicated).
    assert static("megatron:d2e2", moe).param_count == whole - 2 * experts // 2
    # archon e2: experts split by e, the rest sharded by FSDP over the data ranks.
    assert static("archon:d2e2", moe).param_count == (EMB + 2 * (attn + 32) + 8 + EMB) // 2 + 2 * experts // 2
    with pytest.raises(MemoryInputError, match="e3 does not divide"):
        static("megatron:d3e3", moe)
    with pytest.raises(MemoryInputError, match="no tensor parallel"):
        static("archon:t2", moe)


def test_megatron_zero1_shards_the_optimizer() -> None:
    # fp32: fp32 weights and gradients; moments fp32 on 1/(d*c) of the elements, one step.
    d2 = static("megatron:d2", dtype="float32")
    assert (d2.param_dtype, d2.parameters, d2.gradients) == ("float32", 4 * TOTAL, 4 * TOTAL)
    assert d2.optimizer == 8 * (TOTAL // 2) + 4
    assert d2.optimizer <= 0.55 * static("megatron:d1", dtype="float32").optimizer
    assert static("megatron:c2", dtype="float32").optimizer == 8 * (TOTAL // 2) + 4  # context ranks shard too
    t2 = static("megatron:t2", dtype="float32")
    assert t2.optimizer == 8 * t2.param_count + 4 * TENSORS  # one data rank: plain AdamW
    # bf16: bf16 weights and gradients, fp32 master weights beside the moments (also on one rank).
    bf16 = static("megatron:d2", dtype="bfloat16")
    assert (bf16.param_dtype, bf16.parameters, bf16.gradients) == ("bfloat16", 2 * TOTAL, 2 * TOTAL)
    assert bf16.optimizer == 12 * (TOTAL // 2) + 4
    assert static("megatron:d1", dtype="bfloat16").optimizer == 12 * TOTAL + 4
    assert static("megatron:d1", dtype="float16").param_dtype == "float32"  # autocast over fp32
    # Hybrid MoE: dense over d2, experts whole on their one expert-data rank: two buckets.
    moe = static("megatron:(attn:d2|ffn:e2)", moe_tiny(), dtype="float32")
    experts = 2 * 3 * 2 * 4 * 8
    assert moe.optimizer == 8 * ((moe.param_count - experts) // 2 + experts) + 8


def test_layer_split_min_max() -> None:
    assert split_min_max([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_min_max([1, 1, 1, 1], 2, last=10) == [range(0, 3), range(3, 4)]
    assert split_min_max([1, 1, 1], 2) == [range(0, 2), range(2, 3)]  # ties: earlier stages take more
    with pytest.raises(MemoryInputError):
        split_min_max([1.0], 2)


def test_activations_shrink_with_sharding_and_recompute() -> None:
    qwen = json.loads((ROOT / "examples/model-configs/qwen3-8b.json").read_text())
    full = estimate(qwen, parse("megatron:d8"), tokens=16384).largest.activations
    assert estimate(qwen, parse("megatron:d2t4"), tokens=16384).largest.activations < full / 3
    assert estimate(qwen, parse("megatron:d8"), tokens=16384, recompute=True).largest.activations < full / 3
    assert estimate(qwen, parse("megatron:d8"), tokens=8192).largest.activations < full


def test_fitting_layout_fits_and_keeps_the_engine() -> None:
    qwen = json.loads((ROOT / "examples/model-configs/qwen3-8b.json").read_text())
    limit = 80 * mem.GIB
    assert estimate(qwen, parse("megatron:d8"), tokens=16384).largest.total > limit
    found = mem.fitting_layout(qwen, parse("megatron:d8"), limit, tokens=16384)
    assert found is not None
    alloc, plan = found
    assert alloc.backend == "megatron" and alloc.world_size == 8 and plan.largest.total <= limit


def test_config_errors_name_the_field() -> None:
    with pytest.raises(MemoryInputError, match="hidden_size"):
        ModelShape.from_config({k: v for k, v in TINY.items() if k != "hidden_size"})
    with pytest.raises(MemoryInputError, match="num_experts"):
        ModelShape.from_config({**TINY, "model_type": "qwen3_moe"})
    with pytest.raises(MemoryInputError, match="vocab_size"):
        ModelShape.from_config({**TINY, "vocab_size": "big"})
    with pytest.raises(MemoryInputError, match="rollout server"):
        estimate(TINY, parse("vllm:t2"), tokens=64)


def test_cli_json_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    assert main(["memory", "--model", str(tmp_path), "--backend", "fsdp:d1", "--max-tokens", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    per = out["per_rank"]
    assert set(per) == {"parameters", "gradients", "optimizer", "activations", "total"}
    assert per["parameters"] == 4 * TOTAL and per["total"] == sum(v for k, v in per.items() if k != "total")
    assert (out["dtype"], out["param_dtype"]) == ("bfloat16", "float32")  # auto plans GPUs: bf16 over fp32
    assert main(["memory", "--model", str(cfg), "--backend", "megatron:p2", "--max-tokens", "64"]) == 0
    text = capsys.readouterr().out
    assert "stage 1" in text and "estimate" in text
    assert main(["memory", "--model", str(cfg), "--backend", "vllm:t2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_rank"]["gradients"] == 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--backend", "fsdp:d1", "--max-tokens", "64", "--model", "/nonexistent/x.json"], "no file"),
        (["--backend", "fsdp:q3", "--max-tokens", "64"], "fsdp:q3"),
        (["--backend", "fsdp:d1"], "--max-tokens"),
        (["--backend", "megatron:t3", "--max-tokens", "64"], "t3"),
    ],
)
def test_cli_errors_are_one_line_exit_2(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    full = args if "--model" in args else ["--model", str(cfg), *args]
    assert main(["memory", *full]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "fix" in err.lower()


def test_cli_bad_json_file(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "treetrain.cli",
            "memory",
            "--model",
            str(bad),
            "--backend",
            "fsdp:d1",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and "cannot read" in done.stderr and len(done.stderr.strip().splitlines()) == 1


# LoRA rank 2 on TINY, all-linear: per layer q/k/v/o A [2, 8] + B [8, 2] = 32 each; gate/up A [2, 8]
# + B [16, 2] = 48 each; down A [2, 16] + B [8, 2] = 48. Two tensors per target and layer.
LORA = mem.LoraShape(2)
ADAPTER = 2 * (4 * 32 + 3 * 48)  # 544
ADAPTER_TENSORS = 2 * 14


def test_lora_counts_a_frozen_base_and_an_fp32_adapter() -> None:
    r = static("fsdp:d1", dtype="float32", lora=LORA)
    assert (r.param_count, r.trainable) == (TOTAL + ADAPTER, ADAPTER)
    # The base has no gradient and no optimizer state; the adapter fp32 both, AdamW's two moments and a step.
    assert (r.parameters, r.gradients) == (4 * TOTAL + 4 * ADAPTER, 4 * ADAPTER)
    assert r.optimizer == 8 * ADAPTER + 4 * ADAPTER_TENSORS
    # bf16: the frozen base is stored in the compute dtype, the adapter stays fp32.
    bf16 = static("fsdp:d1", dtype="bfloat16", lora=LORA)
    assert (bf16.param_dtype, bf16.parameters, bf16.gradients) == ("bfloat16", 2 * TOTAL + 4 * ADAPTER, 4 * ADAPTER)
    assert static("fsdp:d1", dtype="float32").trainable == TOTAL  # full fine-tuning steps every weight
    # Only the targets named: q and v, A [2, 8] and B [8, 2] per layer.
    assert static("fsdp:d1", lora=mem.LoraShape(2, ("q_proj", "v_proj"))).trainable == 2 * 2 * 32


def test_lora_adapters_split_as_the_engines_split_them() -> None:
    # t2: column-parallel A whole, B by rows; row-parallel A by columns, B whole.
    # q/k/v 16 + 8, o 8 + 16, gate/up 16 + 16, down 16 + 16 per layer.
    assert static("fsdp:t2", lora=LORA).trainable == 2 * (4 * 24 + 3 * 32)
    assert static("archon:t2", lora=LORA).trainable == 2 * (4 * 24 + 3 * 32)
    assert static("fsdp:d2", lora=LORA).trainable == ADAPTER // 2  # FSDP shards dim 0 like the weights
    assert static("archon:c2", lora=LORA).trainable == ADAPTER // 2
    # Megatron replicates the adapter over data ranks; its ZeRO-1 shards the fp32 moments (no master copy).
    d2 = static("megatron:d2", dtype="bfloat16", lora=LORA)
    assert (d2.trainable, d2.parameters) == (ADAPTER, 2 * TOTAL + 4 * ADAPTER)
    assert d2.optimizer == 8 * (ADAPTER // 2) + 4
    assert static("megatron:d1", dtype="bfloat16", lora=LORA).optimizer == 8 * ADAPTER + 4 * ADAPTER_TENSORS


def test_lora_on_experts_one_adapter_per_expert() -> None:
    moe = moe_tiny()  # E 4, expert FFN 4: gate/up A [4, 2, 8] + B [4, 4, 2], down A [4, 2, 4] + B [4, 8, 2]
    experts = 2 * 3 * 96
    attention = 2 * 4 * 32
    assert static("megatron:d1", moe, lora=LORA).trainable == attention + experts
    assert static("megatron:d2e2", moe, lora=LORA).trainable == attention + experts // 2  # split by expert
    with pytest.raises(MemoryInputError, match="ffn t2"):
        static("megatron:(attn:d2|ffn:t2)", moe, lora=LORA)
    attention_only = mem.LoraShape(2, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert static("megatron:(attn:d2|ffn:t2)", moe, lora=attention_only).trainable == attention
    # The fsdp engine adapts no experts (transformers fuses them): refused as the engine refuses it.
    with pytest.raises(MemoryInputError, match="archon"):
        static("fsdp:d2", moe, lora=LORA)
    assert static("fsdp:d1", moe, lora=attention_only).trainable == attention


def test_lora_plans_the_actor_only_and_advice_keeps_it() -> None:
    with pytest.raises(MemoryInputError, match="not the ref"):
        static("fsdp:d1", role="ref", lora=LORA)
    qwen = json.loads((ROOT / "examples/model-configs/qwen3-8b.json").read_text())
    lora = mem.LoraShape(16)
    plan = estimate(qwen, parse("fsdp:d8"), tokens=32768, lora=lora)
    full = estimate(qwen, parse("fsdp:d8"), tokens=32768)
    assert plan.to_dict()["lora"] == {"rank": 16, "targets": list(mem.LoraShape(16).targets)}
    assert plan.largest.trainable * 8 == 43_646_976  # Qwen3-8B all-linear rank 16, as PEFT counts it
    assert plan.largest.static < full.largest.static / 5
    changes = mem.changes_that_fit(qwen, plan, 20 * mem.GIB)
    assert changes and all(c.plan.lora == lora for c in changes)


def test_cli_lora_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    base = ["memory", "--model", str(tmp_path), "--backend", "fsdp:d1", "--max-tokens", "64", "--dtype", "float32"]
    assert main([*base, "--lora-rank", "2", "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)["lora"]
    assert (lora["trainable_per_rank"], lora["full_trainable_per_rank"]) == (ADAPTER, TOTAL)
    assert lora["optimizer_per_rank"] == 8 * ADAPTER + 4 * ADAPTER_TENSORS
    assert lora["static_saved_per_rank"] == 16 * TOTAL + 4 * 21 - (4 * TOTAL + 16 * ADAPTER + 4 * ADAPTER_TENSORS)
    assert main([*base, "--lora-rank", "2", "--lora-targets", "q_proj,v_proj"]) == 0
    text = capsys.readouterr().out
    assert "LoRA rank 2: 0.00 M trainable" in text and "base frozen in float32" in text
    for flags, words in (
        (["--lora-rank", "2", "--lora-targets", "q_proj,lm_head"], "'lm_head'"),
        (["--lora-targets", "q_proj"], "needs --lora-rank"),
        (["--lora-rank", "0"], "--lora-rank 0"),
        (["--lora-rank", "2", "--role", "critic"], "not the critic"),
    ):
        assert main([*base, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "fix" in err, err


def test_cli_takes_lora_and_the_layout_from_a_trainer_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    trainer = tmp_path / "trainer.yaml"
    trainer.write_text(
        f"model: {{path: {tmp_path}, dtype: float32}}\n"
        "actor:\n  backend: fsdp:d2\n  treeTraining: {maxTokensPerMicrobatch: 128}\n"
        "  lora: {rank: 2, targetModules: [q_proj, v_proj]}\n"
    )
    assert main(["memory", "--model", str(tmp_path), "--config", str(trainer), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["backend"], out["max_tokens"], out["dtype"]) == ("fsdp:d2", 128, "float32")
    assert out["lora"]["targets"] == ["q_proj", "v_proj"] and out["trainable_per_rank"] == 2 * 2 * 32 // 2
    # A flag wins over the config; the ref plans no adapter.
    assert main(["memory", "--model", str(tmp_path), "--config", str(trainer), "--lora-rank", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora"]["rank"] == 4
    assert main(["memory", "--model", str(tmp_path), "--config", str(trainer), "--role", "ref", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora"] is None
    trainer.write_text(f"model: {{path: {tmp_path}}}\nactor: {{lora: {{rank: 0}}}}\n")
    assert main(["memory", "--model", str(tmp_path), "--config", str(trainer)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "actor.lora.rank" in err
