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

Log = Callable[[str], None]


def run_grpo(cfg: GRPORunConfig | Mapping[str, Any], log: Log = print) -> GRPORun:
    """What ``dualrl grpo`` does.  Returns the (closed) run."""
    return execute(setup_grpo, grpo_train, _generation_kind, cfg, log, resolve=resolve_model)


def run_sft(
    cfg: SFTRunConfig | Mapping[str, Any], log: Log = print, *, exclude: frozenset[str] = frozenset()
) -> TrainingRun:
    """What ``dualrl sft`` does.  Returns the (closed) run."""
    return execute(setup_sft, sft_train, lambda run: {}, cfg, log, resolve=resolve_model, exclude=exclude)


def run_dpo(cfg: DPORunConfig | Mapping[str, Any], log: Log = print) -> TrainingRun:
    """What ``dualrl dpo`` does.  Returns the (closed) run."""
    return execute(setup_dpo, dpo_train, lambda run: {}, cfg, log, resolve=resolve_model)


def run_eval(cfg: GRPORunConfig | Mapping[str, Any], request: EvalRequest, log: Log = print) -> EvalResult:
    """What ``dualrl eval`` does: the report of a checkpoint or a model (core.algorithms.eval_run)."""
    return _run_eval(cfg, request, log, resolve=resolve_model)


#: The entry point of each training command.
COMMANDS: dict[str, Callable[..., TrainingRun]] = {"grpo": run_grpo, "sft": run_sft, "dpo": run_dpo}


def _generation_kind(run: GRPORun) -> dict[str, str]:
    return {"generation": run.rollouts.kind if run.rollouts else "-"}
