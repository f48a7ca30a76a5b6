"""On-policy distillation (``grpo.distillation``): a frozen teacher scores the student's samples.

The teacher is a second :class:`core.policy.Policy` built without an optimizer or reference
weights, on the student's backend and layout, sharing the student's Ray bundles (one more
colocated worker group).  Every step it computes ``get_logprobs`` on the training batch --
the student's own rollouts -- and the per-token reverse KL to it trains the student, as one
of two terms (``grpo.distillation.mode``):

* ``reward`` (Thinking Machines 2025, "On-Policy Distillation"; the tinker cookbook's
  per-token reward with discount 0)::

      A_t += coef * (log p_teacher(x_t) - log p_student(x_t))

  on every generated token; the clipped policy gradient then follows the negative reverse KL
  as a dense reward.  ``log p_student`` is the *sampling* logprob (``generation_logprobs``):
  the distribution the token was actually drawn from, which is what the reverse KL's
  single-sample estimate needs, and it costs no extra forward pass.
* ``loss`` (GKD's on-policy reverse KL, Agarwal et al. 2024, on the sampled tokens only):
  the teacher's logprobs take the reference's place in ``ClippedPGLossFn``'s KL term,
  ``coef * mean_t k2(log p_student - log p_teacher)``; k2's gradient on the student's samples
  is the reverse KL's (the config refuses k1 / k3).

``task_advantages: false`` zeroes GRPO's group advantages first: the teacher alone trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from core.config import ConfigError
from core.models.builtin import builtin_tokenizer, is_builtin
from core.policy.config import PolicyConfig
from core.policy.preflight import model_vocab_size
from core.reporting import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from core.algorithms.config import DistillationConfig, GRPORunConfig
    from core.algorithms.grpo_run import GRPORun
    from core.algorithms.timing import StepTimer
    from core.data import BatchedDataDict
    from core.distributed import RayVirtualCluster
    from core.policy import Policy

logger = get_logger(__name__)

TEACHER_FIELD = "grpo.distillation.teacher_model_name"


# ----------------------------------------------------------------------------- driver-side checks
def load_teacher_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The teacher's own tokenizer, by its model name (built-in, local path or hub id)."""
    if is_builtin(name):
        return builtin_tokenizer(name, TEACHER_FIELD)
    from transformers import AutoTokenizer

    from core.policy.preflight import check_model_path

    check_model_path(name, TEACHER_FIELD)
    return AutoTokenizer.from_pretrained(name)


def check_teacher(cfg: GRPORunConfig, student_tokenizer: PreTrainedTokenizerBase) -> None:
    """The vocabulary check of an enabled ``grpo.distillation`` (a no-op otherwise), from the
    models' names alone: it runs before any model is built or worker started."""
    name = cfg.grpo.distillation.teacher_model_name
    if not cfg.grpo.distillation.enabled or name is None:
        return
    check_teacher_tokenizer(
        student_tokenizer,
        load_teacher_tokenizer(name),
        name,
        model_vocab_size(cfg.policy.model_name),
        model_vocab_size(name),
    )


def check_teacher_tokenizer(
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    teacher_name: str,
    student_vocab: int | None,
    teacher_vocab: int | None,
) -> None:
    """The teacher must read the student's token ids as the same tokens: equal vocabularies
    (token -> id), and a model vocab_size (``*_vocab``: from each model's config, None where
    unknown offline -- the teacher Policy's preflight checks a hub model's) covering every id
    the student can sample.  :class:`ConfigError` naming the field and both sizes otherwise."""
    student_tokens, teacher_tokens = student.get_vocab(), teacher.get_vocab()
    sizes = (
        f"student: tokenizer {len(student_tokens)} tokens, model vocab_size {_size(student_vocab)}; "
        f"teacher {teacher_name!r}: tokenizer {len(teacher_tokens)} tokens, model vocab_size {_size(teacher_vocab)}"
    )
    if student_tokens != teacher_tokens:
        differ = sorted(set(student_tokens.items()) ^ set(teacher_tokens.items()))[:3]
        raise ConfigError(
            f"{TEACHER_FIELD}: the teacher's tokenizer differs from the student's ({sizes}; e.g. "
            f"{', '.join(f'{tok!r}->{i}' for tok, i in differ)}): distillation compares the two models' "
            "logprobs of the same token ids, so they must share one vocabulary"
        )
    needed = student_vocab if student_vocab is not None else len(student_tokens)
    if teacher_vocab is not None and teacher_vocab < needed:
        raise ConfigError(
            f"{TEACHER_FIELD}: the teacher model's vocab_size is below the ids the student can sample ({sizes})"
        )


