"""Backend strings: every rule of treetrain.alloc, table-driven."""

from __future__ import annotations

import pytest

from treetrain.alloc import (
    Allocation,
    AllocationError,
    AllocationSyntaxError,
    AllocationValidationError,
    LegacySpecError,
    MissingBackendError,
    ParallelDims,
    migrate,
    migration_yaml,
    parse,
)

# spec -> (dp, tp, pp, cp, ep, etp, world_size)
VALID = {
    "fsdp:d8": (8, 1, 1, 1, 1, 1, 8),
    "fsdp:d4t2": (4, 2, 1, 1, 1, 1, 8),
    "fsdp:t2d4": (4, 2, 1, 1, 1, 1, 8),
    "fsdp:d2t2c2": (2, 2, 1, 2, 1, 1, 8),
    "fsdp:d4p1e1": (4, 1, 1, 1, 1, 1, 4),  # p1 and e1 are harmless for fsdp
    "fsdp : d4 t2": (4, 2, 1, 1, 1, 1, 8),  # spaces between tokens are ignored
    "megatron:d2p2t4": (2, 4, 2, 1, 1, 1, 16),
    "megatron:d2p2t4e4": (2, 4, 2, 1, 4, 1, 16),  # e adds no GPUs
    "megatron:d4p2e4": (4, 1, 2, 1, 4, 1, 8),
    "megatron:c4e4": (1, 1, 1, 4, 4, 1, 4),
    "archon:d2p2c2e2": (2, 1, 2, 2, 2, 1, 8),
    "sglang:d2t4": (2, 4, 1, 1, 1, 1, 8),
    "sglang:d3p2t4": (3, 4, 2, 1, 1, 1, 24),
    "vllm:t2": (1, 2, 1, 1, 1, 1, 2),
    "vllm:d1": (1, 1, 1, 1, 1, 1, 1),
    "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)": (4, 2, 2, 2, 2, 4, 32),
    "megatron:(attn:d4p2t2c2|ffn:p2t4e2)": (4, 2, 2, 2, 2, 4, 32),  # ffn d derived
    "megatron:(attn:d4p2t2c2|ffn:t4e2)": (4, 2, 2, 2, 2, 4, 32),  # ffn p copied from attn
    "archon:(attn:d8|ffn:e8)": (8, 1, 1, 1, 8, 1, 8),
    "megatron:(attn:d4|ffn:t2)": (4, 1, 1, 1, 1, 2, 4),
    " megatron : ( attn : d4 | ffn : e2 ) ": (4, 1, 1, 1, 2, 1, 4),
}


@pytest.mark.parametrize("spec", VALID)
def test_valid_specs(spec: str) -> None:
    a = parse(spec)
    d = a.dims
    assert (d.dp, d.tp, d.pp, d.cp, d.ep, d.etp, a.world_size) == VALID[spec]


def test_acceptance_hybrid_json_fields() -> None:
    out = parse("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)").to_dict()
    assert {k: out[k] for k in ("dp", "tp", "pp", "cp", "ep", "etp", "world_size")} == {
        "dp": 4, "tp": 2, "pp": 2, "cp": 2, "ep": 2, "etp": 4, "world_size": 32,
    }  # fmt: skip
    assert out["attn"] == {"dp": 4, "tp": 2, "pp": 2, "cp": 2, "world_size": 32}
    assert out["ffn"] == {"dp": 2, "tp": 4, "pp": 2, "ep": 2, "world_size": 32}
    assert out["kind"] == "training"


def test_inference_instances() -> None:
    a = parse("sglang:d2t4")
    assert a.kind == "inference"
    assert (a.instances, a.gpus_per_instance, a.world_size) == (2, 4, 8)
    b = parse("vllm:d3p2t2")
    assert (b.instances, b.gpus_per_instance, b.world_size) == (3, 4, 12)


@pytest.mark.parametrize("backend", ["fsdp", "megatron", "archon"])
def test_training_kind(backend: str) -> None:
    assert parse(f"{backend}:d2").kind == "training"
    assert "instances" not in parse(f"{backend}:d2").to_dict()


