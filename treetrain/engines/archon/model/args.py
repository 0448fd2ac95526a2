"""``ModelArgs``: everything the Archon models read, from a Hugging Face config.

A plain dataclass: the model never sees a transformers object. :meth:`ModelArgs.from_hf`
is where a config this engine cannot run exactly is refused, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treetrain.engines.errors import EngineConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# RoPE scalings computed here exactly as transformers does; others change with the sequence
# length (dynamic) or attention temperature (yarn, longrope) and are refused.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    family: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    # llama3 scaling only
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    tie_embeddings: bool = False
    # Mixture of experts (Qwen3-MoE); moe_layers lists the layers whose FFN is an MoE.
    n_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = field(default=())
    router_aux_loss_coef: float = 0.0
    use_aux_loss: bool = False  # transformers adds the aux loss only with output_router_logits

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @classmethod
    def from_hf(cls, config: Any) -> ModelArgs:
        family = config.model_type
        if family not in FAMILIES:
            raise EngineConfigError(
                f"the archon engine has no {family!r} model; families: {', '.join(FAMILIES)} (fix: use fsdp:...)"
            )
        if getattr(config, "use_sliding_window", False):
            raise EngineConfigError(
                "the archon engine does not run sliding-window attention; set use_sliding_window=false"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise EngineConfigError(f"the archon engine's FFN is SwiGLU (silu); got hidden_act={config.hidden_act!r}")
        if getattr(config, "attention_bias", False) and family != "qwen2":
            raise EngineConfigError(f"attention_bias=true is not supported for {family}")
        if getattr(config, "mlp_bias", False):
            raise EngineConfigError("mlp_bias=true is not supported by the archon engine")
        rope = _rope(config)
        heads = config.num_attention_heads
        moe: dict[str, Any] = {}
        if family == "qwen3_moe":
            step = config.decoder_sparse_step
            skip = set(config.mlp_only_layers or ())
            layers = tuple(
                i
                for i in range(config.num_hidden_layers)
                if i not in skip and config.num_experts > 0 and (i + 1) % step == 0
            )
            moe = dict(
                n_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                moe_ffn_dim=config.moe_intermediate_size,
                norm_topk_prob=bool(config.norm_topk_prob),
                moe_layers=layers,
                router_aux_loss_coef=float(config.router_aux_loss_coef),
                use_aux_loss=bool(getattr(config, "output_router_logits", False)),
            )
        return cls(
            family=family,
            vocab_size=config.vocab_size,
            dim=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_dim=config.intermediate_size,
            norm_eps=config.rms_norm_eps,
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            **rope,
            **moe,
        )


def _rope(config: Any) -> dict[str, Any]:
    # transformers >= 5 keeps theta and scaling in rope_parameters; older configs in rope_theta/rope_scaling.
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise EngineConfigError(
            f"RoPE scaling {kind!r} is not supported by the archon engine (supported: {', '.join(ROPE_TYPES)}); "
            "fix: drop rope_scaling from the config or use fsdp:..."
        )
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": kind}
    if kind in ("linear", "llama3"):
        out["rope_factor"] = float(params["factor"])
    if kind == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
        out["rope_original_max_positions"] = int(params["original_max_position_embeddings"])
    return out
