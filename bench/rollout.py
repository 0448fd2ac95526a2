"""Local rollout of a multi-turn batch: the KV cache kept between turns vs. every turn read whole.

    python bench/rollout.py [--model builtin:smollm2-135m] [--groups 4] [--group-size 4] [--turns 3] [--repeat 2]

Plays the turns of the built-in arithmetic quiz (``builtin:arithmetic``) the way the trainer's
rollout does (every turn of every episode one prompt; a group's samples share the episode
seed) with one ``LocalRollout``, in two modes side by side, with the same seeds:

- ``kept``: the cache continues from turn to turn (what the trainer runs): a group's identical
  first prompts are read once, each later turn reads only its new tokens;
- ``reread``: ``forget()`` before every turn, so each turn reads its whole conversation (a
  group's identical first prompts are still read once).

Both modes must sample the same tokens (checked). Printed: prompt tokens read, the best wall
time of ``--repeat`` rounds per mode (after one burn-in round each), and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from treetrain.engines.hf_model import build_model
from treetrain.engines.source import ModelSource
from treetrain.rl.rollout import LocalRollout, SamplingParams
from treetrain.rl.task import Task, load_task


def play(rollout: LocalRollout, task: Task, args: argparse.Namespace, *, keep: bool) -> tuple[list[list[int]], int]:
    """One batch of episodes, turn by turn: (every sample's tokens, prompt tokens read)."""
    params = SamplingParams(
        max_new_tokens=task.max_new_tokens,
        temperature=0.7,
        stop_token_ids=tuple(task.stop_token_ids),
    )
    episodes = [task.episode(g) for g in range(args.groups) for _ in range(args.group_size)]
    history = [ep.prompt() for ep in episodes]
    active, samples, turn = list(range(len(episodes))), [], 0
    read_before = rollout.prompt_tokens_read
    while active:
        if not keep:
            rollout.forget()
        gens = rollout.generate([history[i] for i in active], params, seed=1000 + turn)
        still = []
        for i, gen in zip(active, gens, strict=True):
            samples.append(history[i] + gen.tokens)
            nxt, _ = episodes[i].respond(list(gen.tokens))
            if nxt is not None:
                history[i] = history[i] + gen.tokens + list(nxt)
                still.append(i)
        active, turn = still, turn + 1
    rollout.forget()
    return samples, rollout.prompt_tokens_read - read_before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    source = ModelSource.resolve(args.model)
    model = build_model(source)
    task = load_task("builtin:arithmetic", {"turns": args.turns}, source.load_tokenizer)
    rollout = LocalRollout(model, torch.device("cpu"))
    print(f"{args.model}: {args.groups} groups x {args.group_size} samples, {args.turns} turns, local rollout")
    best: dict[str, float] = {}
    seen: dict[str, tuple[list[list[int]], int]] = {}
    for r in range(args.repeat + 1):  # round 0: burn-in
        for mode in ("reread", "kept"):
            t0 = time.perf_counter()
            seen[mode] = play(rollout, task, args, keep=mode == "kept")
            took = time.perf_counter() - t0
            print(f"  round {r}{' (burn-in)' if r == 0 else ''} {mode:>6}: {took:6.2f} s", flush=True)
            if r > 0:
                best[mode] = min(best.get(mode, took), took)
    same = seen["kept"][0] == seen["reread"][0]
    print(f"prompt tokens read: reread {seen['reread'][1]:,}, kept {seen['kept'][1]:,}")
    print(f"best wall time: reread {best['reread']:.2f} s, kept {best['kept']:.2f} s")
    print(f"speedup kept vs reread: {best['reread'] / best['kept']:.2f}x; same samples: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit("kept and reread sampled different tokens: the kept cache is wrong")


if __name__ == "__main__":
    main()
