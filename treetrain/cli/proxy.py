"""``treetrain proxy --model MODEL``: the OpenAI-compatible endpoint with RL sessions, standalone.

Samples with the model itself (local rollout, on a GPU when there is one) or, with
``--rollout URL``, with SGLang/vLLM servers. Agents point an OpenAI client at it
(docs/agents.md); the trainer runs the same server in-process. Alone, it writes one line per
request on stderr; ``GET /metrics`` serves its counters.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

EXAMPLES = """\
examples:
  treetrain proxy --model builtin:smollm2-135m                 # local sampling, port 8000
  treetrain proxy --model /models/qwen3 --rollout http://vllm:8000 --port 9000
  curl -s -X POST localhost:8000/rl/sessions -d '{}'            # {"id": "sess-...", "api_key": "sk-sess-..."}
  curl -s localhost:8000/metrics                                # Prometheus text: requests, tokens, durations
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "proxy",
        help="serve an OpenAI-compatible endpoint that records RL sessions",
        description="Serve /v1/chat/completions, /v1/responses and /v1/completions with RL sessions until "
        "SIGINT/SIGTERM; one log line per request on stderr, Prometheus metrics at /metrics. Exit 2 for bad arguments.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, metavar="MODEL", help="builtin:NAME or a Hugging Face model directory")
    p.add_argument(
        "--rollout",
        action="append",
        default=[],
        metavar="URL",
        help="an SGLang/vLLM server (repeatable; default: local)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    p.add_argument("--max-sessions", type=int, default=1024, metavar="N", help="open sessions at most (default 1024)")
    p.add_argument(
        "--max-sessions-per-client",
        type=int,
        default=256,
        metavar="N",
        help="open sessions one peer address may hold (default 256)",
    )
    p.add_argument("--max-tokens", type=int, default=512, metavar="N", help="largest reply length (default 512)")
    p.add_argument(
        "--max-session-tokens",
        type=int,
        default=32768,
        metavar="N",
        help="tokens a session may use, the prompts and replies of all its calls (default 32768)",
    )
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"treetrain proxy: error: {message}", file=sys.stderr)
    return 2


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be 0..65535, got {args.port}")
    for flag in ("max_sessions", "max_sessions_per_client", "max_tokens", "max_session_tokens"):
        if getattr(args, flag) < 1:
            return _fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_tokens >= args.max_session_tokens:
        return _fail(
            f"--max-tokens {args.max_tokens} leaves no room for a prompt in --max-session-tokens "
            f"{args.max_session_tokens}: lower it or raise --max-session-tokens"
        )
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as treetrain train: idle OpenMP threads must not spin
    try:
        from treetrain.engines import EngineConfigError, builtin
        from treetrain.proxy.chat import ChatRenderer
        from treetrain.proxy.sampler import LOCAL_BATCH_TOKENS
        from treetrain.proxy.server import ProxyServer, RLService
        from treetrain.proxy.sessions import ProxyLimits
        from treetrain.rl.rollout import RolloutError
    except ImportError as err:
        return _fail(f"{err}; install the training stack: pip install 'treetrain[train]'")
    try:
        builtin.check_path(args.model)
        builtin.local_dir(args.model, _say)
        tokenizer = builtin.load_tokenizer(args.model)
        if tokenizer is None:
            return _fail(f"{args.model} has no tokenizer; use a model with a chat template (builtin:smollm2-135m)")
        generate = _remote(args.rollout) if args.rollout else _local(args.model)
    except (EngineConfigError, RolloutError, FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    limits = ProxyLimits(
        max_sessions=args.max_sessions,
        max_sessions_per_client=args.max_sessions_per_client,
        max_tokens=args.max_tokens,
        max_session_tokens=args.max_session_tokens,
        max_batch_tokens=None if args.rollout else LOCAL_BATCH_TOKENS,
    )
    service = RLService(generate=generate, renderer=ChatRenderer(tokenizer), model_name=args.model, limits=limits)
    server = ProxyServer(service, request_log=_say)
    try:
        port = server.start(args.host, args.port)
    except OSError as err:
        return _fail(f"cannot serve on {args.host}:{args.port}: {err.strerror or err}")
    print(f"treetrain proxy: serving {args.model} at http://{args.host}:{port}/v1", flush=True)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.close()
    return 0


def _local(model: str) -> Any:
    """Local rollout of ``model`` (the FSDP engine's loader), on the GPU when there is one."""
    import torch
    from transformers.utils import logging as hf_logging

    from treetrain.config import ModelSettings
    from treetrain.engines.hf_model import build_model
    from treetrain.rl.rollout import LocalRollout

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # our own two lines say what loads; the bar is noise on stderr
    _say(f"model: loading {model}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rollout = LocalRollout(build_model(ModelSettings(path=model)).to(device), device)
    _say(f"model: loaded on {device}")
    return lambda prompts, params, seed: rollout.generate(prompts, params, seed=seed)


def _remote(urls: list[str]) -> Any:
    from treetrain.rl.rollout import remote_client

    client = remote_client([(u, "auto") for u in urls], ready_timeout_s=600.0)
    _say(f"rollout: {client.kind} at {', '.join(urls)}")
    return lambda prompts, params, seed: client.generate(prompts, params, seed=seed)
