"""megatron-core's ``TransformerConfig`` from a Hugging Face config (Llama, Qwen2, Qwen3,
Qwen3-MoE) and the current parallel state, the RoPE frequencies, and the refusals of what the
engine does not convert."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F

from treetrain.engines.errors import EngineConfigError

with warnings.catch_warnings():
    # megatron-core warns at import time that TransformerEngine and Apex are missing (CPU, tests).
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def check_family(hf: Any) -> None:
    if hf.model_type not in FAMILIES:
        raise EngineConfigError(
            f"the megatron engine converts {', '.join(FAMILIES)} models, not {hf.model_type!r}; "
            "use the FSDP engine (fsdp:...) for other families"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise EngineConfigError(f"the megatron engine supports silu MLPs only, got hidden_act={hf.hidden_act!r}")
    if getattr(hf, "mlp_bias", False):
        raise EngineConfigError("the megatron engine does not convert MLP biases (mlp_bias=True)")
    if getattr(hf, "use_sliding_window", False):
        raise EngineConfigError("tree attention has no sliding window; set use_sliding_window=false")


def head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def qkv_bias(hf: Any) -> bool:
    return hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))


def transformer_config(hf: Any, *, recompute: bool, dispatcher: str = "allgather") -> TransformerConfig:
    """Megatron's TransformerConfig for a Llama/Qwen2/Qwen3(-MoE) config and the current
    parallel state. fp32 parameters (master weights); bf16/fp16 run under autocast. Tensor
    parallel always runs with sequence parallel: the norms and residual adds run on a
    rank's ``1/t`` of the tokens, the linears all-gather and reduce-scatter them.
    ``dispatcher``: Megatron's MoE token dispatcher (``allgather``: the engine's; ``alltoall``
    is checked on GPU by ``bench/megatron_gpu.py``)."""
    check_family(hf)
    moe: dict[str, Any] = {}
    if hf.model_type == "qwen3_moe":
        if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
            raise EngineConfigError("Qwen3-MoE with dense layers in between (mlp_only_layers) is not converted")
        if not getattr(hf, "norm_topk_prob", True):
            raise EngineConfigError("Qwen3-MoE with norm_topk_prob=false is not converted")
        moe = {
            "num_moe_experts": hf.num_experts,
            "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_token_dispatcher_type": dispatcher,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": 0.0,  # the RL loss adds no router aux loss (see engine docs)
            "moe_router_pre_softmax": False,
            "moe_router_dtype": "fp32",
            "moe_grouped_gemm": False,
            "moe_permute_fusion": False,
        }
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=head_dim(hf),
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        qk_layernorm=hf.model_type in ("qwen3", "qwen3_moe"),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        sequence_parallel=ps.get_tensor_model_parallel_world_size() > 1,
        recompute_granularity=None,  # recompute is ours (full_recompute below): it replays TreeInput
        **moe,
    )


def rope_inv_freq(hf: Any) -> torch.Tensor:
    """The inverse frequencies exactly as transformers computes them, rope scaling included;
    scalings that change with the sequence or rescale the attention are refused."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = head_dim(hf)
        inv: torch.Tensor = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv
    if kind not in ("linear", "llama3"):
        raise EngineConfigError(
            f"rope_type {kind!r} is not supported by the megatron engine (default, linear and llama3 are); "
            "use the FSDP engine for this model"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    if scaling != 1.0:
        raise EngineConfigError(f"rope_type {kind!r} scales attention by {scaling}; not supported here")
    return inv.float()
