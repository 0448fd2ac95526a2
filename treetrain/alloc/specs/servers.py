"""The rollout servers: SGLang and vLLM instances (``d`` counts servers, ``t * p`` GPUs each)."""

from treetrain.alloc.spec import EngineLetters, EngineSpec

SGLANG = EngineSpec(name="sglang", kind="inference", letters=EngineLetters(accepted="dtp"))
VLLM = EngineSpec(name="vllm", kind="inference", letters=EngineLetters(accepted="dtp"))
