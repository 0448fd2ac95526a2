"""bench/operator_load.py reads p50/p99 from the operator's histogram buckets: check that reading."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from operator_load import quantile


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.5, 0.15),  # rank 50 is half way through the (0.1, 0.2] bucket: 25 of its 50
        (0.25, 0.1),  # rank 25 is the top of the first bucket
        (0.99, 0.968),  # rank 99: 24 of the 25 in (0.2, 1.0], so 0.2 + 0.96 * 0.8
    ],
)
def test_quantile_interpolates_inside_the_bucket(q: float, expected: float) -> None:
    buckets = [(0.1, 25.0), (0.2, 75.0), (1.0, 100.0), (math.inf, 100.0)]
    assert quantile(buckets, q) == pytest.approx(expected)


def test_quantile_beyond_the_last_bound_and_of_nothing() -> None:
    assert quantile([(1.0, 1.0), (math.inf, 10.0)], 0.99) == 1.0  # the last finite bound
    assert math.isnan(quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5))
