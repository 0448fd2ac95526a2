"""The Megatron engine (``treetrain/engines/megatron/``): megatron-core's GPTModel, vocabulary and
sequence parallel, context parallel with whole-tree K and V, ZeRO-1, bf16 weights with fp32
masters; LoRA adapters on its column/row-parallel linears and experts."""

from treetrain.alloc.spec import EngineLetters, EngineSpec

MEGATRON = EngineSpec(
    name="megatron",
    kind="training",
    letters=EngineLetters(accepted="dtpce", hybrid=True),
    engine="treetrain.engines.megatron.engine:MegatronEngine",
    sixteen_bit="fp32_master",
    shards_over=(),
    vocab_parallel=True,
    sequence_parallel=True,
    context_kv_whole=True,
    stage_split="even",
    sharded_optimizer=True,
    activation_slack=1.3,
    lora=True,
)
