"""Peak memory of one training micro-batch on the CPU: a 32k-token tree vs the same sequences flat.

    python bench/tree_memory.py [--engines fsdp archon megatron] [--tokens 32768] [--vocab 4096]
        [--rows micro-batch pipeline] [--micro-batches 8] [--pipeline-tokens 2048]

The batch is ``bench/archon_gpu.py``'s: 8 samples of one shared prompt, half of ``--tokens``
prompt and the rest split over the 8 answers, so the tree holds ``--tokens`` tokens and the
flat micro-batch (the same sequences, one micro-batch, block-diagonal) about 4.5 times as
many. One forward + chunked log-prob gather + backward through each engine's model (the tiny
Llama of ``bench/train_step.py``, fp32, ``sparse`` attention). Each run is its own process;
the figure is its peak RSS (``ru_maxrss``) minus its RSS just before the forward, so model,
packing and imports are left out. ``bench/archon_gpu.py`` measures the same on a GPU
(``torch.cuda.max_memory_allocated``) for a larger model.

The pipeline row (``--rows pipeline``) runs ``archon:p2`` and ``megatron:p2`` on 2 CPU
processes over gloo, one step of ``--micro-batches`` trees of ``--pipeline-tokens`` tokens
each (a 4-layer Llama, fp32), once per schedule (``model.pipelineSchedule``: gpipe, 1f1b),
and reports per stage the bytes of activations autograd holds for the backward at the peak
(:class:`SavedBytes`: exact and deterministic, where RSS would mix in the allocator). GPipe
holds every micro-batch's; 1F1B at most ``stages - stage`` of them.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def batch(tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    n_prompt = tokens // 2
    each = (tokens - n_prompt) // 8 - 16
    prompt = torch.randint(0, vocab, (n_prompt,), generator=g).tolist()
    return [prompt + torch.randint(0, vocab, (each,), generator=g).tolist() for _ in range(8)]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class SavedBytes:
    """Bytes of the tensors autograd saves for the backward, counted while inside this
    context: ``now`` alive, ``peak`` the most alive at once. Each storage counts once however
    many saved tensors view it; ``exclude`` (the parameters) is left out, so what remains is
    activations. Deterministic: a saved tensor stops counting when autograd drops it (CPython
    frees it at once), independent of the allocator."""

    def __init__(self, exclude: Iterable[Any] = ()) -> None:
        from torch.distributed.tensor import DTensor

        local = (t.to_local() if isinstance(t, DTensor) else t for t in exclude)
        self.skip = {t.untyped_storage().data_ptr() for t in local}
        self.refs: dict[int, list[int]] = {}  # storage address -> [saved tensors on it, bytes]
        self.now = self.peak = 0
        self._hooks: Any = None

    def __enter__(self) -> SavedBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: Any) -> Any:
        key = t.untyped_storage().data_ptr()
        if key == 0 or key in self.skip:
            return t
        ref = self.refs.setdefault(key, [0, t.untyped_storage().nbytes()])
        if ref[0] == 0:
            self.now += ref[1]
            self.peak = max(self.peak, self.now)
        ref[0] += 1
        return _Saved(self, t, key)

    @staticmethod
    def _unpack(saved: Any) -> Any:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: int) -> None:
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.now -= ref[1]
            del self.refs[key]


class _Saved:
    """One saved tensor; when autograd frees it, its meter counts it out."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedBytes, tensor: Any, key: int) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self) -> None:
        self.meter.release(self.key)