# spec -> (error type, column, key phrase of the problem, key phrase of the fix)
INVALID = {
    "d4t2": (MissingBackendError, 1, "backend missing", "write fsdp:d4t2 or megatron:d4t2"),
    "d4p2": (MissingBackendError, 1, "backend missing", "megatron:d4p2 or archon:d4p2"),
    "[actor]:d4": (MissingBackendError, 1, "backend missing", "in actor.backend"),
    "(attn:d4|ffn:e2)": (MissingBackendError, 1, "backend missing before the hybrid", "megatron:(attn:d4|ffn:e2)"),
    ":d4": (AllocationSyntaxError, 1, "backend missing before ':'", "fsdp:d4"),
    "fsdp.d4": (AllocationSyntaxError, 5, "unexpected '.'", "use ':' between backend and dims"),
    "fsdp d4": (AllocationSyntaxError, 6, "missing ':' after fsdp", "write fsdp:d4"),
    "fsdp": (AllocationSyntaxError, 5, "fsdp has no dimensions", "fsdp:d4"),
    "fsdp:": (AllocationSyntaxError, 6, "no dimensions after ':'", "add dimensions"),
    "": (AllocationSyntaxError, 1, "empty", "fsdp:d8"),
    "   ": (AllocationSyntaxError, 1, "empty", "fsdp:d8"),
    "FSDP:d4": (AllocationSyntaxError, 1, "unknown backend 'FSDP'", "lower-case: write fsdp"),
    "Sglang:d4": (AllocationSyntaxError, 1, "unknown backend", "write sglang"),
    "deepspeed:d4": (AllocationSyntaxError, 1, "unknown backend 'deepspeed'", "use one of sglang, vllm"),
    "nope": (AllocationSyntaxError, 5, "'nope' is not a backend string", "backend:dims"),
    "fsdp:D4": (AllocationSyntaxError, 6, "lower-case", "write d4"),
    "fsdp:4": (AllocationSyntaxError, 6, "size without a dimension letter", "d4t2"),
    "fsdp:d4x2": (AllocationSyntaxError, 8, "unknown dimension 'x'", "d (data), t (tensor)"),
    "fsdp:d0": (AllocationSyntaxError, 7, "is 0", "sizes start at 1"),
    "fsdp:d04": (AllocationSyntaxError, 7, "leading zero", "write d4"),
    "fsdp:d2d4": (AllocationSyntaxError, 8, "d is given twice", "write each dimension once"),
    "fsdp:d4$": (AllocationSyntaxError, 8, "unexpected character '$'", "letters, digits"),
    "fsdp:d4:": (AllocationSyntaxError, 8, "unexpected ':'", "backend:dims"),
    "fsdp:d4p2": (AllocationValidationError, 8, "fsdp does not support pipeline parallel (p2)", "megatron:d4p2"),
    "fsdp:d4e2": (AllocationValidationError, 8, "fsdp does not support expert parallel (e2)", "megatron or archon"),
    "sglang:d4c2": (AllocationSyntaxError, 10, "sglang takes only d (instances), t and p", "drop c2"),
    "vllm:e2": (AllocationSyntaxError, 6, "not expert parallel (e2)", "drop e2"),
    "sglang:c1": (AllocationSyntaxError, 8, "not context parallel", "drop c1"),
    "megatron:d2e3": (AllocationValidationError, 12, "does not fit the GPU grid", "pick e from e1, e2"),
    "megatron:d2p2e4": (AllocationValidationError, 14, "does not divide the world size 4", "pick e from"),
    "archon:d1p2e2": (AllocationValidationError, 12, "pp*etp*ep = 2*1*2 = 4", "grow d"),
    # hybrid
    "megatron:(attn:d4p2|ffn:p4e2)": (AllocationValidationError, 25, "pipeline parallel size differs", "same p"),
    "megatron:(attn:d4|ffn:d3e2)": (AllocationValidationError, 23, "must cover the same GPUs", "leave d out"),
    "megatron:(attn:d4|ffn:e3)": (AllocationValidationError, 19, "cannot derive the ffn d", "t*p*e divides 4"),
    "megatron:(attn:d4e2|ffn:e2)": (AllocationSyntaxError, 18, "attn section takes only", "belongs in the ffn"),
    "megatron:(attn:d4|ffn:c2)": (AllocationSyntaxError, 23, "ffn section takes only", "belongs in the attn"),
    "megatron:(ffn:e2|attn:d4)": (AllocationSyntaxError, 11, "expected the attn section", "attn section first"),
    "megatron:(moe:d4|ffn:e2)": (AllocationSyntaxError, 11, "expected the attn section", "name the section attn"),
    "fsdp:(attn:d4|ffn:e4)": (AllocationValidationError, 1, "fsdp cannot take a hybrid", "megatron or archon"),
    "sglang:(attn:d4|ffn:e2)": (AllocationValidationError, 1, "sglang cannot take a hybrid", "megatron or archon"),
    "megatron:(attn:d4|ffn:e2": (AllocationSyntaxError, 25, "'(' is never closed", "add ')'"),
    "megatron:attn:d4|ffn:e2)": (AllocationSyntaxError, 10, "must be in parentheses", "megatron:(attn:d4|ffn:e2)"),
    "megatron:attn:d4|ffn:e2": (AllocationSyntaxError, 10, "must be in parentheses", "megatron:(attn:d4|ffn:e2)"),
    "fsdp:d4)": (AllocationSyntaxError, 8, "')' without a matching '('", "(attn:...|ffn:...)"),
    # legacy multi-component strings
    "sglang:d4+fsdp:d4": (LegacySpecError, 10, "legacy allocation mode", "rollout.backend: sglang:d4, actor.backend"),
    "fsdp[actor]:d4|fsdp[critic]:d4": (LegacySpecError, 5, "legacy", "critic.backend: fsdp:d4"),
    "fsdp[actor]:d4": (LegacySpecError, 5, "names in brackets", "actor.backend: fsdp:d4"),
    "sglang:d4+": (AllocationSyntaxError, 11, "nothing after '+'", "one engine per backend field"),
    "sglang:d1+d1": (MissingBackendError, 11, "backend missing", "fsdp:d1"),
    "fsdp:d4+fsdp:d2": (LegacySpecError, 9, "two engines would both become actor.backend", "fsdp[critic]"),
}


