"""Dataset runs: rows of prompts and answers read from local files, the order each step's groups
take them in (:class:`DataCursor`, resumable from a checkpoint's ``data.json``), and the task a
dataset run without an agent trains (:class:`DatasetTask`: one prompt, one reply, its reward).

Files are read with Hugging Face ``datasets`` (JSONL, JSON, Parquet, CSV, or a ``save_to_disk``
directory), offline: a pod must not reach for the hub in the middle of a run.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treetrain.config.trainer_settings import DatasetSettings, TrainerSettings
from treetrain.rl import dataset_cache
from treetrain.rl.dataset_cache import CACHE_FROM_BYTES
from treetrain.rl.dataset_check import (
    DEFAULT_LIMITS,
    RowRules,
    blank_line_hint,
    json_list,
    prompt_bytes,
    prompt_problem,
    scan_file,
)
from treetrain.rl.dataset_check import ByteLimits as ByteLimits  # re-exported: load_rows' callers pass one
from treetrain.rl.dataset_check import DatasetError as DatasetError  # re-exported: its old home
from treetrain.rl.dataset_loaded import check_loaded
from treetrain.rl.rewards import RewardRunner
from treetrain.rl.task import TaskError

Rows = Sequence[dict[str, Any]]

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SINGLE_SPLIT = "train"  # the split name of one file, or of a saved Dataset (not a DatasetDict)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Replacement groups of a step (ids groupsPerStep and up) take rows from their own stream, this
# many times groupsPerStep per step (collect.EXTRA_GROUPS_FACTOR: the most a step plays).
REPLACEMENT_FACTOR = 4
STATE_VERSION = 1
ANY_REWARD = "the reward"  # load_rows' default: answers checked as a built-in reward reads them


# -- reading rows ---------------------------------------------------------------------------


def load_rows(
    settings: DatasetSettings,
    *,
    cache_dir: str | Path | None = None,
    key: str = "trainer.dataset",
    answer_for: str | None = ANY_REWARD,
    limits: ByteLimits = DEFAULT_LIMITS,
    cache_from_bytes: int = CACHE_FROM_BYTES,
) -> Rows:
    """The rows of ``settings.split``, every one checked before any is used (dataset_check): a
    prompt in each, no larger than ``limits`` (``ByteLimits.for_episode(maxEpisodeTokens)``);
    with ``answer_for`` (the reward that compares replies with the answer; None: nothing reads
    it) an answer in each. ``key`` names the config key in errors.
    A file of ``cache_from_bytes`` or more is read through an Arrow copy under ``cache_dir``
    (None: dataset_cache.default_root()), memory-mapped and kept for later runs; a smaller one
    is held in memory, no copy kept, unless ``cache_dir`` is given. A save_to_disk directory
    is mapped where it is."""
    rules = RowRules(key, settings.path, settings.prompt_field, settings.answer_field, answer_for, limits)
    path = Path(settings.path).expanduser()
    if not path.exists():
        if _HUB_ID.match(settings.path) and path.suffix not in FORMATS:
            raise DatasetError(
                f"{key}.path {settings.path!r} is not a local file or directory, and treetrain reads local "
                "datasets only: download it first (e.g. `datasets.load_dataset(...).save_to_disk(DIR)`) and set "
                f"{key}.path to DIR"
            )
        raise DatasetError(f"{key}.path {settings.path!r}: no such file or directory")
    builder = None if path.is_dir() else _builder(path, key)
    if builder is None:
        with _offline():
            rows: Rows = _read_saved(path, settings.split, key)
    else:
        _single_split(path, settings.split, key)
        cached = cache_dir is not None or path.stat().st_size >= cache_from_bytes
        with contextlib.ExitStack() as stack:
            if cached:
                place = dataset_cache.prepare(path, Path(cache_dir or dataset_cache.default_root()), key)
            else:  # the rows in memory, the Arrow copy deleted (a pod's home may be read-only)
                place = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="treetrain-data-")))
            source, blank = _scan(path, builder, rules, place)
            with _offline():
                rows = _read_file(source, builder, place, cached, (path, key, blank_line_hint(blank)))
    missing = rules.missing_columns(getattr(rows, "column_names", None) or [])
    if missing is not None:
        raise missing
    if len(rows) == 0:
        raise DatasetError(f"{key} {settings.path} (split {settings.split}) has no rows; fix: point it at rows")
    if builder != "json":  # JSON rows were checked as scan_file read them
        check_loaded(rows, rules)
    return rows


def _scan(path: Path, builder: str, rules: RowRules, place: Path) -> tuple[Path, int | None]:
    """Check the rows before datasets reads them (line numbers, and no row pyarrow would choke
    on); the file datasets is to read and the first blank line. A JSON list is read from its
    rows written as JSON lines in ``place`` (datasets would hold the whole list in memory)."""
    if builder != "json" or not json_list(path, rules.limits.row):
        return path, scan_file(path, builder, rules)
    lines = place / "rows.jsonl"
    if lines.exists():  # written by an earlier load of this version of the file: check only
        scan_file(path, builder, rules)
        return lines, None
    partial = place / f"rows.{os.getpid()}.partial"
    try:
        scan_file(path, builder, rules, list_out=partial)
        with contextlib.suppress(FileExistsError):  # another rank wrote the same rows first
            os.link(partial, lines)
    finally:
        partial.unlink(missing_ok=True)
    return lines, None


def _builder(path: Path, key: str) -> str:
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(
            f"{key}.path {path}: unknown format {path.suffix or '(no suffix)'}; use one of "
            f"{', '.join(FORMATS)} or a save_to_disk directory"
        )
    return builder


def _read_saved(path: Path, split: str, key: str) -> Any:
    import datasets

    if not any((path / name).exists() for name in ("dataset_dict.json", "dataset_info.json", "state.json")):
        raise DatasetError(
            f"{key}.path {path} is a directory that datasets' save_to_disk did not write; point it at "
            f"a {', '.join(FORMATS)} file or such a directory"
        )
    try:
        found = datasets.load_from_disk(str(path))
    except Exception as err:  # a damaged directory: one line, not a traceback
        raise DatasetError(f"{key}.path {path}: cannot read it: {type(err).__name__}: {err}") from None
    if isinstance(found, datasets.DatasetDict):
        if split not in found:
            raise DatasetError(f"{key}.split {split!r} is not in {path}; its splits: {', '.join(found)}")
        return found[split]
    _single_split(path, split, key)
    return found


def _read_file(source: Path, builder: str, place: Path, mapped: bool, about: tuple[Path, str, str]) -> Any:
    """``source`` read by datasets into Arrow files in ``place``: mapped from there, or (not
    ``mapped``) loaded into memory. ``about``: the user's file, its config key, a hint for errors."""
    import datasets

    path, key, hint = about
    try:
        return datasets.load_dataset(
            builder, data_files=str(source), split=SINGLE_SPLIT, cache_dir=str(place), keep_in_memory=not mapped
        )
    except Exception as err:  # malformed CSV or Parquet, or JSON the scan let through; a full disk
        full = dataset_cache.no_space(err, path, place, key)
        if full is not None:
            raise full from None
        message = " ".join(str(err).split())[:300] or type(err).__name__
        raise DatasetError(f"{key}.path {path}: cannot read it as {builder}: {message}{hint}") from None


