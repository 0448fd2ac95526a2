"""An estimate of the activation memory one micro-batch keeps for its backward pass.

Plain Python, no torch; calibrated against CPU peaks of ``bench/tree_memory.py`` and
documented in docs/engines.md ("Memory plan"). Letters: h hidden size, I FFN width, V
vocabulary, H query heads, K key/value heads, D head dim, E experts, N tree tokens of one
micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from treetrain.alloc.model import Allocation
from treetrain.alloc.precision import DTYPE_BYTES
from treetrain.alloc.registry import names, spec_of
from treetrain.alloc.shapes import ModelShape, ceil_div

# Rows of logits whose fp32 log-softmax is worked on at once (treetrain.logprob's default).
LOGPROB_CHUNK = 1024


def activation_slack() -> dict[str, float]:
    """Each training engine's ``activation_slack`` (its description): the measured CPU peak over
    the saved tensors listed in :func:`activation_bytes` (bench/tree_memory.py, tiny Llama,
    fp32, 4k and 16k tree tokens, once the CPU attention kernel's scores are taken out:
    docs/engines.md, "Memory plan"), autograd's extra copies and allocator slack."""
    return {name: spec_of(name).activation_slack for name in names("training")}


def activation_bytes(
    m: ModelShape,
    allocation: Allocation,
    *,
    layers: Sequence[int],
    last: bool,
    tokens: int,
    dtype: str,
    role: str,
    recompute: bool,
    in_flight: int = 1,
    gathered: int = 0,
) -> int:
    """An estimate of one stage's activation memory for micro-batches of ``tokens`` tree tokens.

    Per token of a layer, the tensors autograd saves: ~6 hidden-size tensors (norm inputs and
    outputs, residuals), q, k, v and the attention output, the FFN's gate, up, activation and
    product (an MoE layer: each routed copy's input and FFN tensors, and fp32 router
    probabilities). Context parallel gives a rank ``N / c`` rows; tensor parallel divides the
    head and FFN tensors, and in Megatron and Archon (sequence parallel) the hidden-size ones
    too. Recompute keeps one hidden state per layer plus one layer's tensors. The last stage
    adds the logits and their gradient (``V / t`` columns where the head is vocabulary
    parallel) and the fp32 log-softmax chunk. A reference model saves nothing for a backward:
    one layer's tensors and the logits. Tree attention keeps no ``N x N`` matrix. The sum is
    multiplied by the engine's ``activation_slack``, fitted to measured CPU peaks. What differs
    between engines is their description's: ``sequence_parallel``, ``context_kv_whole``,
    ``vocab_parallel`` and the slack."""
    d = allocation.dims
    spec = allocation.spec
    b = DTYPE_BYTES[dtype]
    n = ceil_div(tokens, d.cp)
    sp = d.tp if spec.sequence_parallel else 1
    h, t = m.hidden, d.tp
    attn = (2 * m.heads + 2 * m.kv_heads) * m.head_dim // t
    if spec.context_kv_whole and d.cp > 1:
        attn += 2 * m.kv_heads * m.head_dim * (d.cp - 1) // t  # K and V of the whole tree

    moe_ffn = m.top_k * (h + 4 * m.moe_ffn / d.etp) + h + 2 * m.experts * 4 / b  # routed copies, router
    dense_ffn = 4 * m.ffn / t

    def layer(i: int) -> float:
        return n * (6 * h / sp + attn + (moe_ffn if i in m.moe_layers else dense_ffn)) * b

    per_layer = [layer(i) for i in layers] or [0.0]
    if role == "ref":
        stored = max(per_layer)
    elif recompute:
        stored = len(layers) * n * h / sp * b + max(per_layer)
    else:
        stored = sum(per_layer)
    stored *= in_flight
    if last and role != "critic":
        cols = m.vocab // t if spec.vocab_parallel else m.vocab
        copies = 1 if role == "ref" else 2  # the logits, and their gradient in the backward
        stored += n * cols * b * copies + min(n, LOGPROB_CHUNK) * cols * 4 * 2
    return int(stored * spec.activation_slack) + gathered
