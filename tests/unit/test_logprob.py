"""Log-probs: the chunked gather against log_softmax, and tree_logprobs against each
sequence run alone through tiny random Llama / Qwen2 / Qwen3 models (fp32, <= 1e-4)."""

from __future__ import annotations

import functools
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tree_helpers import tiny_model

import treetrain
from treetrain.logprob import gather_logprobs
from treetrain.tree import PackingError

FAMILIES = ["llama", "qwen2", "qwen3"]
BACKENDS = ["dense", "sparse"]


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    # 16-token blocks: small trees span many blocks, and branches fall across block boundaries.
    monkeypatch.setenv("TREETRAIN_BLOCK_SIZE", "16")
    monkeypatch.delenv("TREETRAIN_ATTENTION", raising=False)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gather_matches_log_softmax(chunk: int, with_entropy: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    pred = torch.tensor([0, 0, 1, 3, 3, 3, 6, 2])
    label = torch.tensor([1, 4, 0, 10, 2, 2, 5, 7])
    w1, w2 = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    logp, ent = gather_logprobs(logits, pred, label, chunk_size=chunk, with_entropy=with_entropy)
    ref_lsm = torch.log_softmax(logits, -1)
    ref_logp = ref_lsm[pred, label]
    ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)[pred]
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref_logp.float())
    loss = (logp.double() * w1).sum() + ((ent.double() * w2).sum() if ent is not None else 0)
    ref_loss = (ref_logp * w1).sum() + ((ref_ent * w2).sum() if with_entropy else 0)
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    if ent is not None:
        torch.testing.assert_close(ent, ref_ent.float())


def test_entropy_read_as_a_statistic_leaves_the_gradient_alone() -> None:
    """The trainer always asks for the entropy, to report it: detached (never differentiated), it
    changes no gradient bit. Differentiated alone, its gradient is still right."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 13, generator=g, requires_grad=True)
    pred, label = torch.tensor([0, 1, 1, 4, 5]), torch.tensor([3, 0, 12, 7, 7])
    plain, _ = gather_logprobs(logits, pred, label, chunk_size=4)
    (want,) = torch.autograd.grad(plain.sum(), logits)
    logp, ent = gather_logprobs(logits, pred, label, chunk_size=4, with_entropy=True)
    assert ent is not None and float(ent.detach().sum()) > 0
    (got,) = torch.autograd.grad(logp.sum(), logits)
    assert torch.equal(got, want)
    _, ent = gather_logprobs(logits, pred, label, chunk_size=4, with_entropy=True)
    assert ent is not None
    (ent_grad,) = torch.autograd.grad(ent.sum(), logits)
    lsm = torch.log_softmax(logits, -1)
    (ref_grad,) = torch.autograd.grad(-(lsm.exp() * lsm).sum(-1)[pred].sum(), logits)
    torch.testing.assert_close(ent_grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_gather_upcasts_half_logits() -> None:
    logits = torch.randn(5, 9).bfloat16()
    logp, _ = gather_logprobs(logits, torch.tensor([0, 4]), torch.tensor([3, 8]), chunk_size=2)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, torch.log_softmax(logits.float(), -1)[[0, 4], [3, 8]])


def _batch(seed: int) -> list[list[int]]:
    """Siblings, a prefix of another sequence, an exact duplicate, single tokens, unrelated roots."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 101) for _ in range(37)]
    seqs = [prompt + [rng.randrange(1, 101) for _ in range(n)] for n in (1, 9, 16, 30)]
    seqs += [seqs[2][:45], list(seqs[1]), [7], prompt[:1], [rng.randrange(1, 101) for _ in range(23)]]
    seqs += [seqs[3][:52] + [rng.randrange(1, 101) for _ in range(11)]]
    return seqs


def _alone(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_parity(family: str, backend: str) -> None:
    model = tiny_model(family)
    seqs = _batch(1)
    with torch.no_grad():
        expected = [_alone(model, s) for s in seqs]
        got = treetrain.tree_logprobs(model, seqs, max_tokens_per_mb=128, attention=backend)
    assert len(got) == len(seqs)
    for s, g, e in zip(seqs, got, expected, strict=True):
        assert g.shape == (len(s) - 1,) and g.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_parity(family: str, backend: str) -> None:
    seqs = _batch(2)
    weights = [torch.linspace(-1, 1, len(s) - 1) for s in seqs]

    def grads(tree: bool) -> dict[str, torch.Tensor]:
        model = tiny_model(family)
        if tree:
            logps = treetrain.tree_logprobs(model, seqs, max_tokens_per_mb=128, attention=backend)
        else:
            logps = [_alone(model, s) for s in seqs]
        loss = sum((lp * w).sum() for lp, w in zip(logps, weights, strict=True))
        loss.backward()  # type: ignore[union-attr]
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, expected = grads(tree=True), grads(tree=False)
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()), msg=name)