def _single_split(path: Path, split: str, key: str) -> None:
    if split != SINGLE_SPLIT:
        raise DatasetError(
            f"{key}.split {split!r} is not in {path}, which holds one split: {SINGLE_SPLIT}; set split: "
            f"{SINGLE_SPLIT} (or save a DatasetDict with save_to_disk)"
        )


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """datasets and the hub client offline for the call (the config module caches the flag), and
    without progress bars (the trainer's log is one line a step)."""
    import datasets
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    flag, bars = datasets.config.HF_HUB_OFFLINE, not are_progress_bars_disabled()
    os.environ.update(dict.fromkeys(saved, "1"))
    datasets.config.HF_HUB_OFFLINE = True
    disable_progress_bars()
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = flag
        if bars:
            enable_progress_bars()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def prompt_messages(row: dict[str, Any], settings: DatasetSettings) -> list[dict[str, Any]]:
    """The chat messages of a row's prompt: a string is one user message; a list of
    ``{"role", "content"}`` messages is taken as it is."""
    prompt = row.get(settings.prompt_field)
    bad = prompt_problem(prompt, settings.prompt_field)
    if bad is not None or prompt is None:
        raise DatasetError(bad or "no prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    # A column of messages gives every message every key seen in any of them: drop the unset ones.
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


# -- which row each group trains --------------------------------------------------------------


class DataCursor:
    """Rows by (step, group): the groups of the steps from ``base_step`` on take consecutive
    *slots* from ``base_row`` on, group ``g`` of step ``s`` slot ``base_row + (s - base_step)
    * groupsPerStep + g``. Slots come in epochs of ``n_rows``; with ``shuffle`` each epoch is its
    own permutation, seeded by (seed, epoch), so no row trains twice within an epoch.

    Replacement groups (ids ``groupsPerStep`` and up: dynamic sampling's extra groups, the
    asynchronous controller's replacements of dropped groups) take rows from a second stream of
    permutations, ``REPLACEMENT_FACTOR * groupsPerStep`` slots per step: they never shift the
    next step's rows, but a replacement may reuse a row of another step."""

    def __init__(
        self, n_rows: int, groups_per_step: int, *, shuffle: bool, seed: int, base_step: int = 0, base_row: int = 0
    ) -> None:
        if n_rows < 1 or groups_per_step < 1 or base_step < 0 or base_row < 0:
            raise ValueError(f"DataCursor({n_rows}, {groups_per_step}, base {base_step}/{base_row}): out of range")
        self.n_rows, self.groups_per_step = n_rows, groups_per_step
        self.shuffle, self.seed = shuffle, seed
        self.base_step, self.base_row = base_step, base_row
        self.note: str | None = None  # from_state: what changed since the checkpoint
        self._perms: dict[tuple[str, int], list[int]] = {}

    def slot(self, step: int, group: int) -> int:
        """The slot of a first group (``group < groupsPerStep``) of ``step``."""
        if step < self.base_step:
            raise ValueError(f"step {step} is before this cursor's first step {self.base_step}")
        return self.base_row + (step - self.base_step) * self.groups_per_step + group

    def row_index(self, step: int, group: int) -> int:
        if group < 0:
            raise ValueError(f"group {group} < 0")
        if group < self.groups_per_step:
            return self._row("main", self.slot(step, group))
        extra = REPLACEMENT_FACTOR * self.groups_per_step
        return self._row("replacement", step * extra + (group - self.groups_per_step))

    def _row(self, stream: str, slot: int) -> int:
        epoch, pos = divmod(slot, self.n_rows)
        if not self.shuffle and stream == "main":
            return pos
        key = (stream, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = list(range(self.n_rows))
            random.Random(f"treetrain-data:{stream}:{self.seed}:{epoch}").shuffle(perm)
            if len(self._perms) >= 4:  # a step spans at most two epochs of a stream
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm
        return perm[pos]

    def state(self, next_step: int) -> dict[str, Any]:
        """What resumes the order at ``next_step`` (saved as ``data.json`` in a checkpoint)."""
        return {
            "version": STATE_VERSION,
            "next_step": next_step,
            "next_row": self.slot(next_step, 0),
            "rows": self.n_rows,
            "groups_per_step": self.groups_per_step,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], n_rows: int, groups_per_step: int, *, shuffle: bool, seed: int
    ) -> DataCursor:
        """Continue with the rows after the checkpoint's, whatever groupsPerStep is now; ``note``
        says what changed (the row count, the order) since the checkpoint was written."""
        ok = isinstance(state, dict) and state.get("version") == STATE_VERSION
        step, row = (state.get("next_step"), state.get("next_row")) if ok else (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, row)):
            raise DatasetError(
                f"checkpoint data.json is not a version-{STATE_VERSION} data cursor (got {str(state)[:120]}); "
                "fix: remove it to start the data order over"
            )
        assert isinstance(step, int) and isinstance(row, int)
        cursor = cls(n_rows, groups_per_step, shuffle=shuffle, seed=seed, base_step=step, base_row=row)
        changes = []
        if state.get("rows") != n_rows:
            changes.append(f"the dataset had {state.get('rows')} rows and has {n_rows}, so rows may repeat early")
        if state.get("shuffle") != shuffle or state.get("seed") != seed:
            changes.append("trainer.dataset.shuffle or seed changed, so the order is a new one")
        cursor.note = "; ".join(changes) or None
        return cursor