@pytest.mark.parametrize("spec", INVALID)
def test_invalid_specs(spec: str) -> None:
    err_type, column, problem, fix = INVALID[spec]
    with pytest.raises(err_type) as info:
        parse(spec)
    err = info.value
    assert isinstance(err, AllocationError) and isinstance(err, ValueError)
    assert err.column == column, str(err)
    assert problem in err.problem, str(err)
    assert fix in err.fix, str(err)
    text = str(err)
    assert "\n" not in text and f"column {column}" in text and repr(spec) in text


def test_error_message_names_spec_column_and_fix() -> None:
    with pytest.raises(AllocationError) as info:
        parse("fsdp.d4")
    assert str(info.value) == "'fsdp.d4', column 5: unexpected '.'; fix: use ':' between backend and dims, e.g. fsdp:d4"


def test_non_string_spec() -> None:
    with pytest.raises(AllocationSyntaxError, match="must be text"):
        parse(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The dataclasses validate themselves (no parser involved, so no column)


def test_allocation_validates_without_parser() -> None:
    with pytest.raises(AllocationValidationError, match="fsdp does not support pipeline parallel"):
        Allocation("fsdp", ParallelDims(dp=2, pp=2))
    with pytest.raises(AllocationValidationError, match="does not fit the GPU grid") as info:
        Allocation("megatron", ParallelDims(dp=2, ep=3))
    assert info.value.column is None and info.value.field == "ep"
    with pytest.raises(AllocationValidationError, match="unknown backend"):
        Allocation("deepspeed")
    with pytest.raises(AllocationValidationError, match="only set by the t of a hybrid ffn"):
        Allocation("megatron", ParallelDims(dp=4, etp=2))
    with pytest.raises(AllocationValidationError, match="sglang does not support context parallel"):
        Allocation("sglang", ParallelDims(cp=2))
    with pytest.raises(AllocationValidationError, match="fsdp cannot take a hybrid"):
        Allocation("fsdp", ParallelDims(dp=4), hybrid=True)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_dims_reject_non_positive_ints(bad: object) -> None:
    with pytest.raises(AllocationValidationError, match="whole number >= 1"):
        ParallelDims(dp=bad)  # type: ignore[arg-type]


def test_ep_check_is_not_an_assert() -> None:
    # The expert-grid check must hold under `python -O`, which strips asserts.
    import subprocess
    import sys

    code = "from treetrain.alloc import parse\ntry:\n parse('megatron:d2e3')\nexcept ValueError:\n print('ok')"
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------------------
# Canonical strings


@pytest.mark.parametrize(
    ("spec", "canonical"),
    [
        ("fsdp:t2d4", "fsdp:d4t2"),
        ("fsdp:d1", "fsdp:d1"),
        ("fsdp:p1", "fsdp:d1"),
        ("megatron:t4p2d2", "megatron:d2p2t4"),
        ("sglang:p2t4d3", "sglang:d3p2t4"),
        ("megatron:(attn:d4p2t2c2|ffn:t4e2)", "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)"),
        ("megatron:(attn:d4|ffn:t2)", "megatron:(attn:d4|ffn:d2t2)"),
        ("archon:(attn:d2|ffn:d2)", "archon:(attn:d2|ffn:d2)"),
    ],
)
def test_canonical(spec: str, canonical: str) -> None:
    assert str(parse(spec)) == canonical
    assert parse(canonical) == parse(spec)


# ---------------------------------------------------------------------------
# Migration of legacy strings


def test_migrate_fields() -> None:
    assert migrate("sglang:d4+fsdp:d4") == [("rollout", "sglang:d4"), ("actor", "fsdp:d4")]
    assert migrate("sglang[gen]:d4t2+megatron[actor]:d2p2") == [("gen", "sglang:d4t2"), ("actor", "megatron:d2p2")]
    assert migrate("fsdp:d4") == [("actor", "fsdp:d4")]


def test_migrate_colocation_keeps_precedence() -> None:
    # '|' binds tighter than '+': a+b|c is a+(b|c).
    text = migration_yaml("sglang:d4+fsdp[actor]:d4|fsdp[critic]:d4")
    assert text.splitlines() == [
        "rollout:",
        "  backend: sglang:d4",
        "actor:",
        "  backend: fsdp:d4",
        "critic:",
        "  backend: fsdp:d4",
        "  # shared actor's GPUs: critic and ref run in the actor's trainer pods by default",
    ]


def test_legacy_error_carries_fields() -> None:
    with pytest.raises(LegacySpecError) as info:
        parse("sglang:d4+fsdp:d4")
    assert info.value.fields == [("rollout", "sglang:d4"), ("actor", "fsdp:d4")]
    assert "treetrain alloc --migrate" in info.value.fix
