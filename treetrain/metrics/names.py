"""The trainer's metric names, as docs/contracts.md fixes them, and their label values.

Dashboards (charts/, dashboards/) are built on exactly these names: change one here and there at
once.
"""

from __future__ import annotations

TREE_TOKEN_RATIO = "treetrain_tree_token_ratio"
TOKENS_TOTAL = "treetrain_tokens_total"
STEP_DURATION_SECONDS = "treetrain_step_duration_seconds"
TRAIN_TOKENS_PER_SECOND = "treetrain_train_tokens_per_second"
STEP_TOKENS_PER_SECOND = "treetrain_step_tokens_per_second"
STEPS_TOTAL = "treetrain_steps_total"
ROLLOUT_LOGPROB_MISMATCH = "treetrain_rollout_logprob_mismatch"
LOSS = "treetrain_loss"
REWARD = "treetrain_reward"
EPISODES_CAPPED_TOTAL = "treetrain_episodes_capped_total"
# Asynchronous rollout (exported by every run, synchronous ones too, so every panel has data).
ROLLOUT_STALENESS = "treetrain_rollout_staleness"
ROLLOUT_BUFFER_GROUPS = "treetrain_rollout_buffer_groups"
ROLLOUT_IDLE_SECONDS_TOTAL = "treetrain_rollout_idle_seconds_total"
TRAINER_IDLE_SECONDS_TOTAL = "treetrain_trainer_idle_seconds_total"
ROLLOUT_GROUPS_DROPPED_TOTAL = "treetrain_rollout_groups_dropped_total"
ROLLOUT_RESUBMITTED_TOTAL = "treetrain_rollout_resubmitted_total"
WEIGHT_VERSION = "treetrain_weight_version"
# Weight sync (remote rollout): the last sync's wall time and bytes per server, by what it sent,
# and with LoRA adapter sync the adapter version every server listed.
WEIGHT_SYNC_SECONDS = "treetrain_weight_sync_seconds"
WEIGHT_SYNC_BYTES = "treetrain_weight_sync_bytes"
ADAPTER_VERSION = "treetrain_adapter_version"
# Agents and datasets: rank 0's OpenAI-compatible proxy, the reward function, evaluation.
PROXY_REQUESTS_TOTAL = "treetrain_proxy_requests_total"
PROXY_SESSIONS_OPEN = "treetrain_proxy_sessions_open"
PROXY_FRESH_RENDERS_TOTAL = "treetrain_proxy_fresh_renders_total"
# Served by the proxy's own GET /metrics only (`treetrain proxy`), not by the trainer's registry.
PROXY_PROMPT_TOKENS_TOTAL = "treetrain_proxy_prompt_tokens_total"
PROXY_COMPLETION_TOKENS_TOTAL = "treetrain_proxy_completion_tokens_total"
PROXY_REQUEST_DURATION_SECONDS = "treetrain_proxy_request_duration_seconds"
REWARD_FAILURES_TOTAL = "treetrain_reward_failures_total"
EVAL_REWARD = "treetrain_eval_reward"
# What an RL user watches per step: the policy, the update, the replies, the groups' signal.
POLICY_ENTROPY = "treetrain_policy_entropy"
KL = "treetrain_kl"
CLIP_FRACTION = "treetrain_clip_fraction"
IMPORTANCE_RATIO = "treetrain_importance_ratio"
GRAD_NORM = "treetrain_grad_norm"
RESPONSE_LENGTH_TOKENS = "treetrain_response_length_tokens"
ZERO_SIGNAL_GROUPS_TOTAL = "treetrain_zero_signal_groups_total"

# Label values of TOKENS_TOTAL{kind=...}: savings over a window are 1 - rate(tree) / rate(original).
TOKEN_KINDS = ("original", "tree", "padded")
# Label values of EPISODES_CAPPED_TOTAL{reason=...}: trainer.maxTurns, trainer.maxEpisodeTokens.
CAP_REASONS = ("turns", "tokens")
# Label values of ROLLOUT_GROUPS_DROPPED_TOTAL{reason=...}: dynamic sampling (all rewards equal),
# or a generation that failed on every server.
DROP_REASONS = ("filtered", "failed")
# Label values of PROXY_FRESH_RENDERS_TOTAL{reason=...}: why a chat request was rendered afresh
# instead of extending an earlier completion's tokens (treetrain.proxy.chat counts them).
FRESH_REASONS = ("edited", "template")
# Label values of WEIGHT_SYNC_SECONDS/BYTES{payload=...}: the LoRA adapter alone, or full weights
# (the merged adapter's included).
SYNC_PAYLOADS = ("adapter", "full")
# Label values of REWARD_FAILURES_TOTAL{reason=...}: the reward function raised, or ran too long.
REWARD_FAILURE_REASONS = ("error", "timeout")
# Replies range from a few tokens (tiny test tasks) to tens of thousands (long reasoning).
RESPONSE_LENGTH_BUCKETS = tuple(float(2**k) for k in range(2, 16))  # 4 ... 32768
# Staleness of a trained sample, in steps: 0 in synchronous runs, at most maxStaleness otherwise.
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 8.0, 16.0)
# Step times range from well under a second (tiny CPU runs) to minutes (large models).
STEP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
DEFAULT_PORT = 9400

# Every metric name a scrape shows (counters get ``_total`` and ``_created``, histograms their series).
NAMES = (
    TREE_TOKEN_RATIO,
    TOKENS_TOTAL,
    STEP_DURATION_SECONDS,
    TRAIN_TOKENS_PER_SECOND,
    STEP_TOKENS_PER_SECOND,
    ROLLOUT_LOGPROB_MISMATCH,
    STEPS_TOTAL,
    LOSS,
    REWARD,
    EPISODES_CAPPED_TOTAL,
    ROLLOUT_STALENESS,
    ROLLOUT_BUFFER_GROUPS,
    ROLLOUT_IDLE_SECONDS_TOTAL,
    TRAINER_IDLE_SECONDS_TOTAL,
    ROLLOUT_GROUPS_DROPPED_TOTAL,
    ROLLOUT_RESUBMITTED_TOTAL,
    WEIGHT_VERSION,
    WEIGHT_SYNC_SECONDS,
    WEIGHT_SYNC_BYTES,
    ADAPTER_VERSION,
    PROXY_REQUESTS_TOTAL,
    PROXY_SESSIONS_OPEN,
    PROXY_FRESH_RENDERS_TOTAL,
    REWARD_FAILURES_TOTAL,
    EVAL_REWARD,
    POLICY_ENTROPY,
    KL,
    CLIP_FRACTION,
    IMPORTANCE_RATIO,
    GRAD_NORM,
    RESPONSE_LENGTH_TOKENS,
    ZERO_SIGNAL_GROUPS_TOTAL,
)
