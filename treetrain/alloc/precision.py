"""One precision rule for every engine and layout, and the one ``model.dtype: auto``.

Plain Python, no torch: the engines build their models from it and the memory plan (and the
operator's admission) counts bytes from it, so the two cannot disagree.

The rule: a 16-bit ``model.dtype`` is the dtype the forward and backward passes compute in;
the weights the optimizer steps are fp32 on every engine and every layout, because an AdamW
update of about ``lr`` is below half a bf16 ulp of most weights and would vanish if bf16
weights were stepped directly.

Which engine does what is its description's ``sixteen_bit`` and ``shards_over``
(:mod:`treetrain.alloc.specs`); this module never names an engine.

- ``fsdp2_cast`` engines (``fsdp``, ``archon``) keep fp32 parameters (and so fp32 gradients and AdamW moments) and
  let FSDP2's ``MixedPrecisionPolicy`` cast each layer to the compute dtype when it gathers
  it, with gradients reduced and accumulated in fp32. FSDP2 wraps the model whenever it
  shards (``d > 1``; Archon ``d*c > 1``) *or* casts (16-bit compute), over a one-rank data
  mesh when nothing is sharded: one code path for every ``d``, the same numerics as a sharded
  run, and bytes the memory plan counts exactly (the gathered bf16 layer is a working copy).
- ``fp32_master`` engines (``megatron``) keep bf16 parameters and gradients for ``bfloat16`` and an fp32 master copy in
  its sharded optimizer (``engines/zero.py``, a group of one on one rank); ``float16`` keeps
  fp32 parameters under autocast (there is no loss scaler).
- With LoRA (every engine) the frozen base is stored in the compute dtype (it is never
  stepped, so it needs no fp32 copy) and the adapter in fp32 (AdamW steps it), cast to the
  compute dtype where it is applied; FSDP2 wraps the model only to shard it.
"""

from __future__ import annotations

from dataclasses import dataclass

from treetrain.alloc.model import ParallelDims
from treetrain.alloc.registry import names, spec_of

# Bytes per element of each dtype name ``model.dtype`` can resolve to.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
AUTO = "auto"
# What ``auto`` becomes: 16-bit compute on GPUs, fp32 on the CPU (the CPU's bf16 is slow and
# the CPU runs are the tests' golden numbers).
AUTO_ON_CUDA = "bfloat16"
AUTO_ON_CPU = "float32"


def resolve_dtype(name: str, *, cuda: bool) -> str:
    """``model.dtype`` as the dtype the engine computes in: ``auto`` is bfloat16 on CUDA and
    float32 on the CPU; any other name is returned as it is (``ValueError`` for an unknown one)."""
    if name == AUTO:
        return AUTO_ON_CUDA if cuda else AUTO_ON_CPU
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPE_BYTES)}")
    return name


@dataclass(frozen=True, slots=True)
class Precision:
    """How one engine holds and steps its weights for one (resolved) ``model.dtype``.

    ``compute``: the dtype the forward and backward passes run in. ``params``: the dtype the
    model's parameters and their gradients are stored in. ``master``: the optimizer keeps an
    fp32 copy of each (16-bit) parameter and steps that (Megatron). ``fsdp``: FSDP2 wraps the
    model (it shards, or it casts fp32 parameters to ``compute``). ``autocast``: the forward
    runs under ``torch.autocast`` to ``compute`` (Megatron's float16). AdamW's moments are
    fp32 in every case."""

    compute: str
    params: str
    master: bool = False
    fsdp: bool = False
    autocast: bool = False
    adapter: str | None = None  # LoRA: the adapter's dtype (fp32); the frozen base is ``params``

    @property
    def steps_fp32(self) -> bool:
        """The optimizer updates fp32 weights (always true: the point of this rule)."""
        return self.params == "float32" or self.master or self.adapter == "float32"


def fsdp_group(engine: str, dims: ParallelDims) -> int:
    """Ranks FSDP2 shards one parameter over (its description's ``shards_over``): ``d`` (fsdp),
    ``d*c`` (archon), 1 (megatron: its parameters are whole on every data rank)."""
    return spec_of(engine).shard_size(dims)


def precision(engine: str, dims: ParallelDims, dtype: str, *, lora: bool = False) -> Precision:
    """The precision rule for the training engine ``engine`` on layout ``dims`` with the
    resolved ``model.dtype`` ``dtype`` (see :func:`resolve_dtype`); ``lora``: a frozen base
    with an fp32 adapter."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)} (resolve 'auto' first)")
    if engine not in names("training"):
        raise ValueError(f"no precision rule for the {engine!r} engine")
    spec = spec_of(engine)
    low = dtype != "float32"
    if lora:
        return Precision(compute=dtype, params=dtype, fsdp=spec.shard_size(dims) > 1, adapter="float32")
    if spec.sixteen_bit == "fp32_master":
        if dtype == "bfloat16":
            return Precision(compute=dtype, params=dtype, master=True)
        return Precision(compute=dtype, params="float32", autocast=low)
    return Precision(compute=dtype, params="float32", fsdp=low or spec.shard_size(dims) > 1)
