"""`python3 -m sglang.launch_server ...` in the rollout stand-in image: bench/rollout_standin.py
on --host/--port, SGLang's other flags read and ignored (no model is loaded). It is NOT SGLang.

Its own flags (an RLJob's spec.rollout.serverArgs): --standin-token-delay SECONDS per generated
token (default 0.005), --standin-vocab (default 512, builtin:tiny-llama's), --standin-first-token (0).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from rollout_standin import RolloutStandin


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sglang.launch_server (rollout stand-in)")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--standin-token-delay", type=float, default=0.005)
    parser.add_argument("--standin-vocab", type=int, default=512)
    parser.add_argument("--standin-first-token", type=int, default=0)
    args, ignored = parser.parse_known_args(argv)
    standin = RolloutStandin(
        token_delay_s=args.standin_token_delay,
        vocab=args.standin_vocab,
        first_token=args.standin_first_token,
        host=args.host,
        port=args.port,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(
        f"rollout stand-in (SGLang dialect, NOT SGLang) for {args.model_path} on {args.host}:{args.port}; "
        f"ignored flags: {' '.join(ignored) or 'none'}",
        flush=True,
    )
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        standin.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
