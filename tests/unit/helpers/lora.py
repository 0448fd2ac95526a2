"""What the LoRA tests share: a random PEFT adapter for a saved tiny model, the model with it
merged in, and the reference each engine is compared with (each sequence alone through
transformers, on the merged weights).

Why the merged model is the reference: the adapted layer computes ``(W + s B A) x``, so the
log-probs are the merged model's, and with ``G`` the gradient of the merged weight,
``dL/dA = s B^T G`` and ``dL/dB = s G A^T``. This holds for every module the engines adapt,
experts included (transformers 5 fuses a Qwen3-MoE layer's experts, which PEFT cannot adapt
one by one; the merged weights need no adapter at all)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from megatron_models import per_expert, reference

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
FFN = ("gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK


def lora_settings(targets: tuple[str, ...] = ATTENTION + FFN, **more: Any) -> Any:
    from treetrain.config.lora import LoraSettings

    return LoraSettings(rank=RANK, alpha=ALPHA, target_modules=list(targets), **more)


def _modules(config: dict[str, Any], targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Every adapted Hugging Face module of the saved model and its ``(in, out)`` features."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads)
    moe = config["model_type"] == "qwen3_moe"
    ffn = config["moe_intermediate_size"] if moe else config["intermediate_size"]
    sizes = {
        "q_proj": (h, heads * d),
        "k_proj": (h, kv * d),
        "v_proj": (h, kv * d),
        "o_proj": (heads * d, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }
    out = {}
    for i in range(config["num_hidden_layers"]):
        for t in targets:
            if t in ATTENTION:
                out[f"model.layers.{i}.self_attn.{t}"] = sizes[t]
            elif moe:
                for e in range(config.get("num_experts") or config["num_local_experts"]):
                    out[f"model.layers.{i}.mlp.experts.{e}.{t}"] = sizes[t]
            else:
                out[f"model.layers.{i}.mlp.{t}"] = sizes[t]
    return out


def save_adapter(model: Path, out: Path, targets: tuple[str, ...] = ATTENTION + FFN, seed: int = 0) -> Path:
    """A PEFT adapter directory for the model at ``model`` with random ``A`` and ``B`` (B not
    zero, so every gradient is)."""
    from treetrain.engines.lora import peft_files

    config = json.loads((model / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    adapter = {
        m: (torch.randn((RANK, n_in), generator=g) * 0.2, torch.randn((n_out, RANK), generator=g) * 0.2)
        for m, (n_in, n_out) in _modules(config, targets).items()
    }
    peft_files.write(out, adapter, peft_files.adapter_config(lora_settings(targets), targets, str(model)))
    return out


def load_adapter(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from treetrain.engines.lora import peft_files

    return peft_files.read(path, lora_settings())


def save_merged(model: Path, adapter: Path, out: Path) -> Path:
    """``model``'s directory with the adapter merged into its weights (``W + s B A``)."""
    from safetensors.torch import load_file, save_file

    from treetrain.engines.lora import peft_files

    shutil.copytree(model, out)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files
    merged = peft_files.merge(load_file(str(files[0])), load_adapter(adapter), SCALE)
    save_file(merged, str(files[0]), metadata={"format": "pt"})
    return out


def adapter_reference(
    merged: Path, adapter: Path, batch: Any, loss: Any
) -> tuple[float, dict[str, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Each sequence alone through the merged model: the loss, the adapter's gradients
    (``s B^T G``, ``s G A^T``) by module and the per-sequence log-probs."""
    value, grads, logps = reference(merged, batch, loss)
    grads = per_expert(grads)
    out = {}
    for module, (a, b) in load_adapter(adapter).items():
        g = grads[f"{module}.weight"]
        out[module] = (SCALE * b.T @ g, SCALE * g @ a.T)
    return value, out, logps


def grad_problems(got: dict[str, tuple[torch.Tensor, torch.Tensor]], want: dict[str, Any]) -> list[str]:
    """Every adapter gradient further from the reference than 1e-4 of the reference's largest
    element (fp32 sums in another order differ by about 1e-7 of it; a wrong gradient by its size)."""
    wrong = sorted(set(got) ^ set(want))
    for module, pair in want.items():
        for which, g, w in zip("AB", got.get(module, (None, None)), pair, strict=True):
            if g is None:
                continue
            err, scale = float((g - w).abs().max()), float(w.abs().max())
            if not err <= 1e-4 * scale:
                wrong.append(f"{module}.lora_{which}: max abs error {err:.3g}, largest element {scale:.3g}")
    return wrong
