"""On-policy distillation's driver-side parts (``grpo.distillation``) without workers: the
per-token advantage and metrics against hand values, both modes' batch keys, the config's
rules, the vocabulary check before anything starts, and the placement of the teacher."""

from __future__ import annotations

import pytest
import torch

from core.algorithms.config import DistillationConfig, GRPORunConfig
from core.algorithms.distillation import (
    apply_teacher,
    check_teacher_tokenizer,
    distillation_metrics,
    reward_advantages,
    teacher_is_reference,
    teacher_policy_config,
)
from core.algorithms.grpo import logprob_passes
from core.algorithms.placement import colocated_groups
from core.algorithms.timing import StepTimer
from core.config import EMBEDDED_CONFIGS, ConfigError, load_config
from core.data import BatchedDataDict
from core.models.char_tokenizer import char_tokenizer

DISTILL = EMBEDDED_CONFIGS["grpo"].parent / "distill_arithmetic.yaml"
#: grpo.distillation.mode=loss and what it requires of the KL term.
LOSS_MODE = (
    "grpo.distillation.mode=loss",
    "loss_fn.reference_policy_kl_type=k2",
    "loss_fn.kl_output_clamp_value=null",
    "grpo.distillation.coef=0.5",
)

# Two rows, 4 columns: column 0 is the prompt, row 1 is masked out of the loss (sample_mask 0).
TEACHER = torch.tensor([[0.0, -0.5, -1.0, 0.0], [0.0, -2.0, -0.1, -0.3]])
STUDENT = torch.tensor([[0.0, -1.5, -0.25, 0.0], [0.0, -0.5, -0.6, -0.2]])
TOKEN_MASK = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
SAMPLE_MASK = torch.tensor([1.0, 0.0])


def _batch() -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.ones(2, 4, dtype=torch.long),
        token_mask=TOKEN_MASK.clone(),
        sample_mask=SAMPLE_MASK.clone(),
        advantages=torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, -1.0, -1.0, -1.0]]),
        generation_logprobs=STUDENT.clone(),
    )


class FakeTeacher:
    def __init__(self) -> None:
        self.calls = 0

    def prepare_for_lp_inference(self) -> None:
        pass

    def get_logprobs(self, data):
        self.calls += 1
        return BatchedDataDict(logprobs=TEACHER.clone())


def _distill_cfg(**kw) -> DistillationConfig:
    fields = {"enabled": True, "teacher_model_name": "teacher", "mode": "reward", "coef": 1.0, "task_advantages": True}
    return DistillationConfig.coerce(fields | kw, "grpo.distillation")


