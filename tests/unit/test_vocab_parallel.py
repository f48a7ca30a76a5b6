"""The vocab-parallel logprob kernel against the unsharded one, on 2 and 4 gloo CPU ranks.

Each rank builds the same seeded full logits, keeps its vocabulary slice (or a Shard(2)
DTensor of them), runs forward and backward, and compares with ``logprobs_from_logits`` /
``next_token_logprobs`` on the full logits and that kernel's gradient.  Starting processes
is the slow part (~2 s each), so every case runs inside one spawn per world size (module
fixtures) and reports back per case; a case that fails is reported with its traceback.
Cases make the same collective calls on every rank and assert only after the last one, so
a failing assertion cannot leave a peer waiting in a collective.
"""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.distributed as dist

from core.kernels.logprobs import logprobs_from_logits, next_token_logprobs
from core.kernels.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_next_token_logprobs
from core.testing.gloo_ranks import init_gloo, run_ranks

B, S = 2, 5
V = 48  # divisible by 2 and 4

TOLERANCES = {  # dtype -> (rtol, atol) for logprobs and gradients
    torch.float64: (1e-12, 1e-14),
    torch.float32: (1e-6, 1e-7),
}


# ------------------------------------------------------------------------------ data


def _data(dtype, world, vocab=V, seed=0):
    """Seeded full logits [B, S, vocab], target ids [B, S] and loss weights [B, S]."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, S, vocab, generator=gen, dtype=torch.float64)).to(dtype)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    # Targets on both sides of every shard boundary, and the first and last ids.
    v_local = vocab // world
    edges = [0, vocab - 1] + [i for r in range(1, world) for i in (r * v_local - 1, r * v_local)]
    ids.view(-1)[: len(edges)] = torch.tensor(edges)
    weights = torch.randn(B, S, generator=gen, dtype=torch.float64)
    return logits, ids, weights


def _reference(full, ids, weights, next_token=False):
    """Unsharded logprobs and their gradient w.r.t. the full logits (fp32 for bf16 logits)."""
    x = (full.float() if full.dtype == torch.bfloat16 else full.clone()).requires_grad_()
    out = (next_token_logprobs if next_token else logprobs_from_logits)(x, ids)
    (out * weights[:, : out.shape[1]].to(out.dtype)).sum().backward()
    return out.detach(), x.grad


def _backward(out, weights):
    (out * weights[:, : out.shape[1]].to(out.dtype)).sum().backward()


def _shard_range(rank, world, vocab=V):
    v_local = vocab // world
    return rank * v_local, (rank + 1) * v_local


def _close(actual, expected, rtol, atol, what):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------ cases
# Each case runs on every rank: case(rank, world).


def _plain_case(dtype, next_token=False, chunk_size=None, group="world"):
    def case(rank, world):
        full, ids, weights = _data(dtype, world)
        start, end = _shard_range(rank, world)
        local = full[..., start:end].clone().requires_grad_()
        before = local.detach().clone()
        fn = vocab_parallel_next_token_logprobs if next_token else vocab_parallel_logprobs
        pg = dist.group.WORLD if group == "world" else None
        out = fn(local, ids, pg, start, end, chunk_size=chunk_size)
        _backward(out, weights)

        ref, ref_grad = _reference(full, ids, weights, next_token)
        assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
        assert local.grad.dtype == dtype
        torch.testing.assert_close(local.detach(), before, rtol=0, atol=0)  # inputs untouched
        if dtype == torch.bfloat16:
            # The kernel upcasts exactly the bf16 values the reference upcasts, so the
            # logprobs agree to fp32 accuracy; only the gradient is rounded to bf16 (~2^-8).
            _close(out, ref, 1e-6, 1e-6, "logprobs")
            _close(local.grad.float(), ref_grad[..., start:end], 1e-2, 1e-5, "grad")
        else:
            rtol, atol = TOLERANCES[dtype]
            _close(out, ref, rtol, atol, "logprobs")
            _close(local.grad, ref_grad[..., start:end], rtol, atol, "grad")

    return case


def _mesh(world, shape=None):
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(world)
    return DeviceMesh("cpu", ranks if shape is None else ranks.reshape(shape))


def _dtensor_case(placement, next_token=False, dtensor_ids=False):
    def case(rank, world):
        from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

        mesh = _mesh(world)
        full, ids, weights = _data(torch.float32, world)
        logits = distribute_tensor(full, mesh, [_placement(placement)]).requires_grad_()
        targets = distribute_tensor(ids, mesh, [Replicate()]) if dtensor_ids else ids
        fn = vocab_parallel_next_token_logprobs if next_token else vocab_parallel_logprobs
        out = fn(logits, targets)
        _backward(out, weights)
        grad = logits.grad
        grad_full = grad.full_tensor()  # a collective: before any assertion

        ref, ref_grad = _reference(full, ids, weights, next_token)
        assert type(out) is torch.Tensor, type(out)  # a plain tensor, not a DTensor
        assert isinstance(grad, DTensor) and grad.placements == logits.placements, grad
        rtol, atol = TOLERANCES[torch.float32]
        _close(out, ref, rtol, atol, "logprobs")
        _close(grad_full, ref_grad, rtol, atol, "grad")

    return case


def _case_backward_has_no_collectives(rank, world):
    full, ids, weights = _data(torch.float32, world)
    start, end = _shard_range(rank, world)
    local = full[..., start:end].clone().requires_grad_()
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        out = vocab_parallel_logprobs(local, ids, dist.group.WORLD, start, end)
        forward_calls = len(calls)
        _backward(out, weights)
    finally:
        dist.all_reduce = real
    assert forward_calls == 2, forward_calls  # MAX, then one stacked SUM
    assert len(calls) == forward_calls, "backward communicated"


def _case_out_of_range_targets_are_nan(rank, world):
    full, ids, _ = _data(torch.float32, world)
    ids[0, -1], ids[1, -1] = -1, V
    start, end = _shard_range(rank, world)
    out = vocab_parallel_logprobs(full[..., start:end], ids, dist.group.WORLD, start, end)
    assert torch.isnan(out[:, -1]).all(), out
    _close(out[:, :-1], logprobs_from_logits(full[:, :-1], ids[:, :-1]), 1e-6, 1e-7, "valid targets")


def _case_empty_batch(rank, world):
    start, end = _shard_range(rank, world)
    local = torch.zeros(0, S, end - start, requires_grad=True)
    out = vocab_parallel_logprobs(local, torch.zeros(0, S, dtype=torch.long), None, start, end)
    out.sum().backward()
    assert out.shape == (0, S) and local.grad.shape == local.shape


def _case_dtensor_errors(rank, world):
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = _mesh(world)
    odd_vocab = V + 1  # not divisible by the mesh size (DTensor allows uneven shards)
    full, ids, _ = _data(torch.float32, world, vocab=odd_vocab)
    with pytest.raises(ValueError, match=f"vocab size {odd_vocab} is not divisible by the mesh size {world}"):
        vocab_parallel_logprobs(distribute_tensor(full, mesh, [Shard(2)]), ids)

    full, ids, _ = _data(torch.float32, world)
    sharded = distribute_tensor(full, mesh, [Shard(2)])
    with pytest.raises(ValueError, match="taken from the DTensor's mesh"):
        vocab_parallel_logprobs(sharded, ids, vocab_start=0, vocab_end=V)
    with pytest.raises(ValueError, match=r"target ids shape \(2, 4\) does not match logits \[B, S\] = \(2, 5\)"):
        vocab_parallel_logprobs(sharded, ids[:, :4])
    with pytest.raises(ValueError, match="must be Shard.2. .vocab. or Replicate"):
        vocab_parallel_logprobs(distribute_tensor(full, mesh, [Shard(1)]), ids)
    partial = DTensor.from_local(full, mesh, [Partial()])
    with pytest.raises(ValueError, match="must be Shard.2. .vocab. or Replicate"):
        vocab_parallel_logprobs(partial, ids)

    mesh_2d = _mesh(world, shape=(1, world))
    on_2d = distribute_tensor(full, mesh_2d, [Shard(0), Shard(2)])
    with pytest.raises(ValueError, match=r"2-D mesh \(1, \d\).*1-D tensor-parallel mesh"):
        vocab_parallel_logprobs(on_2d, ids)


CASES_2 = {
    "plain_fp32": _plain_case(torch.float32),
    "plain_fp32_chunked": _plain_case(torch.float32, chunk_size=3),
    "plain_fp32_default_group": _plain_case(torch.float32, group=None),
    "plain_fp64": _plain_case(torch.float64),
    "plain_fp64_chunked": _plain_case(torch.float64, chunk_size=4),
    "plain_bf16": _plain_case(torch.bfloat16, chunk_size=3),
    "next_token_fp32": _plain_case(torch.float32, next_token=True),
    "next_token_fp64_chunked": _plain_case(torch.float64, next_token=True, chunk_size=3),
    "dtensor_shard2": _dtensor_case("shard2"),
    "dtensor_shard_neg1": _dtensor_case("shard-1"),
    "dtensor_next_token_dtensor_ids": _dtensor_case("shard2", next_token=True, dtensor_ids=True),
    "dtensor_replicate_fallback": _dtensor_case("replicate"),
    "backward_has_no_collectives": _case_backward_has_no_collectives,
    "out_of_range_targets_are_nan": _case_out_of_range_targets_are_nan,
    "empty_batch": _case_empty_batch,
    "dtensor_errors": _case_dtensor_errors,
}
CASES_4 = {
    name: CASES_2[name]
    for name in ("plain_fp32_chunked", "plain_fp64", "plain_bf16", "next_token_fp32", "dtensor_shard2")
}


def _placement(spec):
    from torch.distributed.tensor import Replicate, Shard

    return {"shard2": Shard(2), "shard-1": Shard(-1), "replicate": Replicate()}[spec]


# ------------------------------------------------------------------------------ spawning


def _worker(rank, world, port, results, case_names):
    """Child process: run the named cases in order and put (rank, {name: error or None})."""
    report = {}
    try:
        init_gloo(rank, world, port)
        cases = CASES_2 if world == 2 else CASES_4
        for name in case_names:
            try:
                cases[name](rank, world)
                report[name] = None
            except Exception:
                report[name] = traceback.format_exc()
    except Exception:
        report["<setup>"] = traceback.format_exc()
    finally:
        results.put((rank, report))


def _run_ranks(world, case_names):
    """Spawn ``world`` ranks running the cases -> {rank: {case: traceback or None}}."""
    return run_ranks(_worker, world, (list(case_names),))


def _assert_case(reports, name):
    assert all("<setup>" not in r for r in reports.values()), reports
    errors = {rank: r[name] for rank, r in sorted(reports.items()) if r[name] is not None}
    assert not errors, "\n".join(f"--- rank {rank}:\n{tb}" for rank, tb in errors.items())


@pytest.fixture(scope="module")
def two_ranks():
    return _run_ranks(2, CASES_2)


@pytest.fixture(scope="module")
def four_ranks():
    return _run_ranks(4, CASES_4)


@pytest.mark.parametrize("name", list(CASES_2))
def test_two_ranks(two_ranks, name):
    _assert_case(two_ranks, name)


@pytest.mark.parametrize("name", list(CASES_4))
def test_four_ranks(four_ranks, name):
    _assert_case(four_ranks, name)


# ------------------------------------------------------------------------------ errors
# Validation happens before any collective, so these need no process group.


def test_wrong_target_shape_names_the_shapes():
    logits = torch.zeros(2, 5, 8)
    with pytest.raises(ValueError, match=r"target ids shape \(2, 4\) does not match logits \[B, S\] = \(2, 5\)"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 4, dtype=torch.long), None, 0, 8)
    with pytest.raises(ValueError, match=r"target ids shape \(10,\)"):
        vocab_parallel_next_token_logprobs(logits, torch.zeros(10, dtype=torch.long), None, 0, 8)


def test_logits_must_be_3d():
    with pytest.raises(ValueError, match=r"logits must be \[B, S, V\].*\(10, 8\)"):
        vocab_parallel_logprobs(torch.zeros(10, 8), torch.zeros(10, dtype=torch.long), None, 0, 8)


def test_plain_logits_need_a_matching_vocab_range():
    logits, ids = torch.zeros(2, 5, 8), torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="need vocab_start and vocab_end"):
        vocab_parallel_logprobs(logits, ids)
    with pytest.raises(ValueError, match=r"\[8, 24\) has 16 ids but the local logits shape \(2, 5, 8\) has 8"):
        vocab_parallel_logprobs(logits, ids, None, 8, 24)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        vocab_parallel_logprobs(logits, ids, None, 0, 8, chunk_size=0)
