"""Local rollout: sampling with the trainer's own model, keeping the KV cache between turns."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treetrain.rl.progress import RolloutProgress
from treetrain.rl.rollout.base import Generation, RolloutClient, SamplingParams
from treetrain.rl.rollout.gate import WeightGate

# Decoded tokens between two stop checks: a SIGTERM stops generation within this many tokens.
# With several ranks each check is a one-element all-reduce, so not every token.
STOP_CHECK_TOKENS = 8


class LocalRollout(RolloutClient):
    """Samples with the trainer's model (the embedded default). Every rank must call
    :meth:`generate` together when the model is sharded.

    Between the turns of one batch it keeps the KV cache it ended with: when every prompt of the
    next call extends a sequence it holds (history + reply + the next user turn), only the new
    tokens are read. Identical prompts (the samples of a group) are read once. Any in-place change
    of the weights (an optimizer step, a checkpoint load) or :meth:`forget` drops the cache.

    ``progress`` counts the tokens as they are decoded and is asked every ``STOP_CHECK_TOKENS``
    tokens whether to stop (:class:`treetrain.rl.progress.RolloutStopped`); every rank of a
    sharded model asks at the same tokens."""

    kind = "local"

    def __init__(self, model: Any, device: Any, progress: RolloutProgress | None = None) -> None:
        self.model = model
        self.device = device
        self.progress = progress
        # transformers >= 5.2x names the KV cache `cache`; older releases `past_key_values`.
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Only the last position's logits are sampled from: the others (a vocabulary's worth of
        # floats per prompt token, 6 GB for 32k tokens of a 49k vocabulary) are never computed.
        # Older transformers name it num_logits_to_keep; a model with neither computes them all.
        keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
        self._keep_last = {keep: 1} if keep is not None else {}
        self._kept: _KeptCache | None = None
        self.gate = WeightGate()  # the trainer moves its version after every optimizer step
        self.prompt_tokens_read = 0  # prompt tokens the model has run (the tests read it)

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *, seed: int) -> list[Generation]:
        import torch

        if not prompts:
            return []
        gen = torch.Generator().manual_seed(seed)
        kept, self._kept = self._kept, None
        if kept is not None and kept.weights != self._weights():
            kept = None  # the weights changed since: the cached keys and values are stale
        was_training = self.model.training
        self.model.eval()
        try:
            rows = list(prompts)
            if self.progress is not None:
                self.progress.check()  # a long prefill is not started after a stop
            with torch.no_grad():
                start = (self._extend(kept, rows) if kept is not None else None) or self._prefill(rows)
                gens, self._kept = self._decode(rows, start, params, gen)
            return gens
        finally:
            self.model.train(was_training)

    def forget(self) -> None:
        self._kept = None

    def _weights(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.model.parameters())

    def _forward(self, ids_BT: Any, mask_BT: Any, pos_BT: Any, cache: Any = None) -> tuple[Any, Any]:
        """(the KV cache, each row's last logits) of one forward over ``ids_BT``."""
        extra = ({self._cache_kw: cache} if cache is not None else {}) | self._keep_last
        res = self.model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, use_cache=True, **extra)
        return _cache_of(res), res.logits[:, -1].float()

    def _prefill(self, prompts: list[list[int]]) -> _Start:
        """Read every distinct prompt once, left-padded: every row's last prompt token sits in the
        last column, pads are masked out and positions count real tokens only, so each row sees
        exactly what it would see alone; then give each prompt its row."""
        import torch

        distinct = list(dict.fromkeys(map(tuple, prompts)))
        row_of = {p: r for r, p in enumerate(distinct)}
        ids_BT, mask_BT = _left_padded([list(p) for p in distinct], self.device)
        pos_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
        cache, logits_BV = self._forward(ids_BT, mask_BT, pos_BT)
        self.prompt_tokens_read += sum(map(len, distinct))
        rows = torch.tensor([row_of[tuple(p)] for p in prompts], device=self.device)
        if len(distinct) < len(prompts):
            cache.reorder_cache(rows)
        return _Start(cache, mask_BT[rows], pos_BT[rows, -1:], logits_BV[rows])

    def _extend(self, kept: _KeptCache, prompts: list[list[int]]) -> _Start | None:
        """Continue the kept cache: each prompt reads only what follows the kept sequence it
        extends (left-padded again, so the last columns line up). None when one extends none."""
        import torch

        rows = kept.rows_extended_by(prompts)
        if rows is None:
            return None
        index = torch.tensor(rows, device=self.device)
        kept.cache.reorder_cache(index)
        held = [len(kept.seqs[r]) for r in rows]
        ids_BT, new_BT = _left_padded([p[n:] for p, n in zip(prompts, held, strict=True)], self.device)
        pos_BT = torch.tensor(held, device=self.device)[:, None] + (new_BT.cumsum(1) - 1).clamp(min=0)
        mask_BT = torch.cat([kept.mask_BT[index], new_BT], dim=1)
        cache, logits_BV = self._forward(ids_BT, mask_BT, pos_BT, kept.cache)
        self.prompt_tokens_read += sum(len(p) - n for p, n in zip(prompts, held, strict=True))
        return _Start(cache, mask_BT, pos_BT[:, -1:], logits_BV)

    def _decode(
        self, prompts: list[list[int]], start: _Start, params: SamplingParams, gen: Any
    ) -> tuple[list[Generation], _KeptCache]:
        import torch

        cache, mask_BT, pos_B1, logits_BV = start.cache, start.mask_BT, start.pos_B1, start.logits_BV
        b = len(prompts)
        toks: list[list[int]] = [[] for _ in range(b)]
        lps: list[list[float]] = [[] for _ in range(b)]
        fed = [0] * b  # tokens of each row that the cache holds
        done = [False] * b
        reasons = ["length"] * b
        for step in range(params.max_new_tokens):
            probs_BV = torch.softmax(logits_BV / params.temperature, dim=-1)
            if params.top_p < 1.0:
                probs_BV = _top_p(probs_BV, params.top_p)
            next_B = torch.multinomial(probs_BV.cpu(), 1, generator=gen).squeeze(1)
            # The behaviour log-prob is the model's at temperature 1, as the trainer computes it
            # (and vLLM returns by default): temperature and top-p shape exploration only.
            raw_BV = logits_BV.float()
            picked_B = raw_BV.gather(1, next_B[:, None].to(raw_BV.device)).squeeze(1)
            chosen = (picked_B - torch.logsumexp(raw_BV, dim=-1)).cpu()
            live = [not d for d in done]  # rows whose token this step is theirs
            # Host sync per decoded token: the episode logic needs the tokens on the host anyway.
            for r, (t, lp) in enumerate(zip(next_B.tolist(), chosen.tolist(), strict=True)):
                if done[r]:
                    continue
                toks[r].append(t)
                lps[r].append(lp)
                if t in params.stop_token_ids:
                    done[r], reasons[r] = True, "stop"
            if self.progress is not None:
                self.progress.decoded(sum(live))
                if step % STOP_CHECK_TOKENS == STOP_CHECK_TOKENS - 1:
                    self.progress.check()  # the same step on every rank: they stop together
            if all(done) or step == params.max_new_tokens - 1:
                break
            # Finished rows keep decoding (the batch keeps one shape), but their tokens are
            # masked out of the cache: it must hold only what the next turn's prompt extends.
            fed = [n + a for n, a in zip(fed, live, strict=True)]
            mask_BT = torch.cat([mask_BT, torch.tensor(live, dtype=mask_BT.dtype, device=self.device)[:, None]], 1)
            pos_B1 = pos_B1 + 1
            cache, logits_BV = self._forward(next_B[:, None].to(self.device), mask_BT, pos_B1, cache)
        v = self.gate.version
        gens = [
            Generation(tokens=t, logprobs=lp, finish_reason=r, versions=[v] * len(t))
            for t, lp, r in zip(toks, lps, reasons, strict=True)
        ]
        seqs = [p + t[:n] for p, t, n in zip(prompts, toks, fed, strict=True)]
        return gens, _KeptCache(cache, mask_BT, seqs, self._weights())