def one(engine: str, kind: str, tokens: int, vocab: int) -> dict[str, object]:
    """Runs in a child process: one micro-batch's forward + backward, its peak memory."""
    import torch

    sys.path.insert(0, str(HERE))
    from train_step import ENGINES, step, tiny_llama

    from treetrain.tree import PackConfig, pack

    torch.set_num_threads(1)
    model = ENGINES[engine](tiny_llama(vocab)).train()
    seqs = batch(tokens, vocab)
    flat = kind == "flat"
    cap = sum(len(s) for s in seqs) + 128 * len(seqs) if flat else tokens
    packed = pack(seqs, PackConfig(max_tokens_per_mb=-(-cap // 128) * 128, block_size=128, share_prefixes=not flat))
    assert len(packed.trees) == 1, f"{kind}: {len(packed.trees)} micro-batches"
    before = _rss_mib()
    step(model, packed, 128)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "engine": engine,
        "kind": kind,
        "tokens": packed.stats.tree_tokens,
        "original_tokens": packed.stats.original_tokens,
        "peak_mib": round(peak - before, 1),
    }


def _pipeline_rank(rank: int, port: int, model_dir: str, micro: int, tokens: int, vocab: int, out: Any) -> None:
    """One of the 2 pipeline ranks: each engine, each schedule, one step; the peaks to ``out``."""
    import os

    import torch

    from treetrain.config import LossSettings, ModelSettings, OptimizerSettings, TreeTrainingSettings
    from treetrain.engines import build_engine
    from treetrain.engines.batch import TokenFields, TrainBatch
    from treetrain.engines.megatron.parallel import reset_megatron
    from treetrain.rl.losses import PPOLoss

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    seqs = [s for i in range(micro) for s in batch(tokens, vocab, seed=i)]  # one tree per prompt
    n = [len(s) - 1 for s in seqs]
    train = TrainBatch(
        sequences=seqs,
        loss_mask=[torch.ones(k) for k in n],
        fields=TokenFields(advantages=[torch.ones(k) for k in n], old_logprobs=[torch.full((k,), -8.0) for k in n]),
    )
    tree = TreeTrainingSettings(max_tokens_per_mb=-(-tokens // 128) * 128, block_size=128, attention="sparse")
    for engine_name in ("archon", "megatron"):
        reset_megatron()
        engine = build_engine(
            ModelSettings(path=model_dir), f"{engine_name}:p2", tree=tree, optimizer=OptimizerSettings()
        )
        params = list(engine.model.parameters())
        row: dict[str, object] = {"engine": engine_name, "stage": rank}
        for schedule in ("gpipe", "1f1b"):
            engine.settings = engine.settings.model_copy(update={"pipeline_schedule": schedule})
            with SavedBytes(exclude=params) as meter:
                stats = engine.forward_backward(train, PPOLoss(LossSettings()))
            engine.zero_grad()
            row[schedule] = meter.peak
            row["micro_batches"] = stats.micro_batches
        out.put(row)
    import torch.distributed as dist

    dist.destroy_process_group()
    os._exit(0)  # torch 2.15's gloo sometimes aborts in teardown after a clean run


def pipeline(micro: int, tokens: int, vocab: int) -> list[dict[str, object]]:
    """Both pipeline engines at p2, GPipe vs 1F1B: one row per engine and stage."""
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(4096, 2 * tokens),
        )
        LlamaForCausalLM(config).float().save_pretrained(tmp)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        mp.start_processes(_pipeline_rank, args=(port, tmp, micro, tokens, vocab, out), nprocs=2, start_method="spawn")
        rows = []
        while not out.empty():
            rows.append(out.get())
    return sorted(rows, key=lambda r: (str(r["engine"]), int(str(r["stage"]))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["fsdp", "archon", "megatron"])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--kinds", nargs="+", default=["tree", "flat"], help="tree, flat (flat needs ~4.5x the memory)")
    p.add_argument("--rows", nargs="+", choices=["micro-batch", "pipeline"], default=["micro-batch", "pipeline"])
    p.add_argument("--micro-batches", type=int, default=8, help="pipeline row: trees in the step")
    p.add_argument("--pipeline-tokens", type=int, default=2048, help="pipeline row: tokens per tree")
    p.add_argument("--one", nargs=2, metavar=("ENGINE", "KIND"), help=argparse.SUPPRESS)  # the child's job
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.tokens, a.vocab)))
        return
    if "micro-batch" in a.rows:
        micro_batch_rows(a)
    if "pipeline" in a.rows:
        m, n = a.micro_batches, a.pipeline_tokens
        print(f"pipeline p2, {m} trees of {n} tokens, 4-layer Llama (vocab {a.vocab}), fp32, CPU: saved activations")
        print(f"{'engine':<9} {'stage':>5} {'micro-batches':>13} {'GPipe MiB':>9} {'1F1B MiB':>9} {'1F1B/GPipe':>10}")
        for r in pipeline(m, n, a.vocab):
            g, f = int(str(r["gpipe"])) / 2**20, int(str(r["1f1b"])) / 2**20
            print(
                f"{r['engine']!s:<9} {r['stage']!s:>5} {r['micro_batches']!s:>13} {g:>9.1f} {f:>9.1f} {f / g:>10.2f}",
                flush=True,
            )


def micro_batch_rows(a: argparse.Namespace) -> None:
    """One micro-batch per engine, tree vs flat, each in its own process."""
    print(f"one micro-batch, forward + backward, tiny Llama (vocab {a.vocab}), fp32, sparse attention, CPU")
    print(f"{'engine':<9} {'tree tokens':>11} {'flat tokens':>11} {'tree MiB':>9} {'flat MiB':>9} {'flat/tree':>9}")
    for engine in a.engines:
        nan: dict[str, object] = {"tokens": 0, "peak_mib": float("nan")}
        got = {"tree": nan, "flat": nan}
        for kind in a.kinds:
            cmd = [sys.executable, __file__, "--one", engine, kind, "--tokens", str(a.tokens), "--vocab", str(a.vocab)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
                got[kind] = {"tokens": 0, "peak_mib": float("nan"), "error": tail[0]}
                print(f"{engine} {kind}: failed ({'killed: out of memory?' if done.returncode < 0 else tail[0]})")
                continue
            got[kind] = json.loads(done.stdout.strip().splitlines()[-1])
        t, f = got["tree"], got["flat"]
        print(
            f"{engine:<9} {t['tokens']:>11} {f['tokens']:>11} {t['peak_mib']:>9.0f} {f['peak_mib']:>9.0f} "
            f"{f['peak_mib'] / t['peak_mib']:>8.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
