"""The ``trainer:`` section of the trainer config (an RLJob's ``spec.trainerConfig``): the RL
loop, sampling, the optimizer and loss, metrics, datasets, rewards, evaluation and the agent
proxy. Part of the one schema (:mod:`treetrain.config.schema`); torch-free."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from treetrain.config.section import Section

RolloutKind = Literal["auto", "local", "sglang", "vllm"]
Algorithm = Literal["grpo", "ppo", "rloo", "reinforce++", "dr-grpo", "dapo", "gspo"]
AdvantageKind = Literal["group", "rloo", "reinforce++-baseline", "critic"]
Aggregation = Literal["token-mean", "sequence-mean", "constant-length"]
RatioLevel = Literal["token", "sequence"]
BehavWeightMode = Literal["token-mask", "token-truncate", "sequence-mask", "sequence-truncate"]


class SamplingSettings(Section):
    """How rollouts are sampled and how the servers are reached."""

    kind: RolloutKind = Field(
        default="auto", description="local, sglang or vllm; auto: local without servers, else each server's kind."
    )
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    timeout_seconds: float = Field(default=600.0, gt=0, description="Timeout of one server request.")
    ready_timeout_seconds: float = Field(default=1800.0, gt=0, description="Wait this long for servers to be healthy.")
    retries: int = Field(default=3, ge=0, description="Retries of a failed request (connection errors, 5xx).")
    model: str = Field(default="", description="vLLM: the served model name, when the server needs one.")
    max_staleness: int | None = Field(
        default=None,
        ge=0,
        description="Asynchronous rollout: a trajectory trained at step k was started from weights of version "
        ">= k - N, and rollout of the next steps overlaps training; 0: rollout, train and weight sync in lockstep. "
        "Unset: 0 for local rollout, 1 with rollout servers. Local rollout takes only 0.",
    )


class OptimizerSettings(Section):
    """AdamW with a constant learning rate after a linear warm-up."""

    lr: float = Field(default=1e-6, gt=0, allow_inf_nan=False, description="Learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: list[float] = Field(default=[0.9, 0.999], min_length=2, max_length=2, description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(default=1.0, ge=0, description="Clip the gradient norm to this; 0: no clipping.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warm-up steps.")


class LossSettings(Section):
    """The decoupled PPO-clip policy loss every algorithm uses (docs/trainer.md, The objective)."""

    clip_eps: float = Field(default=0.2, gt=0, lt=1, description="Clip range of the probability ratio.")
    clip_eps_high: float | None = Field(
        default=None, gt=0, description="Upper clip range (clip-higher); unset: clipEps (0.28 for dapo)."
    )
    dual_clip: float | None = Field(default=None, gt=1, description="Dual-clip bound for negative advantages.")
    kl_coef: float = Field(default=0.0, ge=0, description="KL(policy || ref) weight; > 0 needs a ref model.")
    entropy_coef: float = Field(default=0.0, ge=0, description="Entropy bonus weight.")
    behav_imp_weight_cap: float | None = Field(
        default=5.0,
        gt=1,
        description="Decoupled PPO: the cap of the behaviour weight exp(prox - behav) (behavWeightMode says what "
        "happens past it); null: no cap.",
    )
    behav_weight_mode: BehavWeightMode = Field(
        default="token-mask",
        description="token-mask: drop tokens whose weight passes the cap; token-truncate: cap each token's weight; "
        "sequence-mask / sequence-truncate: the same with one weight per sample (the geometric mean of its tokens').",
    )
    ratio_level: RatioLevel | None = Field(
        default=None,
        description="token: one ratio per token; sequence: one per sample, exp of the mean log-ratio over its "
        "response (GSPO). Unset: the algorithm's (sequence for gspo, else token).",
    )
    aggregation: Aggregation | None = Field(
        default=None,
        description="token-mean: sum over every trained token / their count; sequence-mean: each sample's token "
        "mean, averaged over samples; constant-length: the sum / (samples x aggregationLength). Unset: the "
        "algorithm's (constant-length for dr-grpo, sequence-mean for gspo, else token-mean).",
    )
    aggregation_length: int | None = Field(
        default=None, ge=1, description="constant-length: the constant; unset: the task's maxNewTokens."
    )


class OverlongSettings(Section):
    """DAPO's soft overlong penalty: a reply longer than maxNewTokens - bufferTokens loses reward
    linearly, down to -penalty at maxNewTokens."""

    buffer_tokens: int | None = Field(
        default=None, ge=1, description="Length of the penalised band; unset: a fifth of the task's maxNewTokens."
    )
    penalty: float = Field(
        default=1.0, ge=0, allow_inf_nan=False, description="Reward taken at maxNewTokens; 0 turns the penalty off."
    )


class ValueLossSettings(Section):
    """The critic's clipped value loss (PPO)."""

    clip_eps: float | None = Field(default=0.2, gt=0, description="Clip range around the old values; null: none.")


