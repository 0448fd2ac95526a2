"""The FSDP engine (``treetrain/engines/fsdp/``): a Hugging Face model, DTensor tensor parallel,
FSDP2 over the data ranks."""

from treetrain.alloc.spec import EngineLetters, EngineSpec

FSDP = EngineSpec(
    name="fsdp",
    kind="training",
    letters=EngineLetters(accepted="dtc", not_yet={"c": "context parallelism is not supported by the FSDP engine yet"}),
    engine="treetrain.engines.fsdp.engine:FSDPEngine",
    sixteen_bit="fsdp2_cast",
    shards_over=("dp",),
    activation_slack=1.15,
    lora=True,
    lora_experts=False,  # transformers fuses a MoE layer's experts: attention and dense FFNs only
)