def _size(vocab: int | None) -> str:
    return "unknown offline" if vocab is None else str(vocab)


def teacher_policy_config(student: PolicyConfig, teacher_model: str) -> PolicyConfig:
    """The teacher's ``policy`` section: the student's (backend, layout, precision, batch
    sizes, and the sampling temperature both are scored at) with the teacher's weights and no
    optimizer -- it never trains."""
    return student.model_copy(update={"model_name": teacher_model, "optimizer": None, "scheduler": None}, deep=True)


def teacher_is_reference(cfg: GRPORunConfig) -> bool:
    """Whether the teacher's logprobs fill the KL term's reference slot (``mode: loss``): the
    student then keeps no reference weights of its own and skips the reference pass."""
    distill = cfg.grpo.distillation
    return bool(distill.enabled and distill.mode == "loss")


# ----------------------------------------------------------------------------- the step's term
def distillation_mask(data: BatchedDataDict) -> torch.Tensor:
    """[B, S] float: the generated tokens of the rows in the loss (token_mask x sample_mask)."""
    return data["token_mask"].float() * data["sample_mask"].float()[:, None]


def reward_advantages(
    advantages: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> torch.Tensor:
    """``advantages + coef * (teacher - student)`` on the masked tokens, 0 elsewhere (all [B, S])."""
    gap = (teacher_logprobs.float() - student_logprobs.float()) * mask
    return advantages.float() * mask + coef * gap


def distillation_metrics(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Per-token means over the masked tokens: the reverse KL's single-sample estimate
    ``log p_student - log p_teacher`` on the student's samples, and both logprobs."""
    tokens = mask.sum().clamp_min(1.0)

    def mean(x: torch.Tensor) -> float:
        return float((x.float() * mask).sum() / tokens)

    return {
        "distillation/reverse_kl_mean": mean(student_logprobs - teacher_logprobs),
        "distillation/teacher_logprob_mean": mean(teacher_logprobs),
        "distillation/student_logprob_mean": mean(student_logprobs),
    }


def apply_teacher(
    cfg: DistillationConfig, teacher: Policy, data: BatchedDataDict, timer: StepTimer
) -> dict[str, float]:
    """The teacher's pass over the step's batch (``timing/teacher_s``), then the mode's term
    written into ``data``: the advantages (reward) or ``reference_policy_logprobs`` (loss)."""
    teacher.prepare_for_lp_inference()
    with timer("teacher"):
        teacher_lp = teacher.get_logprobs(data)["logprobs"]
    if teacher_lp.shape != data["input_ids"].shape:  # a contract break, not bad input: fail loudly
        raise RuntimeError(f"teacher logprobs {tuple(teacher_lp.shape)} != batch {tuple(data['input_ids'].shape)}")
    mask = distillation_mask(data)
    student_lp = data["generation_logprobs"]
    task = data["advantages"] if cfg.task_advantages else torch.zeros_like(data["advantages"])
    if cfg.mode == "reward":
        data["advantages"] = reward_advantages(task, teacher_lp, student_lp, mask, cfg.coef)
    else:
        data["advantages"] = task
        data["reference_policy_logprobs"] = teacher_lp.float() * mask
    return distillation_metrics(teacher_lp, student_lp, mask)


def start_teacher(run: GRPORun, cluster: RayVirtualCluster, teacher_model: str) -> Policy:
    """The teacher ``Policy`` on the student's cluster (stopped with the run)."""
    from core.policy import Policy

    teacher = Policy(
        cluster,
        teacher_policy_config(run.resolved_cfg.policy, teacher_model),
        run.tokenizer,
        name_prefix="teacher",
        init_optimizer=False,
        init_reference_model=False,
    )
    run._exit.callback(teacher.shutdown)
    distill = run.cfg.grpo.distillation
    logger.info("distillation teacher up: %s (%s mode)", distill.teacher_model_name, distill.mode)
    return teacher
