"""Stand-in SGLang and vLLM rollout servers on 127.0.0.1 (small fakes, NOT the real servers):
they answer with the request/response shapes those servers document (SGLang ``/generate``
with ``input_ids`` and ``meta_info.output_token_logprobs``; vLLM ``/v1/completions`` with
``token_ids`` and ``logprobs.token_logprobs``) and record every call, so tests can assert
the weight-sync sequence. Nothing here dials anything but loopback."""

from __future__ import annotations

import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from json_http import JSONHandler

from treetrain.rl.rollout import SamplingParams

PARAMS = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, stop_token_ids=(2,))


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    """The tokens a stand-in samples after ``prompt``: ``n`` of them, a pure function of its length."""
    return [8 + (len(prompt) + i) % 400 for i in range(n)]


class FakeServer:
    """A stand-in rollout server of one ``kind`` (sglang or vllm) on 127.0.0.1."""

    def __init__(self, kind: str, *, fail_first: int = 0, pause_routes: bool = True, extension: bool = True) -> None:
        self.kind = kind
        self.pause_routes = pause_routes
        self.extension = extension  # vLLM: started with our worker extension
        self.calls: list[tuple[str, str, Any]] = []
        self.fail_first = fail_first
        self.weight_version: Any = "default" if kind == "sglang" else None  # what a fresh server reports
        # abort_after=n: the next generation samples n tokens, then (wait_for_pause) waits for a
        # pause and answers finish_reason "abort" with them, as the real servers' mode "abort" does.
        self.abort_after: int | None = None
        self.wait_for_pause = True
        # Rewrites a generation's (tokens, log-probs) before it is sent: a server that answers wrongly.
        self.rewrite: Any = None
        # LoRA: the adapters loaded (name -> path), at most max_loras of them (a load past that is
        # refused, as SGLang's --max-loaded-loras does); silent_loads: a load answers success but
        # lists nothing (the silent no-op sync); refuse_loads: every load answers an error.
        self.adapters: dict[str, str] = {}
        self.max_loras = 0
        self.most_adapters = 0  # the most adapters it ever held at once
        self.silent_loads = False
        self.refuse_loads = False
        self.generating = threading.Event()  # a generation to be aborted has its tokens
        self.paused = threading.Event()
        fake = self

        class Handler(JSONHandler):
            def do_GET(self) -> None:
                fake.calls.append(("GET", self.path, None))
                status, body = fake.get(self.path)
                self._reply(status, body)

            def do_POST(self) -> None:
                body = self._body()
                fake.calls.append(("POST", self.path, body))
                status, out = fake.post(self.path, body)
                self._reply(status, out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def paths(self, method: str = "POST") -> list[str]:
        return [p for m, p, _ in self.calls if m == method]

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/health":
            return 200, {}
        if self.kind == "sglang" and path == "/model_info":
            return 200, {"model_path": "/models/x", "weight_version": self.weight_version}
        if path == "/v1/models":  # both serve it (SGLang has OpenAI routes too); adapters name a parent
            return 200, {
                "data": [{"id": "m"}] + [{"id": n, "root": p, "parent": "m"} for n, p in self.adapters.items()]
            }
        return 404, {"detail": "Not Found"}

    def lora(self, path: str, body: Any) -> tuple[int, Any]:
        """Both servers' LoRA routes: vLLM's under /v1 answer text or an error object, SGLang's
        ``{success, error_message}``."""
        if (self.kind == "vllm") != path.startswith("/v1/"):
            return 404, {"detail": "Not Found"}
        name = body["lora_name"]

        def refuse(status: int, why: str) -> tuple[int, Any]:
            if self.kind == "sglang":
                return 400, {"success": False, "error_message": why}
            return status, {"error": {"message": why, "code": status}}

        if path.endswith("/unload_lora_adapter"):
            if self.adapters.pop(name, None) is None:
                return refuse(404, f"The lora adapter '{name}' cannot be found.")
        elif self.refuse_loads:
            return refuse(500, f"Loading lora {name} failed: rank too large")
        elif name in self.adapters:
            return refuse(400, f"The lora adapter '{name}' has already been loaded.")
        elif len(self.adapters) >= self.max_loras:
            return refuse(400, f"{self.max_loras} adapters loaded already")
        elif not self.silent_loads:
            self.adapters[name] = body["lora_path"]
            self.most_adapters = max(self.most_adapters, len(self.adapters))
        return 200, ({"success": True} if self.kind == "sglang" else f"Success: LoRA adapter '{name}'")

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        if not self.pause_routes and path.startswith(("/pause", "/resume", "/continue_generation")):
            return 404, {"detail": "Not Found"}
        if self.fail_first > 0 and path in ("/generate", "/v1/completions"):
            self.fail_first -= 1
            return 503, {"error": "warming up"}
        if path.startswith(("/pause_generation", "/pause?")):
            self.paused.set()
        if path.removeprefix("/v1") in ("/load_lora_adapter", "/unload_lora_adapter"):
            return self.lora(path, body)
        reason = "length"
        if path in ("/generate", "/v1/completions") and self.abort_after is not None:
            cut, self.abort_after = self.abort_after, None
            self.generating.set()
            if self.wait_for_pause:
                assert self.paused.wait(30), "no pause came"
            reason = "abort"
        if self.kind == "sglang":
            if path == "/generate":
                if not isinstance(body.get("input_ids"), list):
                    return 400, {"error": "input_ids required"}
                n = body["sampling_params"]["max_new_tokens"] if reason != "abort" else cut
                toks = fake_tokens(body["input_ids"], n)
                lps = [-0.5] * n
                if self.rewrite is not None:
                    toks, lps = self.rewrite(toks, lps)
                return 200, {
                    "text": "",
                    "output_ids": toks,
                    "meta_info": {
                        "id": "r",
                        "finish_reason": {"type": reason, "length": n},
                        "prompt_tokens": len(body["input_ids"]),
                        "completion_tokens": n,
                        "output_token_logprobs": [[lp, t, None] for t, lp in zip(toks, lps, strict=False)],
                    },
                }
            if path in ("/pause_generation", "/continue_generation", "/flush_cache"):
                return 200, {}
            if path == "/update_weights_from_disk":
                ok = Path(body["model_path"]).is_dir()
                if ok:
                    self.weight_version = body["weight_version"]
                return (200 if ok else 400), {"success": ok, "message": "", "num_paused_requests": 0}
        if self.kind == "vllm":
            if path == "/v1/completions":
                n = body["max_tokens"] if reason != "abort" else cut
                toks = fake_tokens(body["prompt"], n)
                lps = [-0.25] * n
                if self.rewrite is not None:
                    toks, lps = self.rewrite(toks, lps)
                logprobs = {"tokens": [f"token_id:{t}" for t in toks], "token_logprobs": lps}
                return 200, {
                    "choices": [
                        {
                            "index": 0,
                            "text": "",
                            "token_ids": toks,
                            "finish_reason": reason,
                            "logprobs": logprobs if n else None,  # vLLM sends none for an abort before any token
                        }
                    ]
                }
            if path.startswith(("/pause", "/resume", "/reset_prefix_cache")):
                return 200, {}
            if path == "/collective_rpc":
                if body["method"] != "reload_weights" and not self.extension:  # as vLLM answers it
                    return 500, {"error": f"AttributeError: no attribute {body['method']!r}"}
                if body["method"] == "load_weights_from_disk":
                    self.weight_version = body["kwargs"]["version"]
                if body["method"] == "loaded_weight_version":
                    v = self.weight_version  # vLLM's route answers results as strings, None as null
                    return 200, {"results": [None if v is None else str(v)]}
                return 200, {"results": [None]}
        return 404, {"detail": "Not Found"}
