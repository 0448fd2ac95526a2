"""The Archon engine (``treetrain/engines/archon/``): our own PyTorch-native models, DTensor
tensor and sequence parallel, Ulysses context parallel, FSDP2 over the data x context ranks,
pipeline stages balanced by FLOPs."""

from treetrain.alloc.spec import EngineLetters, EngineSpec

ARCHON = EngineSpec(
    name="archon",
    kind="training",
    letters=EngineLetters(accepted="dtpce", hybrid=True),
    engine="treetrain.engines.archon.engine:ArchonEngine",
    sixteen_bit="fsdp2_cast",
    shards_over=("dp", "cp"),
    vocab_parallel=True,
    sequence_parallel=True,
    stage_split="balanced",
    moe_tensor_parallel=False,
    whole_embedding_grad=True,
    activation_slack=1.1,
    lora=True,
)
