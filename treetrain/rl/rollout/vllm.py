"""vLLM's dialect: ``/v1/completions`` with token ids, and weight loads through our worker
extension's ``/collective_rpc`` methods (treetrain.rl.vllm_worker)."""

from __future__ import annotations

from typing import Any

from treetrain.rl.rollout.base import UNKNOWN, Generation, RolloutError, SamplingParams, Unknown, checked
from treetrain.rl.rollout.http import BucketRequest, GroupRequest, HTTPRollout, check_weights_dir


class VLLMRollout(HTTPRollout):
    """vLLM's OpenAI-compatible ``POST /v1/completions`` with token-id prompts and log-probs."""

    kind = "vllm"

    def __init__(self, *, model: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model

    def _generate_one(
        self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int, version: int = 0
    ) -> Generation:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": seed,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stop_token_ids": list(params.stop_token_ids),
        }
        adapter = self.adapter.model_for(version) if self.adapter is not None else None
        if adapter or self.model:
            body["model"] = adapter or self.model  # an adapter is served under its own name
        out = self.call(endpoint, "POST", "/v1/completions", body)
        try:
            choice = out["choices"][0]
            reason = choice.get("finish_reason") or "length"
            # A pause (mode "abort") ends the request with the tokens sampled so far, maybe none
            # (then vLLM sends no log-probs at all).
            lp = (
                (choice["logprobs"] or {"token_logprobs": [], "tokens": []})
                if reason == "abort"
                else choice["logprobs"]
            )
            logprobs = [float(x) for x in lp["token_logprobs"]]
            if choice.get("token_ids") is not None:
                tokens = [int(t) for t in choice["token_ids"]]
            else:  # "token_id:123" strings from return_tokens_as_token_ids
                tokens = [int(str(t).rsplit(":", 1)[1]) for t in lp["tokens"]]
            if len(tokens) != len(logprobs):
                raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} log-probs")
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise RolloutError(
                f"unexpected /v1/completions answer from {endpoint}: {err!r} in {str(out)[:300]}"
            ) from None
        return checked(Generation(tokens=tokens, logprobs=logprobs, finish_reason=reason), endpoint, self.vocab_size)

    def update_weights(self, path: str, version: int) -> None:
        # vLLM has no disk-reload route; its dev-mode collective_rpc calls a method of the workers.
        # A path it cannot load answers 500 and leaves the server broken: check it first.
        check_weights_dir(path)

        def one(ep: str) -> None:
            # /pause and /resume came after /collective_rpc: without them the reload runs unpaused.
            paused = self.optional(ep, "POST", "/pause?mode=abort", None)
            try:
                # Our worker extension loads the directory as it loads a broadcast, exactly, and
                # records the version (restarts show); vLLM's own reload_weights leaves a tied
                # lm_head stale on CPU (see vllm_worker.with_tied).
                if self._try_rpc(ep, "loaded_weight_version", {})[0]:
                    body = {"method": "load_weights_from_disk", "kwargs": {"weights_path": path, "version": version}}
                else:
                    body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
                self.call(ep, "POST", "/collective_rpc", body)
                # Cached prefixes hold keys and values of the old weights (the real server served them).
                self.call(ep, "POST", "/reset_prefix_cache", None)
            finally:
                if paused:
                    self.call(ep, "POST", "/resume", None)

        self._each(one)

    def load_adapter(self, endpoint: str, name: str, path: str) -> None:
        # Needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the server (404 without it) and --enable-lora.
        self.call(endpoint, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_adapter(self, endpoint: str, name: str) -> None:
        # vLLM drops the name at once; its workers evict the weights when the slot is needed.
        self.call(endpoint, "POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def pause(self, endpoint: str) -> bool:
        return self.optional(endpoint, "POST", "/pause?mode=abort", None)

    def resume(self, endpoint: str) -> None:
        # Cached prefixes hold keys and values of the old weights: drop them before sampling again.
        self.call(endpoint, "POST", "/reset_prefix_cache", None)
        self.call(endpoint, "POST", "/resume", None)

    def loaded_version(self, endpoint: str) -> int | Unknown | None:
        ok, res = self._try_rpc(endpoint, "loaded_weight_version", {})
        if not ok or not isinstance(res, dict) or not res.get("results"):
            return UNKNOWN  # no worker extension: the server cannot say
        # vLLM answers every result but None, lists and dicts as a string: "3".
        versions = {int(v) if str(v).isdigit() else None for v in res["results"]}
        return versions.pop() if len(versions) == 1 else None  # workers that disagree: send them all again

    def _try_rpc(self, endpoint: str, method: str, kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """One ``/collective_rpc`` without retries: (False, None) when it fails (no such method)."""
        try:
            status, res = self.transport(
                "POST", endpoint + "/collective_rpc", {"method": method, "kwargs": kwargs}, 30.0
            )
        except OSError:
            return False, None
        return status == 200, res

    def _rpc(self, endpoint: str, method: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """One method of our worker extension on every worker of the server (``/collective_rpc``)."""
        body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
        return self.call(endpoint, "POST", "/collective_rpc", body)

    def join_group(self, endpoint: str, group: GroupRequest, rank_offset: int) -> None:
        kwargs = {
            "address": group.address,
            "port": group.port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend,
            "timeout_s": group.timeout_s,
        }
        self._rpc(endpoint, "join_weight_group", kwargs, group.timeout_s)

    def leave_group(self, endpoint: str, group: GroupRequest) -> None:
        self._rpc(endpoint, "leave_weight_group", {}, group.timeout_s)

    def receive_bucket(self, endpoint: str, bucket: BucketRequest) -> None:
        kwargs = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "version": bucket.version,
            "first": bucket.first,
            "last": bucket.last,
        }
        self._rpc(endpoint, "receive_weights", kwargs, bucket.group.timeout_s)