WandbMode = Literal["offline", "online"]


class WandbSettings(Section):
    """Weights & Biases, through its own client library (``pip install wandb``)."""

    project: str = Field(default="treetrain", min_length=1, description="The W&B project.")
    mode: WandbMode = Field(
        default="offline", description="offline: runs written under dir, synced later with `wandb sync`; online."
    )
    dir: str | None = Field(default=None, description="Where runs are written; unset: checkpoint.dir.")


class MetricsSettings(Section):
    """Where rank 0 reports each step: the Prometheus endpoint, a JSONL step log and optional sinks."""

    enabled: bool = Field(default=True, description="Serve Prometheus metrics (rank 0).")
    port: int = Field(default=9400, ge=0, le=65535, description="Metrics port; 0: any free port.")
    addr: str | None = Field(
        default=None, description="Listen address; unset: all interfaces inside a pod, loopback elsewhere."
    )
    step_log: bool = Field(
        default=True, description="Append every step's figures to steps.jsonl in checkpoint.dir (when it is set)."
    )
    tensorboard_dir: str | None = Field(
        default=None, description="Write TensorBoard event files here (needs the tensorboard package); unset: none."
    )
    wandb: WandbSettings | None = Field(default=None, description="Log each step to Weights & Biases; unset: none.")


# -- datasets, rewards, evaluation, the agent proxy -----------------------------------------

# Written ``package.module:function``: checked for form here, imported by the trainer (which has the user's image).
IMPORT_STRING_FORM = "package.module:function"
BUILTIN_REWARDS = ("builtin:math", "builtin:exact", "builtin:regex")


class DatasetSettings(Section):
    """Rows of prompts (and answers) read from local files: a dataset run trains one row per group."""

    path: str = Field(
        min_length=1,
        description="A local .jsonl, .json, .parquet or .csv file, or a directory written by Hugging Face "
        "datasets' save_to_disk; hub ids are not downloaded (save the dataset to disk first).",
    )
    split: str = Field(
        default="train", min_length=1, description="The split to read; a single file is the split train."
    )
    prompt_field: str = Field(
        default="prompt",
        min_length=1,
        description="Column of the prompt: a string (one user message) or a list of {role, content} messages.",
    )
    answer_field: str = Field(
        default="answer", min_length=1, description="Column of the reference answer the reward compares with."
    )
    shuffle: bool = Field(default=True, description="Visit the rows in a seeded random order, a new one each epoch.")
    seed: int = Field(default=0, ge=0, description="Seed of the row order.")


class EvalSettings(Section):
    """Periodic evaluation: the mean reward of one reply per held-out row (rows not trained on)."""

    dataset: DatasetSettings = Field(description="The evaluation rows (same keys as trainer.dataset).")
    every_steps: int = Field(
        default=10, ge=1, le=10_000_000, description="Evaluate every N steps (and after the last)."
    )
    samples: int = Field(default=32, ge=1, le=1_000_000, description="Rows scored per evaluation.")


class ProxySettings(Section):
    """The OpenAI-compatible endpoint the agent's client talks to (one session per episode)."""

    host: str | None = Field(
        default=None, description="Listen address; unset: all interfaces inside a pod, loopback elsewhere."
    )
    port: int = Field(default=8000, ge=0, le=65535, description="Listen port; 0: any free port.")
    max_sessions: int = Field(
        default=1024, ge=1, le=1_000_000, description="Sessions open at once; past it a new session gets 429."
    )
    idle_timeout_seconds: float = Field(
        default=600.0, gt=0, allow_inf_nan=False, description="A session idle this long is ended."
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, le=1 << 30, description="Largest request body; past it 413."
    )
    max_sessions_per_client: int = Field(
        default=256,
        ge=1,
        le=1_000_000,
        description="Sessions one peer address may hold open through POST /rl/sessions; past it 429. "
        "The trainer's own agent runs are not counted.",
    )
    unused_timeout_seconds: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="A session opened through POST /rl/sessions that starts no completion this long after "
        "it opened is ended.",
    )


