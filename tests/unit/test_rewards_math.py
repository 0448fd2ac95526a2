"""builtin:math (treetrain.rl.rewards_math): a number math-verify reads out of a longer bare
expression is not an answer (``2^{64}`` read as ``2`` scored 1 against ``2``), and the bounds on
the text handed to math-verify make the known bombs score 0 at once, in the reply and the row."""

from __future__ import annotations

import time

import pytest

from treetrain.rl.rewards import RewardError, math_reward

DEEP_FRACTION = "$" + r"\frac{1}{" * 10_000 + "2" + "}" * 10_000 + "$"  # 51 s in math-verify unbounded


@pytest.mark.parametrize(
    ("reply", "answer", "want"),
    [
        # A partial match of a bare expression's leading (or last) number is no match.
        ("2^{64}", "2", 0.0),
        ("The answer is 2^{64}.", "2", 0.0),
        (r"3\sqrt{2}", "3", 0.0),
        ("10!", "10", 0.0),
        (r"2 \times 10^{3}", "10", 0.0),
        (r"2 \cdot 3", "3", 0.0),
        (r"2\pi", "2", 0.0),
        # The whole bare expression is read instead, and compared as mathematics.
        ("2^{64}", "18446744073709551616", 1.0),
        ("18446744073709551616", "2^{64}", 1.0),
        ("2", "2^{64}", 0.0),
        ("10!", "3628800", 1.0),
        (r"2 \times 10^{3}", "2000", 1.0),
        (r"2 \cdot 3", "6", 1.0),
        (r"3\sqrt{2}", r"$3\sqrt{2}$", 1.0),
        # Plain numbers still read as before.
        ("x = 2", "2", 1.0),
        ("I have 2 apples.", "2", 1.0),
        ("The answer is 2", "#### 2", 1.0),
        (r"$2^{64}$", "18446744073709551616", 1.0),
    ],
)
def test_a_number_that_only_starts_an_expression_is_not_the_answer(reply: str, answer: str, want: float) -> None:
    assert math_reward(reply, answer) == want


@pytest.mark.parametrize(
    "reply",
    [
        DEEP_FRACTION,
        r"$\prod_{i=1}^{10^{6}} i$",  # 15 s: a million-term product
        r"\boxed{\sum_{k=1}^{10^{9}} k}",
        r"\boxed{9^{9^{9}}}",
        "x" * 50_000 + r" so \boxed{42}" + "{" * 40 + "}" * 40,  # too deep at the end: no answer
    ],
)
def test_replies_past_the_bounds_score_zero_at_once(reply: str) -> None:
    start = time.monotonic()
    assert math_reward(reply, "42") == 0.0
    assert time.monotonic() - start < 5, "a bound should make this fail fast, not the timeout"


def test_a_long_reply_is_read_from_its_end() -> None:
    assert math_reward("blah " * 20_000 + r"so \boxed{42}", "42") == 1.0
    assert math_reward(r"\prod_{i=1}^{5} i = \boxed{120}", "120") == 1.0  # a small product is fine


@pytest.mark.parametrize(
    ("answer", "phrase"),
    [
        ("$9^{9^{9}}$", "too large to compare"),
        ("9^{9^{9}}", "too large to compare"),
        (r"$\prod_{i=1}^{10^{7}} i$", "too large to compare"),
        ("{" * 30 + "1" + "}" * 30, "nests brackets 30 deep"),
        ("1" * 3000, "is 3000 characters"),
    ],
)
def test_a_row_answer_past_the_bounds_is_one_line_at_once(answer: str, phrase: str) -> None:
    start = time.monotonic()
    with pytest.raises(RewardError, match=phrase) as info:
        math_reward("42", answer)
    assert time.monotonic() - start < 5
    assert "\n" not in str(info.value) and "fix:" in str(info.value)
