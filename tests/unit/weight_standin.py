"""A stand-in rollout server that REALLY joins the weight-update group (run as its own process).

It is NOT SGLang or vLLM: a small HTTP server on 127.0.0.1 that answers the weight-sync routes
of one dialect and receives the broadcast with gloo, as the real servers do:

- ``sglang``: ``/init_weights_update_group`` joins with :func:`treetrain.rl.weight_group.join`
  (what SGLang's ``init_custom_process_group`` does), ``/update_weights_from_distributed`` with
  ``load_format: flattened_bucket`` receives one flat bucket;
- ``vllm``: ``/collective_rpc`` calls the methods of our worker extension
  (:class:`treetrain.rl.vllm_worker.WeightSyncExtension`) on a fake worker whose model records
  what ``load_weights`` is given.

Every received tensor is saved (``OUT/weights-vN.pt``, all buckets of version N) so the test can
compare them bit for bit; every request is appended to ``OUT/calls.jsonl``. ``--no-join``
fails the join request with a 500 (a server that cannot reach the trainer).

    python weight_standin.py KIND OUT [--no-join] [--port N]     # prints "port N" once it listens

A restarted stand-in (the same ``--port``) holds no weights and reports no weight version, as a
restarted server does.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from json_http import JSONHandler

from treetrain.rl import weight_group as wg
from treetrain.rl.vllm_worker import WeightSyncExtension


class _Model:
    def __init__(self, sink: dict[str, torch.Tensor]) -> None:
        self.sink = sink

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.sink[name] = t.clone()


class _Runner:
    def __init__(self, sink: dict[str, torch.Tensor]) -> None:
        self.model = _Model(sink)


class FakeWorker(WeightSyncExtension):
    rank = 0
    device = "cpu"

    def __init__(self, sink: dict[str, torch.Tensor]) -> None:
        self.model_runner = _Runner(sink)


def main(kind: str, out: Path, join: bool, port: int) -> None:
    received: dict[str, torch.Tensor] = {}
    worker = FakeWorker(received)
    state: dict[str, Any] = {"group": None, "version": None}
    lock = threading.Lock()

    def save(version: Any) -> None:
        torch.save(dict(received), out / f"weights-v{version}.pt")

    def post(path: str, body: Any) -> tuple[int, Any]:
        if path in ("/generate", "/v1/completions"):  # a fixed reply: rollouts here only feed the sync
            n = body["sampling_params"]["max_new_tokens"] if kind == "sglang" else body["max_tokens"]
            toks = [3 + i % 5 for i in range(n)]
            if kind == "sglang":
                meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in toks]}
                return 200, {"output_ids": toks, "meta_info": meta}
            logprobs = {"token_logprobs": [-0.5] * n, "tokens": [f"token_id:{t}" for t in toks]}
            return 200, {"choices": [{"token_ids": toks, "finish_reason": "length", "logprobs": logprobs}]}
        if path in ("/pause_generation", "/continue_generation", "/resume", "/reset_prefix_cache") or path.startswith(
            "/pause"
        ):
            return 200, {}
        if not join and (path == "/init_weights_update_group" or (body or {}).get("method") == "join_weight_group"):
            # As a server that cannot reach the trainer's address answers, after its own dial failed.
            raise ConnectionError(f"cannot reach {body.get('master_address') or body['kwargs']['address']}")
        if kind == "sglang" and path == "/init_weights_update_group":
            if join:
                state["group"] = wg.join(
                    address=body["master_address"],
                    port=body["master_port"],
                    rank=body["rank_offset"],
                    world_size=body["world_size"],
                    group_name=body["group_name"],
                    backend=body["backend"],
                    timeout_s=60,
                )
            return 200, {"success": True, "message": ""}
        if kind == "sglang" and path == "/update_weights_from_distributed":
            assert body["load_format"] == "flattened_bucket"
            specs = [
                wg.TensorSpec(n, d, tuple(s))
                for n, d, s in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
            ]
            for name, t in wg.receive(state["group"], specs, "cpu"):
                received[name] = t.clone()
            if body["flush_cache"]:
                save(body["weight_version"])
                state["version"] = body["weight_version"]
            return 200, {"success": True, "message": ""}
        if kind == "sglang" and path == "/destroy_weights_update_group":
            wg.leave(state["group"])
            return 200, {"success": True, "message": ""}
        if kind == "vllm" and path == "/collective_rpc":
            method, kwargs = body["method"], body.get("kwargs") or {}
            result = getattr(worker, method)(**kwargs)
            if method == "receive_weights":
                save(kwargs["version"])  # the last bucket's save holds them all
            # As vLLM's route answers: every result but None, lists and dicts as a string.
            return 200, {"results": [result if result is None or isinstance(result, dict | list) else str(result)]}
        return 404, {"detail": "Not Found"}

    class Handler(JSONHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" or (kind == "sglang" and self.path == "/model_info")
            self._reply(200 if ok else 404, {"weight_version": state["version"] or "default"})

        def do_POST(self) -> None:
            body = self._body()
            with lock, (out / "calls.jsonl").open("a") as f:
                f.write(json.dumps({"path": self.path, "body": body}) + "\n")
            try:
                status, reply = post(self.path, body)
            except Exception as err:  # a broken group or bucket: a 500, as a real server answers
                status, reply = 500, {"error": f"{type(err).__name__}: {err}"}
            self._reply(status, reply)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"port {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    port = int(sys.argv[sys.argv.index("--port") + 1]) if "--port" in sys.argv else 0
    main(sys.argv[1], Path(sys.argv[2]), "--no-join" not in sys.argv, port)
