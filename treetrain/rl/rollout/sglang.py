"""SGLang's dialect: ``/generate`` with token ids, disk reloads and the distributed-sync routes."""

from __future__ import annotations

from typing import Any

from treetrain.rl.rollout.base import UNKNOWN, Generation, RolloutError, SamplingParams, Unknown, checked
from treetrain.rl.rollout.http import BucketRequest, GroupRequest, HTTPRollout


class SGLangRollout(HTTPRollout):
    """SGLang's native API: ``POST /generate`` with ``input_ids`` and ``return_logprob``."""

    kind = "sglang"

    def _generate_one(
        self, endpoint: str, prompt: list[int], params: SamplingParams, seed: int, version: int = 0
    ) -> Generation:
        body: dict[str, Any] = {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "stop_token_ids": list(params.stop_token_ids),
                "sampling_seed": seed,
            },
            "return_logprob": True,
            "logprob_start_len": len(prompt),  # log-probs of the output tokens only
            "stream": False,
        }
        adapter = self.adapter.model_for(version) if self.adapter is not None else None
        if adapter:
            body["lora_path"] = adapter  # the name a /load_lora_adapter gave it
        out = self.call(endpoint, "POST", "/generate", body)
        try:
            meta = out["meta_info"]
            finish = meta.get("finish_reason") or {}
            reason = finish.get("type", "length") if isinstance(finish, dict) else str(finish)
            # A pause (mode "abort") ends the request with the tokens sampled so far, maybe none.
            triples = (meta.get("output_token_logprobs") or []) if reason == "abort" else meta["output_token_logprobs"]
            tokens = [int(t[1]) for t in triples]  # [logprob, token_id, text-or-null]
            logprobs = [float(t[0]) for t in triples]
            ids = out.get("output_ids")
            if isinstance(ids, list) and len(ids) != len(tokens):  # a log-prob missing: never train a cut sample
                raise ValueError(f"{len(ids)} output_ids but {len(tokens)} token log-probs")
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as err:
            raise RolloutError(f"unexpected /generate answer from {endpoint}: {err!r} in {str(out)[:300]}") from None
        return checked(Generation(tokens=tokens, logprobs=logprobs, finish_reason=reason), endpoint, self.vocab_size)

    def update_weights(self, path: str, version: int) -> None:
        # Pause (aborting in-flight requests, which the client resubmits), load from disk, continue.
        def one(ep: str) -> None:
            # Older servers have no pause route: their weight update then waits for in-flight requests.
            paused = self.optional(ep, "POST", "/pause_generation", {"mode": "abort"})
            try:
                res = self.call(
                    ep,
                    "POST",
                    "/update_weights_from_disk",
                    {"model_path": path, "abort_all_requests": True, "weight_version": str(version)},
                )
                if isinstance(res, dict) and res.get("success") is False:
                    raise RolloutError(f"{ep} could not load weights from {path}: {res.get('message')}")
            finally:
                if paused:
                    self.call(ep, "POST", "/continue_generation", {})

        self._each(one)

    def loaded_version(self, endpoint: str) -> int | Unknown | None:
        # Both weight updates set it (weight_version); a server starts with "default".
        try:
            info = self.call(endpoint, "GET", "/model_info")
        except RolloutError:
            return UNKNOWN
        version = info.get("weight_version", UNKNOWN) if isinstance(info, dict) else UNKNOWN
        if version is UNKNOWN:
            return UNKNOWN
        return int(version) if str(version).isdigit() else None

    def load_adapter(self, endpoint: str, name: str, path: str) -> None:
        res = self.call(endpoint, "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        self._rpc_ok(endpoint, f"load adapter {name} from {path}", _lora_answer(res))

    def unload_adapter(self, endpoint: str, name: str) -> None:
        res = self.call(endpoint, "POST", "/unload_lora_adapter", {"lora_name": name})
        self._rpc_ok(endpoint, f"unload adapter {name}", _lora_answer(res))

    def pause(self, endpoint: str) -> bool:
        return self.optional(endpoint, "POST", "/pause_generation", {"mode": "abort"})

    def resume(self, endpoint: str) -> None:
        self.call(endpoint, "POST", "/continue_generation", {})

    def join_group(self, endpoint: str, group: GroupRequest, rank_offset: int) -> None:
        body = {
            "master_address": group.address,
            "master_port": group.port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.name,
            "backend": group.backend,
        }
        self._rpc_ok(
            endpoint, "join the weight-update group", self.call(endpoint, "POST", "/init_weights_update_group", body)
        )

    def leave_group(self, endpoint: str, group: GroupRequest) -> None:
        self.call(endpoint, "POST", "/destroy_weights_update_group", {"group_name": group.name})

    def receive_bucket(self, endpoint: str, bucket: BucketRequest) -> None:
        body = {
            "names": bucket.names,
            "dtypes": bucket.dtypes,
            "shapes": bucket.shapes,
            "group_name": bucket.group.name,
            "load_format": "flattened_bucket",  # one flat uint8 tensor per bucket (weight_group.pack)
            "flush_cache": bucket.last,
            "weight_version": str(bucket.version),
        }
        res = self.call(endpoint, "POST", "/update_weights_from_distributed", body)
        self._rpc_ok(endpoint, f"load weights version {bucket.version}", res)


def _lora_answer(res: Any) -> Any:
    """SGLang's LoRA answers say ``error_message`` where its other routes say ``message``."""
    if isinstance(res, dict) and res.get("success") is False and "message" not in res:
        return {**res, "message": res.get("error_message")}
    return res
