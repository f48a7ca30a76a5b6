"""Where the JAX backend stores its weights, and what it refuses on the driver.

* ``plan_placement``: a storage axis (fsdp) that does not divide a weight's preferred dimension
  moves to another dimension it divides, else the weight is replicated over it; a tensor-parallel
  axis that does not divide is a problem naming its field.
* The tiny Qwen3-MoE with 4 experts on the default JAX layout (fsdp 8) runs -- as both torch
  backends do -- and matches HF (logprobs, loss, gradient norm).
* The driver's checks (``driver_checks``) find the same problems from the HF config alone.
* The mesh's device order is logged (and a row-major fallback only for jax's expected refusals);
  a refit tensor reaches torch without a non-writable-array warning, and without a copy where
  the array is replicated.
"""

from __future__ import annotations

import logging
import warnings

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

from backends.jax_pjit import sharding
from backends.jax_pjit.param_placement import plan_placement
from core.policy.config import PolicyConfig
from tests.jax_backend.conftest import mesh_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

SIZES = {"fsdp": 8, "cp": 1, "tp": 1}


def _plan(shapes: dict, axes: dict, sizes=SIZES):
    return plan_placement(shapes, axes, sizes)


# ----------------------------------------------------------------------------- the plan
def test_experts_fsdp_does_not_divide_moves_to_the_model_dim():
    placement = _plan(
        {"gate_proj": (4, 64, 32), "down_proj": (4, 32, 64), "router": (64, 4), "embed": (256, 64)},
        {
            "gate_proj": ("expert", "expert_embed", "mlp"),
            "down_proj": ("expert", "mlp", "expert_embed"),
            "router": ("expert_embed", "expert"),
            "embed": ("vocab", "embed"),
        },
    )
    specs = dict(zip(["down_proj", "embed", "gate_proj", "router"], placement.specs, strict=True))  # sorted keys
    assert specs["gate_proj"] == PartitionSpec(None, "fsdp", None)  # the first unsplit dim fsdp divides
    assert specs["down_proj"] == PartitionSpec(None, "fsdp", None)
    assert specs["router"] == PartitionSpec("fsdp", None)
    assert specs["embed"] == PartitionSpec(None, "fsdp")  # as the rules say: nothing moved
    assert not placement.problems
    assert {path for path, _ in placement.moved} == {"gate_proj", "down_proj", "router"}
    assert "fsdp (8) does not divide 'expert' (4): stored split over fsdp along 'mlp' instead" in dict(
        placement.moved
    ).get("down_proj", "")


def test_no_dimension_divides_the_weight_is_replicated_over_fsdp():
    placement = _plan({"w": (4, 6)}, {"w": ("expert", "expert_embed")})
    assert placement.specs == (PartitionSpec(None, None),) and not placement.problems
    assert placement.moved == (
        ("w", "fsdp (8) does not divide 'expert' (4) nor any other dimension: replicated over fsdp"),
    )


def test_a_tensor_parallel_axis_that_does_not_divide_is_a_problem_naming_the_field():
    placement = _plan({"up": (64, 30)}, {"up": ("embed", "mlp")}, {"fsdp": 4, "cp": 1, "tp": 4})
    ((field, message),) = placement.problems
    assert field == "parallel.tensor_parallel_size"
    assert message.startswith("up: dim 1 ('mlp') has size 30, not divisible by mesh axis tp (4)")
    assert placement.specs == (PartitionSpec("fsdp", "tp"),)  # the plan itself still says what was asked


def test_tp_and_fsdp_share_a_dimension_only_when_both_divide():
    placement = _plan({"w": (3, 16)}, {"w": ("expert", "mlp")}, {"fsdp": 2, "cp": 1, "tp": 4})
    assert placement.specs == (PartitionSpec(None, ("tp", "fsdp")),)  # 16 = 4 x 2 x 2
    placement = _plan({"w": (3, 12)}, {"w": ("expert", "mlp")}, {"fsdp": 2, "cp": 1, "tp": 4})
    assert placement.specs == (PartitionSpec(None, "tp"),)  # 12 % 8: replicated over fsdp


# ----------------------------------------------------------------------------- the driver
def _moe_hf_config(**fields):
    from transformers import Qwen3MoeConfig

    from core.testing.tiny_models import TINY_MODELS

    base = {k: v for k, v in TINY_MODELS["qwen3_moe"].items() if k != "family"} | {"vocab_size": 256}
    return Qwen3MoeConfig(**(base | fields))


def test_driver_placement_check_plans_the_abstract_model():
    from backends.jax_pjit.driver_checks import placement_problems

    policy = PolicyConfig.checked(mesh_config(-1, 1))
    assert placement_problems(policy, _moe_hf_config(num_experts=4), policy.parallel_dims(8)) == []  # moved
    tp2 = PolicyConfig.checked(mesh_config(-1, 2))
    problems = placement_problems(tp2, _moe_hf_config(moe_intermediate_size=33), tp2.parallel_dims(8))
    assert {field for field, _ in problems} == {"parallel.tensor_parallel_size"}
    assert sorted(message.split(":")[0] for _, message in problems) == [
        f"layers/1/mlp/experts/{name}" for name in ("down_proj", "gate_proj", "up_proj")
    ]
    assert all("('mlp') has size 33, not divisible by mesh axis tp (2)" in message for _, message in problems)


