"""The rows of a loaded dataset (Parquet, CSV, a ``save_to_disk`` directory: a
``datasets.Dataset``) checked by row index with :mod:`treetrain.rl.dataset_check`'s rules, read
as Arrow batches: each row sized in Arrow first (one too large is flagged, never converted),
only the checked columns of the others converted to Python, a bounded number of bytes at once.
"""

from __future__ import annotations

from typing import Any

from treetrain.rl.dataset_check import Findings, RowRules

BATCH_ROWS = 4096  # rows converted to Python at once
BATCH_BYTES = 64 << 20  # ... fewer when their checked columns hold more bytes than this


def check_loaded(rows: Any, rules: RowRules) -> None:
    """Every loaded row (a ``datasets.Dataset``), by row index: its columns as Arrow batches,
    sized in Arrow (a row too large is flagged unconverted), only the checked columns of the
    other rows converted to Python, at most about :data:`BATCH_BYTES` at a time."""
    findings = Findings(rules, "row index")
    names = [f for f in rules.fields() if f in rows.column_names]
    index = 0
    for batch in rows.select_columns(names).with_format("arrow").iter(batch_size=BATCH_ROWS):
        sizes = {name: _byte_sizes(batch.column(name)) for name in names}
        total = sum(int(s.sum()) for s in sizes.values() if s is not None)
        step = max(1, int(batch.num_rows * BATCH_BYTES / max(total, 1)))
        for start in range(0, batch.num_rows, step):
            part = batch.slice(start, step)
            large = _too_large(
                part.num_rows, {n: None if s is None else s[start : start + step] for n, s in sizes.items()}, rules
            )
            if large:
                part = part.filter([i not in large for i in range(part.num_rows)])
            values = {name: part.column(name).to_pylist() for name in names}
            kept = iter(range(part.num_rows))
            for offset in range(part.num_rows + len(large)):
                at = index + start + offset
                if offset in large:
                    findings.flag(at, large[offset])
                else:
                    j = next(kept)
                    findings.add(at, {name: values[name][j] for name in names})
        index += batch.num_rows
    findings.columns = list(rows.column_names)
    findings.raise_any(index)


def _too_large(n: int, sizes: dict[str, Any], rules: RowRules) -> dict[int, str]:
    """The rows (by offset) whose prompt, or checked columns together, pass ``rules.limits``."""
    import numpy as np

    limits = rules.limits
    known = [s for s in sizes.values() if s is not None]
    if not known:
        return {}
    prompt = sizes.get(rules.prompt_field)
    if prompt is None:
        prompt = np.zeros(n, dtype=np.int64)
    over_prompt = prompt > limits.prompt
    over = over_prompt | (np.sum(known, axis=0) > limits.row)
    return {
        int(i): limits.prompt_message(rules.prompt_field, int(prompt[i])) if over_prompt[i] else limits.row_message()
        for i in np.flatnonzero(over)
    }


def _byte_sizes(column: Any) -> Any:
    """The bytes of text in each row of an Arrow column (a numpy array), for a column of strings
    or of {role, content} messages; None for any other (its type is the problem, if any)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
        return pc.binary_length(column).fill_null(0).to_numpy()
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_struct(kind.value_type):
        return None
    field_index = kind.value_type.get_field_index("content")
    if field_index < 0 or not pa.types.is_string(kind.value_type.field(field_index).type):
        return None
    parts = [np.zeros(0, dtype=np.int64)]
    for chunk in column.chunks:
        lengths = pc.binary_length(chunk.flatten().field("content")).fill_null(0).to_numpy()
        parents = pc.list_parent_indices(chunk).to_numpy()
        parts.append(np.bincount(parents, weights=lengths, minlength=len(chunk)).astype(np.int64))
    return np.concatenate(parts)
