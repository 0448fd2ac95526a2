"""What logging the policy entropy every step costs: one training step with and without it.

    python bench/entropy_cost.py [--tokens 2048] [--layers 30] [--repeat 3] [--threads 1]

The trainer asks the engines for the entropy of every predictive distribution on every step
(``PPOLoss.needs_entropy``), even with ``trainer.loss.entropyCoef`` 0, to report it. The
entropy comes out of the same chunked fp32 pass over the logits that the log-normaliser
already makes (:func:`treetrain.logprob.gather_logprobs`); unused by the loss, it adds nothing
to backward. This measures the price on the shape of the embedded default's model
(SmolLM2-135M: hidden 576, 30 layers, 9 heads, 3 KV heads, vocabulary 49152; random weights,
fp32), one packed sequence of ``--tokens`` tokens, sparse tree attention:

- ``gather``: forward + backward of ``gather_logprobs`` alone on ``[tokens, vocab]`` logits;
- ``step``: the model's forward, the gather, ``-sum(logp)`` backward: a training step's compute.

Each is the best of ``--repeat`` runs after one burn-in, in this process's CPU time (one torch
thread: what the work costs, without the time other jobs on a shared machine took the core).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treetrain.attention import TreeAttentionMeta, tree_forward, use_tree_attention
from treetrain.logprob import TreeTensors, gather_logprobs
from treetrain.tree import PackConfig, pack

VOCAB = 49152
BLOCK = 64


def smollm2_shape(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    model = LlamaForCausalLM(config).float().train()
    use_tree_attention(model)
    return model


def best_cpu(run: Callable[[], None], repeat: int) -> float:
    run()  # burn-in
    times = []
    for _ in range(repeat):
        c0 = time.process_time()
        run()
        times.append(time.process_time() - c0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    seq = [rng.randrange(1, VOCAB) for _ in range(args.tokens)]
    tokens = (args.tokens + BLOCK - 1) // BLOCK * BLOCK
    (tree,) = pack([seq], PackConfig(max_tokens_per_mb=tokens, block_size=BLOCK)).trees
    cpu = torch.device("cpu")
    tensors = TreeTensors.from_tree(tree, cpu)
    model = smollm2_shape(args.layers)
    print(
        f"config: tokens={args.tokens} model=llama(hidden 576, {args.layers} layers, vocab {VOCAB}) fp32 "
        f"torch_threads={torch.get_num_threads()} repeat={args.repeat} (best CPU seconds)"
    )

    logits_NV = torch.randn(len(tree.input_ids), VOCAB, requires_grad=True)

    def gather(with_entropy: bool) -> None:
        logits_NV.grad = None
        logp, ent = gather_logprobs(logits_NV, tensors.pred_M, tensors.label_M, with_entropy=with_entropy)
        if ent is not None:
            float(ent.detach().sum())  # as the loss's stat: read, never differentiated
        (-logp.sum()).backward()

    def step(with_entropy: bool) -> None:
        model.zero_grad(set_to_none=True)
        meta = TreeAttentionMeta.from_tree(tree, backend="sparse", block_size=BLOCK, device=cpu)
        with tree_forward():
            out = model(
                input_ids=tensors.input_ids_N[None],
                position_ids=tensors.position_ids_N[None],
                use_cache=False,
                tree_attention=meta,
            ).logits
        gather_out = out.view(out.shape[-2], out.shape[-1])
        logp, ent = gather_logprobs(gather_out, tensors.pred_M, tensors.label_M, with_entropy=with_entropy)
        if ent is not None:
            float(ent.detach().sum())
        (-logp.sum() / logp.shape[0]).backward()

    for name, fn in (("gather", gather), ("step", step)):
        without = best_cpu(lambda f=fn: f(False), args.repeat)  # type: ignore[misc]
        with_ent = best_cpu(lambda f=fn: f(True), args.repeat)  # type: ignore[misc]
        print(
            f"{name:<7} without entropy {without:7.3f}s  with entropy {with_ent:7.3f}s  "
            f"extra {with_ent - without:+.3f}s ({(with_ent / without - 1) * 100:+.1f}%)",
            flush=True,
        )


if __name__ == "__main__":
    main()
