"""What each ``dualrl`` training command does: check the config, make the model loadable
(building a built-in one, which for ``builtin:arithmetic-llama`` is itself a warm-start SFT
run), set up, train, report, shut down; and ``dualrl eval`` (:func:`run_eval`), which
evaluates a checkpoint or a model the same way GRPO validates.

The set-up functions take the model resolver as an argument; this module is where the
commands hand them :func:`core.algorithms.warm_start.resolve_model`, so the warm start sits
above the algorithms it runs instead of in an import cycle with them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from core.algorithms.config import DPORunConfig, GRPORunConfig, SFTRunConfig
from core.algorithms.dpo import dpo_train, setup_dpo
from core.algorithms.eval_run import EvalRequest, EvalResult
from core.algorithms.eval_run import run_eval as _run_eval
from core.algorithms.grpo_setup import GRPORun, grpo_train, setup_grpo
from core.algorithms.sft import setup_sft, sft_train
from core.algorithms.training_run import TrainingRun, execute
from core.algorithms.warm_start import resolve_model
from core.reporting import get_logger

logger = get_logger(__name__)


def run_grpo(cfg: GRPORunConfig | Mapping[str, Any]) -> GRPORun:
    """What ``dualrl grpo`` does.  Returns the (closed) run."""
    run, summary = execute(lambda: setup_grpo(cfg, resolve=resolve_model), grpo_train, _generation_kind)
    logger.info("%s", summary)
    return run


def run_sft(cfg: SFTRunConfig | Mapping[str, Any], *, exclude: frozenset[str] = frozenset()) -> TrainingRun:
    """What ``dualrl sft`` does.  Returns the (closed) run."""
    run, summary = execute(lambda: setup_sft(cfg, resolve=resolve_model, exclude=exclude), sft_train, _nothing)
    logger.info("%s", summary)
    return run


def run_dpo(cfg: DPORunConfig | Mapping[str, Any]) -> TrainingRun:
    """What ``dualrl dpo`` does.  Returns the (closed) run."""
    run, summary = execute(lambda: setup_dpo(cfg, resolve=resolve_model), dpo_train, _nothing)
    logger.info("%s", summary)
    return run


def run_eval(cfg: GRPORunConfig | Mapping[str, Any], request: EvalRequest) -> EvalResult:
    """What ``dualrl eval`` does: the report of a checkpoint or a model (core.algorithms.eval_run)."""
    return _run_eval(cfg, request, resolve=resolve_model)


#: The entry point of each training command.
COMMANDS: dict[str, Callable[..., TrainingRun]] = {"grpo": run_grpo, "sft": run_sft, "dpo": run_dpo}


def _generation_kind(run: GRPORun) -> dict[str, str]:
    return {"generation": run.rollouts.kind if run.rollouts else "-"}


def _nothing(run: TrainingRun) -> dict[str, str]:
    return {}