# ----------------------------------------------------------------------------- the per-token term
def test_reward_advantage_is_the_teacher_student_gap_per_token():
    mask = TOKEN_MASK * SAMPLE_MASK[:, None]
    adv = reward_advantages(torch.zeros(2, 4), TEACHER, STUDENT, mask, coef=2.0)
    # row 0: 2 x (-0.5 - -1.5) = 2.0, 2 x (-1.0 - -0.25) = -1.5; prompt, padding and row 1: 0
    assert adv.tolist() == [[0.0, 2.0, -1.5, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_metrics_are_per_token_means_over_the_trained_tokens():
    mask = TOKEN_MASK * SAMPLE_MASK[:, None]
    m = distillation_metrics(TEACHER, STUDENT, mask)
    assert m["distillation/reverse_kl_mean"] == pytest.approx((-1.0 + 0.75) / 2)
    assert m["distillation/teacher_logprob_mean"] == pytest.approx(-0.75)
    assert m["distillation/student_logprob_mean"] == pytest.approx(-0.875)


@pytest.mark.parametrize("task", [True, False])
def test_reward_mode_adds_to_or_replaces_the_group_advantages(task):
    data, teacher, timer = _batch(), FakeTeacher(), StepTimer()
    metrics = apply_teacher(_distill_cfg(task_advantages=task), teacher, data, timer)
    base = 0.5 if task else 0.0
    assert data["advantages"].tolist() == [[0.0, base + 1.0, base - 0.75, 0.0], [0.0] * 4]
    assert "reference_policy_logprobs" not in data and teacher.calls == 1
    assert "timing/teacher_s" in timer.metrics() and "distillation/reverse_kl_mean" in metrics


def test_loss_mode_puts_the_teacher_in_the_reference_slot():
    data = _batch()
    apply_teacher(_distill_cfg(mode="loss", task_advantages=False), FakeTeacher(), data, StepTimer())
    assert torch.equal(data["reference_policy_logprobs"], TEACHER * TOKEN_MASK * SAMPLE_MASK[:, None])
    assert data["advantages"].abs().sum() == 0  # the teacher alone trains


def test_loss_mode_skips_the_students_reference_pass():
    """With the teacher in the reference's place the student makes no reference pass, and (its
    rollout batch one global batch) no old-logprob pass either: no call to the workers at all."""
    from core.algorithms.grpo_setup import grpo_loss_fn

    cfg = load_config(DISTILL, [*LOSS_MODE, "grpo.fuse_old_logprobs=true"], schema=GRPORunConfig)
    loss_fn = grpo_loss_fn(cfg)
    assert teacher_is_reference(cfg) and loss_fn.uses_reference  # the KL term, against the teacher
    assert loss_fn.old_logprobs == "forward"  # 32 prompts x 8 samples = one global batch of 256
    assert logprob_passes(loss_fn, cfg) == (False, False)
    reward = load_config(DISTILL, ["grpo.fuse_old_logprobs=true"], schema=GRPORunConfig)
    assert not teacher_is_reference(reward) and logprob_passes(grpo_loss_fn(reward), reward)[1] is False  # no KL


# ----------------------------------------------------------------------------- config
def test_the_shipped_distillation_config_is_valid_and_its_loss_mode_takes_the_coef():
    from core.algorithms.grpo_setup import grpo_loss_fn

    cfg = load_config(DISTILL, schema=GRPORunConfig)
    assert cfg.grpo.distillation.enabled and cfg.grpo.distillation.mode == "reward"
    assert not grpo_loss_fn(cfg).uses_reference  # reward mode, no KL term
    loss = load_config(DISTILL, ["grpo.distillation.mode=loss", "loss_fn.reference_policy_kl_type=k2",
                                 "loss_fn.kl_output_clamp_value=null", "grpo.distillation.coef=0.5"],
                       schema=GRPORunConfig)  # fmt: skip
    assert grpo_loss_fn(loss).cfg.reference_policy_kl_penalty == 0.5
    assert (
        colocated_groups(cfg) == 3
        and colocated_groups(load_config(EMBEDDED_CONFIGS["grpo"], schema=GRPORunConfig)) == 2
    )
    teacher = teacher_policy_config(cfg.policy, "/models/teacher")
    assert teacher.model_name == "/models/teacher" and teacher.optimizer is None and teacher.scheduler is None
    assert teacher.generation == cfg.policy.generation  # scored at the student's sampling temperature


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["grpo.distillation.teacher_model_name=null"], "grpo.distillation.teacher_model_name: required when"),
        (["grpo.distillation.coef=0"], "grpo.distillation.coef: "),
        (["grpo.distillation.mode=topk"], "grpo.distillation.mode: expected one of 'reward', 'loss'"),
        (
            ["grpo.distillation.mode=loss", "loss_fn.reference_policy_kl_penalty=0.1",
             "loss_fn.reference_policy_kl_type=k2"],
            "loss_fn.reference_policy_kl_penalty: must be 0 with grpo.distillation.mode: loss",
        ),
        (["grpo.distillation.mode=loss"], "loss_fn.reference_policy_kl_type: must be k2 with grpo.distillation.mode"),
        (
            ["grpo.distillation.mode=loss", "loss_fn.reference_policy_kl_type=k2"],
            "loss_fn.kl_output_clamp_value: must be null with grpo.distillation.mode: loss, got 10.0: a clamped k2 "
            "has no gradient on tokens whose log-ratio to the teacher exceeds sqrt(2 x 10.0) = 4.47",
        ),
        (
            ["grpo.async_grpo.enabled=true", "policy.generation.colocated.enabled=false",
             "loss_fn.use_importance_sampling_correction=true"],
            "grpo.distillation.enabled: not supported with grpo.async_grpo.enabled",
        ),
    ],
)  # fmt: skip
def test_bad_distillation_configs_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DISTILL, overrides, schema=GRPORunConfig)
    assert message in str(err.value)


# ----------------------------------------------------------------------------- the vocabulary check
def _other_tokenizer():
    """The character tokenizer with one more token: another vocabulary."""
    tok = char_tokenizer()
    tok.add_tokens(["#"])
    return tok


def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes():
    with pytest.raises(ConfigError) as err:
        check_teacher_tokenizer(char_tokenizer(), _other_tokenizer(), "other/teacher", 32, 64)
    text = str(err.value)
    assert text.startswith("grpo.distillation.teacher_model_name: the teacher's tokenizer differs")
    assert "student: tokenizer 21 tokens, model vocab_size 32" in text
    assert "teacher 'other/teacher': tokenizer 22 tokens, model vocab_size 64" in text and "'#'->21" in text


def test_a_teacher_whose_embedding_is_smaller_than_the_students_is_refused():
    check_teacher_tokenizer(char_tokenizer(), char_tokenizer(), "t", 32, 32)  # equal: fine
    with pytest.raises(ConfigError, match="teacher model's vocab_size is below the ids the student can sample"):
        check_teacher_tokenizer(char_tokenizer(), char_tokenizer(), "t", 32, 24)


def test_setup_refuses_another_vocabulary_before_building_or_starting_anything(tmp_path):
    from core.algorithms.grpo_setup import setup_grpo

    teacher = tmp_path / "teacher"
    _other_tokenizer().save_pretrained(teacher)
    cfg = load_config(
        DISTILL,
        [f"grpo.distillation.teacher_model_name={teacher}", f"logger.log_dir={tmp_path}/logs",
         f"checkpointing.checkpoint_dir={tmp_path}/ckpt"],
        schema=GRPORunConfig,
    )  # fmt: skip

    def resolve(*args, **kwargs):
        raise AssertionError("the vocabulary check must come before any model is built")

    with pytest.raises(ConfigError, match="the teacher's tokenizer differs from the student's"):
        setup_grpo(cfg, resolve=resolve)