@dataclass(slots=True)
class _Start:
    """Where decoding starts: the cache after the prompts, its mask, each row's last position
    and its next-token logits."""

    cache: Any
    mask_BT: Any
    pos_B1: Any
    logits_BV: Any


@dataclass(slots=True)
class _KeptCache:
    """The cache a :meth:`LocalRollout.generate` call ended with: row r holds the keys and values
    of ``seqs[r]`` in the columns where ``mask_BT[r]`` is 1; ``weights`` are the parameters'
    version counters at the time (an in-place update bumps them)."""

    cache: Any
    mask_BT: Any
    seqs: list[list[int]]
    weights: tuple[int, ...]

    def rows_extended_by(self, prompts: list[list[int]]) -> list[int] | None:
        """For each prompt, the longest kept row it strictly extends; None if one extends none."""
        by_len: dict[int, dict[tuple[int, ...], int]] = {}
        for r, seq in enumerate(self.seqs):
            by_len.setdefault(len(seq), {}).setdefault(tuple(seq), r)
        lengths = sorted(by_len, reverse=True)
        rows = []
        for p in prompts:
            row = next((by_len[n][key] for n in lengths if n < len(p) and (key := tuple(p[:n])) in by_len[n]), None)
            if row is None:
                return None
            rows.append(row)
        return rows


def _left_padded(seqs: list[list[int]], device: Any) -> tuple[Any, Any]:
    """(ids, mask) of ``seqs`` right-aligned in one batch; pads are id 0 with mask 0."""
    import torch

    width = max(len(s) for s in seqs)
    ids_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    mask_BT = torch.zeros(len(seqs), width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids_BT[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask_BT[r, width - len(s) :] = 1
    return ids_BT.to(device), mask_BT.to(device)


def _cache_of(res: Any) -> Any:
    return res["cache"] if "cache" in res else res["past_key_values"]


def _top_p(probs_BV: Any, top_p: float) -> Any:
    import torch

    sorted_BV, order_BV = torch.sort(probs_BV, descending=True, dim=-1)
    keep_BV = torch.cumsum(sorted_BV, -1) - sorted_BV < top_p
    sorted_BV = sorted_BV * keep_BV
    return torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)