def test_many_trees_per_batch() -> None:
    model = tiny_model("llama")
    rng = random.Random(3)
    seqs = [[rng.randrange(1, 101) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    seqs += [[*s, 5, 6] for s in seqs]
    with torch.no_grad():
        got = treetrain.tree_logprobs(model, seqs, max_tokens_per_mb=48, attention="sparse")
        for s, g in zip(seqs, got, strict=True):
            torch.testing.assert_close(g, _alone(model, s), rtol=0, atol=1e-4)


def test_bad_input_is_refused() -> None:
    model = tiny_model("llama")
    with pytest.raises(PackingError, match="sequence 1 is empty"):
        treetrain.tree_logprobs(model, [[1, 2], []], max_tokens_per_mb=128)
    with pytest.raises(PackingError, match="sequence 0 has 200 tokens"):
        treetrain.tree_logprobs(model, [[1] * 200], max_tokens_per_mb=128)
    with pytest.raises(PackingError, match="multiple of 16"):
        treetrain.tree_logprobs(model, [[1, 2]], max_tokens_per_mb=100)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        treetrain.tree_logprobs(model, [[1, 2]], max_tokens_per_mb=128, attention="fast")
    assert treetrain.tree_logprobs(model, [], max_tokens_per_mb=128) == []


def test_import_treetrain_stays_torch_free() -> None:
    code = "import sys, treetrain, treetrain.tree, treetrain.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert callable(treetrain.tree_logprobs)


def test_entropy_parity() -> None:
    from treetrain.logprob import tree_logprobs_entropy

    model = tiny_model("qwen3")
    seqs = _batch(4)
    with torch.no_grad():
        logps, ents = tree_logprobs_entropy(model, seqs, max_tokens_per_mb=128, attention="sparse")
        for s, lp, ent in zip(seqs, logps, ents, strict=True):
            logits = model(input_ids=torch.tensor([s]), use_cache=False).logits[0, :-1].float()
            lsm = torch.log_softmax(logits, -1)
            torch.testing.assert_close(ent, -(lsm.exp() * lsm).sum(-1), rtol=0, atol=1e-4)
            torch.testing.assert_close(lp, lsm.gather(1, torch.tensor(s[1:])[:, None])[:, 0], rtol=0, atol=1e-4)


def test_extra_per_token_tensors_pack_with_the_sequences() -> None:
    # A policy-gradient loss with per-sequence advantages and a loss mask, computed in the packed
    # layout of each tree, equals the same loss over unpacked sequences.
    from treetrain.attention import TreeAttentionMeta, tree_forward, use_tree_attention
    from treetrain.logprob import TreeTensors, pack_sequence_tensors, unpack_sequence_tensors
    from treetrain.tree import PackConfig, pack

    model = tiny_model("llama")
    seqs = _batch(5)
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(len(s) - 1, generator=g) for s in seqs]
    mask = [(torch.rand(len(s) - 1, generator=g) > 0.3).float() for s in seqs]
    with torch.no_grad():
        expected = sum((_alone(model, s) * a * m).sum() for s, a, m in zip(seqs, adv, mask, strict=True))
        batch = pack(seqs, PackConfig(max_tokens_per_mb=96, block_size=16))
        assert batch.stats.num_trees > 1
        use_tree_attention(model)
        total = torch.zeros(())
        for tree in batch.trees:
            t = TreeTensors.from_tree(tree, torch.device("cpu"))
            meta = TreeAttentionMeta.from_tree(tree, backend="sparse", block_size=16, device=torch.device("cpu"))
            with tree_forward():
                logits = model(
                    input_ids=t.input_ids_N[None], position_ids=t.position_ids_N[None], tree_attention=meta
                ).logits[0]
            logp, _ = gather_logprobs(logits, t.pred_M, t.label_M)
            adv_flat, mask_flat = pack_sequence_tensors(tree, adv), pack_sequence_tensors(tree, mask)
            total = total + (logp * adv_flat * mask_flat).sum()
            back = unpack_sequence_tensors(tree, adv_flat, [len(s) - 1 for s in seqs])
            for i, value in back.items():
                assert torch.equal(value, adv[i])
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_checkpointing_recomputes_tree_attention(backend: str) -> None:
    # Recomputation in backward replays the layer call with the same tree_attention keyword,
    # so checkpointed gradients equal plain ones.
    seqs = _batch(6)

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = tiny_model("qwen2").train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        logps = treetrain.tree_logprobs(model, seqs, max_tokens_per_mb=128, attention=backend)
        torch.stack([lp.sum() for lp in logps]).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    for name, ref in plain.items():
        torch.testing.assert_close(checkpointed[name], ref, msg=name)


@st.composite
def _token_tries(draw: st.DrawFn) -> list[list[int]]:
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, 6))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            seq = base[: draw(st.integers(0, len(base)))] + draw(st.lists(st.integers(1, 100), max_size=20))
        else:
            seq = draw(st.lists(st.integers(1, 100), min_size=1, max_size=30))
        seqs.append(seq or [1])
    return seqs


@functools.cache
def _property_model() -> torch.nn.Module:
    return tiny_model("qwen3", seed=5)  # type: ignore[no-any-return]


# The autouse block-size fixture is function-scoped; it sets the same value for every example.
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=_token_tries(), backend=st.sampled_from(BACKENDS))
def test_property_parity_on_random_tries(seqs: list[list[int]], backend: str) -> None:
    model = _property_model()
    with torch.no_grad():
        got = treetrain.tree_logprobs(model, seqs, max_tokens_per_mb=64, attention=backend)
        for s, g in zip(seqs, got, strict=True):
            torch.testing.assert_close(g, _alone(model, s), rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_branch_at_every_offset_across_block_boundaries(backend: str) -> None:
    # 16-token blocks: the branch point walks over offsets 12..35, across the boundaries at 16 and 32,
    # and the children (one short, one long, one a prefix of the shared part) straddle them too.
    model = _property_model()
    rng = random.Random(9)
    shared = [rng.randrange(1, 101) for _ in range(40)]
    with torch.no_grad():
        for depth in range(12, 36):
            seqs = [[*shared[:depth], 7, 8, 9], shared[:depth] + [rng.randrange(1, 101) for _ in range(21)]]
            seqs.append(shared[: depth - 5])
            got = treetrain.tree_logprobs(model, seqs, max_tokens_per_mb=128, attention=backend)
            for s, g in zip(seqs, got, strict=True):
                torch.testing.assert_close(g, _alone(model, s), rtol=0, atol=1e-4, msg=f"branch at {depth}")