# ----------------------------------------------------------------------------- 4 experts on fsdp 8
@pytest.fixture(scope="module")
def four_experts(tmp_path_factory):
    from core.testing.tiny_models import save_tiny_model

    return save_tiny_model("qwen3_moe_4e", tmp_path_factory.mktemp("moe4") / "qwen3_moe_4e")


@pytest.fixture(scope="module")
def four_experts_worker(four_experts, tokenizer):
    """The 4-expert model's worker on the default layout (fsdp over all 8 devices), and the
    placement lines it logged."""
    from backends.jax_pjit.worker import JaxPolicyWorker
    from tests.torch_backends.conftest import policy_config

    cfg = PolicyConfig.checked(policy_config(four_experts, "jax_pjit"))
    assert cfg.parallel.fsdp_size == -1
    handler = _Collect()
    log = logging.getLogger("dualrl.backends.jax_pjit.param_placement")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        worker = JaxPolicyWorker(cfg, tokenizer, init_reference_model=False)
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    return worker, handler.lines


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_four_experts_on_the_default_layout_match_hf_logprobs(four_experts, four_experts_worker):
    from transformers import AutoModelForCausalLM

    from tests.torch_backends.conftest import hf_logprobs, pg_batch

    worker, logged = four_experts_worker
    assert dict(worker.mesh.shape)["fsdp"] == 8
    specs = {sharding.path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(worker.shardings)[0]}
    assert specs["layers/1/mlp/experts/gate_proj"] == PartitionSpec(None, "fsdp", None)  # [4 experts, 64, 32]
    assert specs["layers/1/mlp/experts/down_proj"] == PartitionSpec(None, "fsdp", None)  # [4, 32, 64]
    assert any("does not divide 'expert' (4)" in line for line in logged), logged

    data = pg_batch(4, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(four_experts, dtype=torch.float32)
    expected = hf_logprobs(hf, data["input_ids"], data["input_lengths"])
    got = worker.get_logprobs(data)["logprobs"]
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.slow  # compiling the training step: ~20 s
def test_four_experts_on_the_default_layout_train_as_hf(four_experts, four_experts_worker):
    from core.losses import ClippedPGLossFn
    from tests.hf_reference import PG_CFG, reference_loss_and_norm
    from tests.torch_backends.conftest import pg_batch

    worker, _ = four_experts_worker
    data = pg_batch(4, seed=5)
    loss_fn = ClippedPGLossFn(PG_CFG)
    ref_loss, ref_norm = reference_loss_and_norm(four_experts, data, loss_fn)
    result = worker.train(data, loss_fn)
    assert result.loss[0] == pytest.approx(ref_loss, abs=1e-5)
    assert result.grad_norm[0] == pytest.approx(ref_norm, rel=1e-4)


# ----------------------------------------------------------------------------- mesh order, refit tensors
def test_make_mesh_logs_the_device_order_it_chose(caplog):
    with caplog.at_level(logging.INFO, logger="dualrl.backends.jax_pjit.sharding"):
        mesh = sharding.make_mesh(mesh_config(4, 2))
    assert dict(mesh.shape) == {"fsdp": 4, "cp": 1, "tp": 2}
    assert "jax.make_mesh's device order" in caplog.text


def test_make_mesh_falls_back_to_row_major_only_for_what_jax_refuses(monkeypatch, caplog):
    def no_topology(*args, **kwargs):
        raise ValueError("devices of several slices")

    monkeypatch.setattr(sharding.jax, "make_mesh", no_topology)
    with caplog.at_level(logging.WARNING, logger="dualrl.backends.jax_pjit.sharding"):
        mesh = sharding.make_mesh(mesh_config(4, 2))
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]
    assert "row-major order" in caplog.text and "devices of several slices" in caplog.text

    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a topology")

    monkeypatch.setattr(sharding.jax, "make_mesh", broken)
    with pytest.raises(RuntimeError, match="a bug, not a topology"):
        sharding.make_mesh(mesh_config(4, 2))


@pytest.mark.parametrize("spec", [PartitionSpec("fsdp", "tp"), PartitionSpec("fsdp"), PartitionSpec()])
@pytest.mark.parametrize("dtype", [jax.numpy.float32, jax.numpy.bfloat16])
def test_refit_tensors_reach_torch_without_a_read_only_warning(spec, dtype):
    from core.refit.packing import as_torch

    mesh = sharding.make_mesh(mesh_config(4, 2))
    values = (np.arange(64 * 8) % 128).astype(np.float32).reshape(64, 8)  # exact in bfloat16
    full = jax.device_put(jax.numpy.asarray(values, dtype), NamedSharding(mesh, spec))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" UserWarning fails the test
        tensor = as_torch(sharding.off_device(full))
    assert torch.equal(tensor.float(), torch.from_numpy(values))
    if spec == PartitionSpec():  # replicated: torch reads XLA's own buffer, no copy
        assert tensor.data_ptr() == full.addressable_data(0).unsafe_buffer_pointer()