# -- the dataset task -------------------------------------------------------------------------

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's eos and the end-of-turn tokens it has (what a reply stops on)."""
    vocab = tokenizer.get_vocab()
    found = [tokenizer.eos_token_id] + [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
    return tuple(dict.fromkeys(t for t in found if isinstance(t, int)))


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template of ``messages`` with the generation prompt, in token ids. Rendered to
    text, then encoded without special tokens: the template writes BOS itself when it has one,
    so encoding must not add a second."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids


@dataclass
class DatasetEpisode:
    """One row: its prompt, one reply, the reply's reward; then over."""

    task: DatasetTask
    row: dict[str, Any]
    where: str
    tokens: list[int]

    def prompt(self) -> list[int]:
        return list(self.tokens)

    def respond(self, response: list[int]) -> tuple[list[int] | None, float]:
        text: str = self.task.tokenizer.decode(response, skip_special_tokens=True)
        return None, self.task.reward_runner.score(text, self.row, where=self.where)


class DatasetTask:
    """A :class:`treetrain.rl.task.Task` for ``trainer.dataset`` without an agent: group ``g``
    of step ``s`` answers row ``cursor.row_index(s, g)`` (its episodes share the row, GRPO)."""

    def __init__(
        self,
        rows: Rows,
        settings: TrainerSettings,
        tokenizer: Any,
        reward_runner: RewardRunner,
        cursor: DataCursor,
    ) -> None:
        if settings.dataset is None:
            raise DatasetError("DatasetTask needs trainer.dataset")
        self.rows, self.dataset, self.tokenizer = rows, settings.dataset, tokenizer
        self.reward_runner, self.cursor = reward_runner, cursor
        self.vocab_size: int = len(tokenizer)
        self.max_new_tokens: int = settings.max_new_tokens
        self.stop_token_ids: tuple[int, ...] = stop_token_ids(tokenizer)
        self.limits = ByteLimits.for_episode(settings.max_episode_tokens)
        self._prompts: dict[int, list[int]] = {}  # row -> tokens: a group's episodes render it once

    def episode(self, seed: int) -> DatasetEpisode:
        raise TaskError("a dataset task picks its row by step and group: call episode_at(step, group, seed)")

    def episode_at(self, step: int, group: int, seed: int) -> DatasetEpisode:
        index = self.cursor.row_index(step, group)
        row = dict(self.rows[index])
        tokens = self._prompts.get(index)
        if tokens is None:
            try:
                messages = prompt_messages(row, self.dataset)
                size = prompt_bytes(messages, self.limits.prompt)  # by bytes, before the tokenizer
                if size > self.limits.prompt:
                    raise DatasetError(self.limits.prompt_message(self.dataset.prompt_field, size))
            except DatasetError as err:  # rows are checked when loaded: only a changed row gets here
                raise DatasetError(f"trainer.dataset {self.dataset.path}: row index {index}: {err}") from None
            tokens = render_prompt(self.tokenizer, messages)
            if len(self._prompts) >= 1024:
                self._prompts.clear()
            self._prompts[index] = tokens
        return DatasetEpisode(self, row, f"step {step + 1} group {group} row {index}", tokens)
