"""Skipped optimizer steps on the driver side (no Ray): the skip decision, the config field,
the warning and metric the loops log, and the run loop's reaction to skip / error.

The backends themselves, on every layout: tests/backends/test_non_finite_steps.py (and the JAX
jitted update's own skip: tests/jax_backend/test_non_finite_steps.py).
"""

from __future__ import annotations

import logging
import math

import pytest

from core.interfaces import TrainResult
from core.policy.worker_base import PolicyWorkerBase, StepResult, step_skip_reason
from tests.unit.test_grpo_parts import _loop


def test_step_skip_reason():
    assert step_skip_reason(4, 10, 0.5, 1.2) is None
    assert step_skip_reason(0, 0, 0.0, 0.0) == "no_valid_tokens"
    assert step_skip_reason(4, 0, 0.0, 0.0) == "no_valid_tokens"  # rows, but no trained token
    assert step_skip_reason(4, 10, math.nan, 1.0) == "non_finite_loss"
    assert step_skip_reason(4, 10, -math.inf, math.inf) == "non_finite_loss"
    assert step_skip_reason(4, 10, -1e30, math.inf) == "non_finite_grad_norm"
    assert step_skip_reason(4, 10, 0.1, math.nan) == "non_finite_grad_norm"


def _result(reasons, losses, norms) -> TrainResult:
    """A Policy.train result as a worker assembles it from its steps."""
    steps = [
        StepResult(loss, norm, {"loss": loss}, reason, {"loss": [loss]})
        for loss, norm, reason in zip(losses, norms, reasons, strict=True)
    ]
    return PolicyWorkerBase._train_steps_result(steps, 1e-3)


def test_train_result_metrics_and_messages(caplog):
    from core.algorithms.training_run import report_skipped_steps, train_metrics
    from core.policy.policy import _skip_message, describe_skipped_steps

    result = _result([None, "non_finite_grad_norm"], [0.5, -1e30], [1.0, math.inf])
    assert result.skipped == [False, True] and result.skipped_steps == 1
    assert result.metrics == {"loss": [0.5, -1e30]} and result.all_mb_metrics == {"loss": [0.5, -1e30]}
    assert train_metrics(result)["skipped_steps"] == 1.0
    assert PolicyWorkerBase._train_steps_result([], None).skipped == []
    (phrase,) = describe_skipped_steps(result)
    assert (
        phrase
        == "optimizer step 2 of 2 of this train() call skipped: non-finite grad norm (loss=-1e+30, grad_norm=inf)"
    )
    message = _skip_message(result)
    assert "policy.non_finite_step" in message and "unchanged" in message

    with caplog.at_level(logging.WARNING, logger="dualrl.core.algorithms.training_run"):
        report_skipped_steps(7, result)
        report_skipped_steps(8, _result([None], [0.5], [1.0]))
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"step 7: {phrase}; weights and optimizer state unchanged (policy.non_finite_step: skip)")
    ]
    masked = describe_skipped_steps(_result(["no_valid_tokens"], [0.0], [0.0]))
    assert masked == [
        "optimizer step 1 of 1 of this train() call skipped: the global batch has no valid token / "
        "sequence (all masked out) (loss=0, grad_norm=0)"
    ]


def test_config_field_default_and_validation():
    from core.config import ConfigError, load_raw_config
    from core.config.loader import DEFAULT_CONFIG_PATH
    from core.policy.config import PolicyConfig

    cfg = load_raw_config(DEFAULT_CONFIG_PATH)["policy"]
    del cfg["non_finite_step"]
    assert PolicyConfig.coerce(cfg, "policy").non_finite_step == "skip"  # the model's default
    assert PolicyConfig.coerce({**cfg, "non_finite_step": "error"}, "policy").non_finite_step == "error"
    with pytest.raises(ConfigError, match="policy.non_finite_step: expected one of 'skip', 'error', got 'ignore'"):
        PolicyConfig.coerce({**cfg, "non_finite_step": "ignore"}, "policy")


def test_loop_goes_on_after_a_skipped_step(tmp_path):
    """A skipped step's non-finite loss / grad norm is logged (the weights never saw it) and
    the run continues; the metric is in metrics.jsonl."""

    def step(s):
        if s == 3:
            return {"loss": -1e30, "grad_norm": math.inf, "skipped_steps": 1.0}
        return {"loss": 1.0, "grad_norm": 0.5, "skipped_steps": 0.0}

    loop, logger, ckpt = _loop(tmp_path, step)
    assert loop.run() == 5
    rows = [r for r in logger.history if r["split"] == "train"]
    assert [r["skipped_steps"] for r in rows] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert rows[2]["grad_norm"] == math.inf


def test_loop_names_the_step_of_a_non_finite_step_error(tmp_path):
    from core.algorithms.loop import NonFiniteLossError
    from core.interfaces import NonFiniteStepError

    def step(s):
        if s == 3:
            raise NonFiniteStepError("optimizer step 1 of 1 of this train() call skipped: non-finite loss")
        return {"loss": 1.0}

    loop, _, ckpt = _loop(tmp_path, step)
    with pytest.raises(NonFiniteLossError, match="step 3: optimizer step 1 of 1 .* non-finite loss") as err:
        loop.run()
    assert isinstance(err.value.__cause__, NonFiniteStepError)
    assert [p.name for p in ckpt.checkpoint_dir.glob("step_*")] == ["step_2"]
