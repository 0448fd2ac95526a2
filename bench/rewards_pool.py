"""What running rewards in worker processes costs: a reward call through ``RewardRunner`` (its
pool of worker processes, treetrain.rl.rewards_pool) against the same function called in the
trainer's process, and what a timeout costs the calls after it.

    python bench/rewards_pool.py [--calls 500] [--repeat 3]

Per reward (``builtin:exact``, ``builtin:math`` on GSM8K-shaped replies, a user reward that
returns at once), times ``--calls`` scores in a row, best of ``--repeat`` after a burn-in, and
prints microseconds per call in the process and through the pool, and the difference: the
overhead per call (pickling the reply and row, two socket messages, the worker's wake-up). Then:
the worker server's start (a fresh interpreter importing math-verify and sympy), and the first
call after a timeout (the stuck worker killed, a fresh one forked and its reward imported).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from treetrain.rl.rewards import RewardRunner, load_reward
from treetrain.rl.rewards_pool import RewardPool

USER = """
def instant(completion, row):
    return 1.0

def stuck(completion, row):
    if completion == "stuck":
        return float(9 ** 9 ** 9 % 7)
    return 1.0
"""


def rows(n: int) -> list[tuple[str, dict[str, Any]]]:
    reply = "Natalia sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 clips in all.\n#### {}"
    return [
        (reply.format(72 + i % 3), {"question": "How many clips?", "answer": f"#### {72 + i % 5}"}) for i in range(n)
    ]


def best(fn: Callable[[], None], repeat: int) -> float:
    fn()  # burn-in: imports, caches, the worker forked
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    calls = rows(args.calls)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "bench_user_reward.py").write_text(USER)
        sys.path.insert(0, tmp)
        began = time.perf_counter()
        pool = RewardPool(max_workers=1)
        warm = RewardRunner(load_reward("builtin:exact", {}), timeout_s=60, answer_field="answer", log=print, pool=pool)
        warm.score("1", {"answer": "1"}, "start")
        print(f"worker server start + first call: {1000 * (time.perf_counter() - began):.0f} ms")
        print(f"{'reward':<26} {'in process':>12} {'pool':>12} {'overhead':>12}  (per call, best of {args.repeat})")
        for spec in ("builtin:exact", "builtin:math", "bench_user_reward:instant"):
            fn = load_reward(spec, {})
            run = RewardRunner(fn, timeout_s=60, answer_field="answer", log=print, pool=pool)
            local = best(lambda fn=fn: [fn(c, r) for c, r in calls] and None, args.repeat) / len(calls)
            pooled = best(lambda run=run: [run.score(c, r, "bench") for c, r in calls] and None, args.repeat) / len(
                calls
            )
            print(f"{spec:<26} {local * 1e6:>10.0f}us {pooled * 1e6:>10.0f}us {(pooled - local) * 1e6:>10.0f}us")
        stuck = RewardRunner(
            load_reward("bench_user_reward:stuck", {}), timeout_s=1, answer_field="answer", log=len, pool=pool
        )
        stuck.score("fine", {}, "warm")
        began = time.perf_counter()
        stuck.score("stuck", {}, "bench")
        timed_out = time.perf_counter() - began
        began = time.perf_counter()
        stuck.score("fine", {}, "bench")
        after = time.perf_counter() - began
        print(
            f"a call stuck in C with a 1 s timeout: {timed_out:.3f} s; the next call (a fresh worker): {1000 * after:.0f} ms"
        )
        pool.close()


if __name__ == "__main__":
    main()
