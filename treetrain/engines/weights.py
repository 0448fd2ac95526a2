"""A model directory's safetensors files checked before any engine reads them: a damaged file
(empty, truncated, a garbage header, data shorter than its header says) is one line naming the
file and the fix, not a loader's traceback minutes into start-up.

Only the header is read (8 bytes of length, then the JSON table of tensors), never the data.
Torch-free.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from treetrain.engines.errors import EngineConfigError

# Bytes per element of the dtypes safetensors writes (sub-byte types are skipped).
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def safetensors_problem(file: Path) -> str | None:
    """What is wrong with one safetensors file, from its size and header; None when it is whole."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                return f"it has {size} bytes, fewer than the 8 of a safetensors header" if size else "it is empty"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                return f"its header claims {n} bytes, the file has {size}"
            raw = handle.read(n)
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - n
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(entry)
        if problem is not None:
            return f"tensor {name!r}: {problem}"
        end = max(end, entry["data_offsets"][1])
    if end != data:
        cut = " (truncated)" if end > data else ""
        return f"its header describes {end} bytes of tensor data, the file holds {data}{cut}"
    return None


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "not a tensor entry"
    offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return "no data_offsets"
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return "no shape"
    begin, stop = offsets
    if not 0 <= begin <= stop:
        return f"data_offsets {offsets} are out of order"
    size = ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
    if size is not None and stop - begin != math.prod(shape) * size:
        return f"{stop - begin} bytes for shape {shape} of {dtype}"
    return None


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files a loader reads: those an index names, else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise EngineConfigError(
                f"{index} is damaged (no weight_map); fix: copy the model directory again (or export it again)"
            ) from None
        return [directory / str(name) for name in names]
    return sorted(directory.glob("*.safetensors"))


def check_model_dir(directory: str | Path, model_path: str) -> None:
    """Every weight file of a local model directory is whole (a hub name or a random built-in
    model, with no directory, passes)."""
    root = Path(directory)
    if not root.is_dir():
        return
    for file in weight_files(root):
        problem = "it is missing" if not file.is_file() else safetensors_problem(file)
        if problem is not None:
            raise EngineConfigError(
                f"model.path {model_path!r}: {file} is damaged ({problem}); fix: copy the model directory again "
                "(or export it again)"
            )
