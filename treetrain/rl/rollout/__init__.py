"""Rollout sources: ``local`` (the trainer's own model), ``sglang`` and ``vllm`` servers.

Every source takes token-id prompts and returns token ids plus the sampler's log-probs
(the *behaviour* log-probs decoupled PPO needs) and the weight version of every token. Remote
sources reload weights from disk (SGLang ``/update_weights_from_disk``; vLLM ``/collective_rpc``
of our worker extension, else vLLM's own ``reload_weights``; both need ``VLLM_SERVER_DEV_MODE=1``
on the server) or receive them by broadcast (treetrain.rl.weight_sync). One job may mix SGLang
and vLLM servers: :func:`remote_client` gives each endpoint a client of its own server's dialect.

Modules: ``base`` (the interface), ``gate`` (the weight gate), ``local``, ``http`` (transport,
retries, health), ``resubmit`` (requests that survive weight updates and failing servers),
``sglang`` and ``vllm`` (the dialects), ``remote`` (probing and mixing), ``adapters`` (LoRA
adapter sync: versioned names, the load/unload plan, the check that a server lists the new one).
"""

from treetrain.rl.rollout.adapters import AdapterSlots
from treetrain.rl.rollout.base import (
    KINDS,
    REMOTE_KINDS,
    UNKNOWN,
    Generation,
    RolloutClient,
    RolloutError,
    SamplingParams,
    Unknown,
)
from treetrain.rl.rollout.gate import WeightGate
from treetrain.rl.rollout.http import (
    API_KEY_ENV,
    BucketRequest,
    GroupRequest,
    HTTPHealth,
    HTTPRollout,
    Transport,
    auth_headers,
    check_weights_dir,
    http_json,
)
from treetrain.rl.rollout.local import LocalRollout
from treetrain.rl.rollout.remote import MixedRollout, detect_kind, probe_kind, remote_client, use_adapter
from treetrain.rl.rollout.resubmit import ServerUnavailable
from treetrain.rl.rollout.sglang import SGLangRollout
from treetrain.rl.rollout.vllm import VLLMRollout

__all__ = [
    "API_KEY_ENV",
    "KINDS",
    "REMOTE_KINDS",
    "UNKNOWN",
    "AdapterSlots",
    "BucketRequest",
    "Generation",
    "GroupRequest",
    "HTTPHealth",
    "HTTPRollout",
    "LocalRollout",
    "MixedRollout",
    "RolloutClient",
    "RolloutError",
    "SGLangRollout",
    "SamplingParams",
    "ServerUnavailable",
    "Transport",
    "Unknown",
    "VLLMRollout",
    "WeightGate",
    "auth_headers",
    "check_weights_dir",
    "detect_kind",
    "http_json",
    "probe_kind",
    "remote_client",
    "use_adapter",
]
