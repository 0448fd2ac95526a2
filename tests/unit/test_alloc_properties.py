"""Property tests: the parser never fails with anything but its own error, and every
valid allocation round-trips through its canonical string."""

from __future__ import annotations

import random
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from treetrain.alloc import Allocation, AllocationError, ParallelDims, parse
from treetrain.alloc.registry import names

BACKENDS = names()

SIZES = st.integers(min_value=1, max_value=16)
# Pieces of backend strings, so random text often gets deep into the grammar.
PIECES = st.sampled_from([*list("dtpce0123456789:()|+[]. _"), "attn", "ffn", *BACKENDS])


def _divisor(draw: st.DrawFn, n: int) -> int:
    return draw(st.sampled_from([k for k in range(1, n + 1) if n % k == 0]))


@settings(max_examples=1500, deadline=None)
@given(st.text())
def test_random_text_raises_only_allocation_errors(spec: str) -> None:
    try:
        parse(spec)
    except AllocationError as err:
        assert err.fix and err.problem


@settings(max_examples=3000, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join))
def test_near_miss_text_raises_only_allocation_errors(spec: str) -> None:
    try:
        allocation = parse(spec)
    except AllocationError as err:
        assert err.column is None or 1 <= err.column <= len(spec) + 1
    else:
        assert parse(str(allocation)) == allocation


@st.composite
def allocations(draw: st.DrawFn) -> Allocation:
    backend = draw(st.sampled_from(BACKENDS))
    letters = {"sglang": "dtp", "vllm": "dtp", "fsdp": "dtc"}.get(backend, "dtpce")
    if backend in ("megatron", "archon") and draw(st.booleans()):
        # Hybrid: build the expert grid first so that it always fits.
        pp, etp, ep, edp = draw(SIZES), draw(SIZES), draw(SIZES), draw(SIZES)
        per_stage = etp * ep * edp
        tp = _divisor(draw, per_stage)
        cp = _divisor(draw, per_stage // tp)
        dims = ParallelDims(dp=per_stage // tp // cp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)
        return Allocation(backend, dims, hybrid=True)
    sizes = {
        field: draw(SIZES) if letter in letters else 1
        for letter, field in zip("dtpc", ("dp", "tp", "pp", "cp"), strict=True)
    }
    if "e" in letters:
        sizes["ep"] = _divisor(draw, sizes["dp"] * sizes["tp"] * sizes["cp"])
    return Allocation(backend, ParallelDims(**sizes))


@settings(max_examples=1000, deadline=None)
@given(allocations())
def test_round_trip_through_canonical_string(allocation: Allocation) -> None:
    text = str(allocation)
    again = parse(text)
    assert again == allocation
    assert again.dims.etp == allocation.dims.etp  # hybrid strings keep expert tensor parallel
    assert str(again) == text


@settings(max_examples=300, deadline=None)
@given(allocations(), st.randoms(use_true_random=False))
def test_dimension_order_and_spaces_do_not_matter(allocation: Allocation, rnd: random.Random) -> None:
    if allocation.hybrid:
        return
    backend, dims = str(allocation).split(":")
    tokens = re.findall(r"[a-z][0-9]+", dims)
    rnd.shuffle(tokens)
    assert parse(f" {backend} : {' '.join(tokens)} ") == allocation
