"""ParallelDims: fill-in, validation messages, mesh description, policy-config mapping."""

import dataclasses
import re

import pytest

from core.parallel_dims import AXIS_NAMES, CP, DP_REPLICATE, FSDP, TP, ParallelDims


def test_axis_name_constants():
    assert (DP_REPLICATE, FSDP, CP, TP) == ("dp_replicate", "fsdp", "cp", "tp")
    assert AXIS_NAMES == (DP_REPLICATE, FSDP, CP, TP)


def test_fsdp_fills_in_by_default():
    d = ParallelDims(world_size=8, tp=2)
    assert (d.dp_replicate, d.fsdp, d.cp, d.tp) == (1, 4, 1, 2)
    assert d.dp == 4
    assert d.tp_enabled and d.fsdp_enabled and d.dp_enabled
    assert not d.cp_enabled and not d.dp_replicate_enabled


def test_build_is_keyword_constructor_and_resolved():
    d = ParallelDims.build(16, dp_replicate=2, cp=2, tp=2)
    assert d == ParallelDims(16, 2, 2, 2, 2)
    assert d.fsdp == 2 and d.dp == 4 and d.fsdp_cp == 4


def test_any_single_dimension_may_fill_in():
    d = ParallelDims.build(12, dp_replicate=-1, fsdp=2, tp=3)
    assert d.dp_replicate == 2 and d.dp == 4
    assert ParallelDims.build(6, fsdp=3, tp=-1).tp == 2


def test_no_fill_in_when_all_given():
    d = ParallelDims.build(4, fsdp=2, tp=2)
    assert d.dp == 2


def test_single_device():
    d = ParallelDims.build(1)
    assert d.fsdp == 1 and d.dp == 1
    assert not (d.dp_enabled or d.tp_enabled or d.cp_enabled or d.fsdp_enabled)
    assert d.mesh_shape() == () and d.mesh_axis_names() == ()
    assert d.mesh_shape(include_trivial=True) == (1, 1, 1, 1)


def test_mesh_shape_and_names():
    d = ParallelDims.build(8, cp=2, tp=2)
    assert d.mesh_shape() == (2, 2, 2)
    assert d.mesh_axis_names() == ("fsdp", "cp", "tp")
    assert d.mesh_shape(include_trivial=True) == (1, 2, 2, 2)
    assert d.mesh_axis_names(True) == AXIS_NAMES
    assert d.axes() == {"fsdp": 2, "cp": 2, "tp": 2}


def test_frozen():
    d = ParallelDims.build(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tp = 2  # type: ignore[misc]


def test_product_mismatch():
    with pytest.raises(ValueError, match=re.escape("fsdp (2) x cp (1) x tp (3) = 6 does not match world_size 4")):
        ParallelDims.build(4, fsdp=2, tp=3)


def test_fill_in_impossible():
    with pytest.raises(ValueError, match=r"cannot fill fsdp=-1: world_size 6 is not divisible by .*tp \(4\) = 4"):
        ParallelDims.build(6, tp=4)


def test_two_fill_ins():
    with pytest.raises(ValueError, match="at most one dimension may be -1, got fsdp and tp"):
        ParallelDims.build(4, fsdp=-1, tp=-1)


@pytest.mark.parametrize("dim", ["dp_replicate", "fsdp", "cp", "tp"])
@pytest.mark.parametrize("bad", [0, -2])
def test_non_positive_dimension(dim, bad):
    with pytest.raises(ValueError, match=rf"{dim} must be a positive integer .* got {bad}"):
        ParallelDims.build(4, **{dim: bad, **({} if dim == "fsdp" else {"fsdp": -1})})


@pytest.mark.parametrize("ws", [0, -1, 2.0, True])
def test_bad_world_size(ws):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        ParallelDims.build(ws)


def test_non_int_dimension():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        ParallelDims.build(4, tp=2.0)


def _policy(backend, tp=1, cp=1, fsdp_size=-1):
    from core.policy.config import PolicyConfig

    return PolicyConfig.coerce(
        {
            "backend": backend,
            "model_name": "m",
            "tokenizer": {"name": "m"},
            "train_global_batch_size": 8,
            "train_micro_batch_size": 1,
            "logprob_batch_size": 1,
            "max_total_sequence_length": 16,
            "precision": "float32",
            "max_grad_norm": None,
            "parallel": {"fsdp_size": fsdp_size, "tensor_parallel_size": tp, "context_parallel_size": cp},
        },
        "policy",
    )


def test_policy_config_torch_fsdp_shards_over_every_rank_and_refuses_tp():
    from core.config import ConfigError

    d = _policy("torch_fsdp").parallel_dims(4)
    assert (d.fsdp, d.tp, d.cp, d.dp) == (4, 1, 1, 4)
    with pytest.raises(ConfigError, match=r"policy\.parallel\.tensor_parallel_size: 2: the torch_fsdp backend"):
        _policy("torch_fsdp", tp=2)


def test_policy_config_dtensor():
    d = _policy("torch_dtensor", tp=2).parallel_dims(4)
    assert (d.fsdp, d.tp, d.cp, d.dp) == (2, 2, 1, 2)
    d = _policy("torch_dtensor", tp=2, cp=2).parallel_dims(8)
    assert (d.fsdp, d.cp, d.tp) == (2, 2, 2)


def test_policy_config_jax():
    d = _policy("jax_pjit", tp=2).parallel_dims(8)
    assert (d.fsdp, d.tp, d.dp) == (4, 2, 4)
    d = _policy("jax_pjit", fsdp_size=2, tp=2).parallel_dims(4)
    assert d.dp == 2
    with pytest.raises(ValueError, match="does not match world_size 8"):
        _policy("jax_pjit", fsdp_size=2, tp=2).parallel_dims(8)


def test_policy_config_unknown_backend():
    from core.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"policy\.backend: 'jax' is not a registered backend; known: \['torch_fsdp', 'torch_dtensor'"
    ):
        _policy("jax")


def test_module_does_not_import_torch_or_jax():
    import subprocess
    import sys

    code = "import sys, core.parallel_dims, core.config; print('torch' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=__file__.rsplit("/tests/", 1)[0]
    )
    assert out.stdout.split() == ["False", "False"]