class TrainerSettings(Section):
    """The RL loop (an RLJob's spec.trainerConfig)."""

    steps: int = Field(default=100, ge=1, le=10_000_000, description="Training steps.")
    seed: int = Field(default=0, ge=0, description="Seed of episodes and sampling.")
    task: str = Field(
        default="builtin:parity",
        min_length=1,
        description="builtin:arithmetic, builtin:parity, or package.module:function returning a task.",
    )
    task_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the task.")
    # Bounds far past any real run: a typo (1e12 groups) is refused, not started.
    groups_per_step: int = Field(default=8, ge=1, le=1_000_000, description="Prompt groups per step.")
    group_size: int = Field(default=4, ge=1, le=4096, description="Samples per group (GRPO's n).")
    algorithm: Algorithm = Field(
        default="grpo",
        description="A preset of the options below (docs/trainer.md, The objective): grpo, rloo, reinforce++, "
        "dr-grpo, dapo, gspo (no critic) or ppo (needs a critic); an option set explicitly wins over the preset.",
    )
    advantage: AdvantageKind | None = Field(
        default=None,
        description="group: reward minus the group mean; rloo: minus the mean of the group's others; "
        "reinforce++-baseline: minus the group mean, over the batch's std; critic: return minus value (ppo). "
        "Unset: the algorithm's.",
    )
    normalize_advantages: bool | None = Field(
        default=None,
        description="Divide the advantages by a standard deviation (the group's; the batch's for "
        "reinforce++-baseline). Unset: the algorithm's (false for rloo and dr-grpo, else true).",
    )
    dynamic_sampling: bool | None = Field(
        default=None,
        description="Drop groups whose rewards are all equal and sample more until groupsPerStep are kept (at "
        "most 4 x groupsPerStep extra groups). Unset: the algorithm's (true for dapo).",
    )
    overlong: OverlongSettings | None = Field(
        default=None, description="The soft overlong-reply penalty; unset: the algorithm's (on for dapo)."
    )
    ppo_epochs: int = Field(default=1, ge=1, le=1000, description="Optimizer updates per batch.")
    keep_checkpoints: int = Field(default=3, ge=1, description="Keep the newest N checkpoints.")
    # Bounds on one episode: user task code that hangs or a conversation that never ends must
    # not stall the step or grow without limit (each turn's sample holds the whole history).
    episode_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        allow_inf_nan=False,
        description="Time the task's own code (episode, prompt, respond) may take per episode; past it the step "
        "fails (exit 2) naming the task.",
    )
    max_turns: int = Field(
        default=32, ge=1, le=65536, description="Turns per episode; an episode still going is ended there (counted)."
    )
    max_episode_tokens: int = Field(
        default=32768,
        ge=1,
        le=16_777_216,
        description="Tokens of one conversation (prompt, replies, user turns); an episode whose next turn could pass "
        "it is ended (counted).",
    )
    agent: str | None = Field(
        default=None,
        description=f"{IMPORT_STRING_FORM}: async def run(client: openai.AsyncOpenAI, row: dict) -> float or None, "
        "one call per episode against the trainer's proxy; needs dataset. Unset: no agent.",
    )
    dataset: DatasetSettings | None = Field(
        default=None,
        description="Train on these rows (with agent: the rows the agent gets; without: each prompt is one reply "
        "scored by reward). Unset: the task makes the episodes.",
    )
    reward: str | None = Field(
        default=None,
        description=f"Scores a reply against its row: {', '.join(BUILTIN_REWARDS)} or {IMPORT_STRING_FORM} "
        "(fn(completion, row, **rewardArgs) -> float). Unset: none (an agent returns its own).",
    )
    reward_args: dict[str, Any] = Field(
        default_factory=dict,
        description="builtin:regex: {pattern: REGEX} (a named group answer is compared with the row's answer); "
        "an import string: extra keyword arguments of each call.",
    )
    reward_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        allow_inf_nan=False,
        description="Time one reward call may take; past it (or when it raises) the reply scores 0 (counted).",
    )
    max_new_tokens: int = Field(
        default=512,
        ge=1,
        le=65536,
        description="Reply length for dataset prompts; the default and ceiling of an agent call's max_tokens.",
    )
    eval: EvalSettings | None = Field(default=None, description="Periodic evaluation; unset: none.")
    log_samples: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="Sampled completions per step written to samples.jsonl in checkpoint.dir (prompt, reply, "
        "reward, tokens), the first one also printed; 0: none.",
    )
    progress_seconds: float = Field(
        default=30.0,
        gt=0,
        allow_inf_nan=False,
        description="During a step, print a progress line (episodes finished, tokens generated) this often.",
    )
    proxy: ProxySettings = Field(default_factory=ProxySettings)
    rollout: SamplingSettings = Field(default_factory=SamplingSettings)
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    loss: LossSettings = Field(default_factory=LossSettings)
    value_loss: ValueLossSettings = Field(default_factory=ValueLossSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    compare_flat: bool = Field(
        default=False, description="After the last step, time the last batches trained tree vs flat."
    )
    compare_batches: int = Field(default=2, ge=1, description="Batches the comparison trains.")
    compare_rounds: int = Field(default=3, ge=1, description="Measured rounds per mode; the best counts.")
    threads: int = Field(
        default=0, ge=0, description="torch intra-op threads; 0: torch's default (1 suits a small shared CPU)."
    )
