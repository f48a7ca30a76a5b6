"""The widths the JAX backend pads a micro batch's rows to (``policy.jax_cfg.padded_widths_per_doubling``).

``jax.jit`` compiles one program per shape, so rows are padded to a ladder of widths; finer
rungs pad less (a GRPO batch of 23-token rows computes 24 columns, not 32) for more programs.
The padding columns are masked: logprobs and gradients of the real tokens do not depend on
the rung.  The worker-level agreement with HF and torch at the default ladder:
``dualrl parity`` and tests/backends/test_parity.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from backends.jax_pjit import steps, widths
from backends.jax_pjit.models.layers import activation_constraint
from backends.jax_pjit.row_layouts import RowLayouts
from backends.jax_pjit.sharding import activation_constraint as make_constraint
from backends.jax_pjit.sharding import make_mesh
from core.config import ConfigError
from core.losses import ClippedPGLossFn
from core.policy.config import PolicyConfig
from tests.jax_backend.conftest import mesh_config
from tests.jax_backend.test_steps import _accumulate, _host, _on_mesh, _setup, model_dir  # noqa: F401 (fixture)
from tests.torch_backends.conftest import SEQ, pg_batch
from tests.unit.test_losses import BASE_CFG


def test_the_ladder_has_the_widths_asked_per_doubling():
    assert widths.length_buckets(256) == [16, 32, 64, 128, 256]
    assert widths.length_buckets(256, per_doubling=2) == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert widths.length_buckets(64, per_doubling=4) == [16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert widths.length_buckets(100, per_doubling=2) == [16, 24, 32, 48, 64, 96, 100]  # ends at the cap
    assert widths.length_buckets(64, multiple=6, per_doubling=2) == [18, 24, 36, 48, 66]  # rounded, deduplicated


@pytest.mark.parametrize("per_doubling", [1, 2, 4, 8])
def test_a_row_is_padded_to_the_nearest_rung_and_less_than_one_step_of_its_doubling(per_doubling):
    ladder = widths.length_buckets(1024, per_doubling=per_doubling)
    assert len(ladder) == 6 * per_doubling + 1  # 16 .. 1024: six doublings
    for n in range(1, 1025):
        width = widths.bucket_for(n, 1024, per_doubling=per_doubling)
        assert width == min(w for w in ladder if w >= n)
        assert width == 16 if n <= 16 else width < n * (1 + 1 / per_doubling), (n, width)


@pytest.mark.parametrize(("per_doubling", "width"), [(1, 32), (2, 24), (4, 24), (8, 24)])
def test_the_worker_pads_to_the_configured_ladder(per_doubling, width):
    cfg = mesh_config(2, 1)
    cfg["jax_cfg"] = {"padded_widths_per_doubling": per_doubling}
    policy = PolicyConfig.checked(cfg, 2)
    rows = RowLayouts(policy, make_mesh(policy, jax.devices()[:2]))
    assert rows.bucket(23) == width
    assert rows.bucket(17) == {1: 32, 2: 24, 4: 20, 8: 18}[per_doubling]


def test_a_value_off_the_ladder_is_refused_naming_the_field():
    cfg = mesh_config(2, 1)
    cfg["jax_cfg"] = {"padded_widths_per_doubling": 3}
    with pytest.raises(ValueError, match="padded_widths_per_doubling"):
        PolicyConfig.checked(cfg)


def test_context_parallel_refuses_a_ladder_it_cannot_split_naming_both_fields():
    # cp 8 splits a row into 16 chunks: the midpoint 24 cannot be split, the powers of two can.
    widths.check_cp_ladder(64, 8, 1, per_doubling=1)
    with pytest.raises(ValueError, match="padded_widths_per_doubling.*make_sequence_length_divisible_by=1"):
        widths.check_cp_ladder(64, 8, 1, per_doubling=2)
    widths.check_cp_ladder(64, 8, 16, per_doubling=2)  # rounded up to multiples of 16: 16, 32, 48, 64


def test_the_layout_check_refuses_the_ladder_before_any_worker_starts():
    cfg = mesh_config(1, 1, cp=8)
    cfg["max_total_sequence_length"] = 64
    with pytest.raises(
        ConfigError,
        match=r"policy\.make_sequence_length_divisible_by: sequence width 24 .*"
        r"2 per doubling \(policy\.jax_cfg\.padded_widths_per_doubling\)",
    ):
        PolicyConfig.checked(cfg, 8)
    cfg["jax_cfg"] = {"padded_widths_per_doubling": 1}
    assert PolicyConfig.checked(cfg, 8).parallel.context_parallel_size == 8
    cfg["jax_cfg"], cfg["make_sequence_length_divisible_by"] = {}, 16
    assert PolicyConfig.checked(cfg, 8).make_sequence_length_divisible_by == 16


def test_logprobs_and_gradients_do_not_depend_on_the_padded_width(model_dir):  # noqa: F811
    """The same rows (at most SEQ = 12 tokens) padded to the default ladder's midpoint rung (24)
    and to the power of two above it (32): the real tokens' logprobs, the loss and every
    gradient agree to fp32 rounding (the parity run's batch-invariance rows check a narrower
    width on every layout)."""
    _, mesh, _, apply_fn, params, _ = _setup(model_dir, 2, 1)
    data = pg_batch(4, seed=5)
    loss_fn = ClippedPGLossFn(BASE_CFG)
    step = steps.make_logprob_step(apply_fn, temperature=1.0)
    logprobs, losses, grads = {}, {}, {}
    with mesh, activation_constraint(make_constraint(mesh)):
        for width in (24, 32):
            host = steps.pad_micro_batch(_host(data), 4, width)
            dev = _on_mesh(host, mesh)
            logprobs[width] = np.asarray(step(params, dev["input_ids"], dev["input_lengths"]))[:, :SEQ]
            losses[width], acc, _ = _accumulate(apply_fn, params, loss_fn, data, 4, width, mesh)
            grads[width] = [np.asarray(g) for g in jax.tree.leaves(acc)]
    np.testing.assert_allclose(logprobs[24], logprobs[32], rtol=0, atol=1e-6)
    assert losses[24] == pytest.approx(losses[32], rel=1e-6)
    for g, ref in zip(grads[24], grads[32], strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
