"""``dualrl eval``: a run checkpoint's or a model's pass@k, maj@k and mean@k on held-out prompts.

The config is a GRPO run's (by default the checkpoint's own ``config.yaml``): its prompts
(``data``, ``grpo.max_val_samples``, ``grpo.seed``), environment (``env``), generation
(``policy.generation``) and sampling plan (``grpo.val_pass_at_k`` / ``val_num_samples``, which
``--k`` / ``--num-samples`` set) are the run's, and the evaluation is GRPO's validation
(:func:`core.algorithms.evaluation.evaluate`) on the checkpoint's weights: on the run's own
validation prompts it reproduces the run's validation at that step exactly.

Checks that need no worker come first (config, dataset, checkpoint completeness, the
checkpoint's model against the config's); then a policy (no optimizer, no reference) loads
the weights, the engine gets them by refit, and the report is printed and written.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.algorithms.config import GRPORunConfig
from core.algorithms.eval_report import EvalReport, build_report, format_table, write_report
from core.algorithms.evaluation import EvalPlan, Evaluation, evaluate
from core.algorithms.run_setup import ModelResolver, load_tokenizer, run_identity, seed_everything
from core.algorithms.training_run import check_run_config
from core.checkpointing import CheckpointError, LoadedCheckpoint
from core.datasets import PromptDatum, build_prompt_datasets, build_prompt_eval_dataset
from core.models.builtin import is_builtin
from core.reporting import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from core.algorithms.multi_turn import EpisodeRunner
    from core.algorithms.rollout_engine import RolloutEngine
    from core.environments import EnvironmentPool

logger = get_logger(__name__)

#: Where the report goes without ``--out``: ``runs/eval/<label>``.
DEFAULT_OUT_ROOT = Path("runs") / "eval"
#: What a checkpoint's model must agree on with the config's to be evaluated under it.
MODEL_KEYS = ("model_name", "model_fingerprint", "backend")


@dataclass(frozen=True)
class EvalRequest:
    """What ``dualrl eval`` was asked besides the config."""

    checkpoint: LoadedCheckpoint | None = None  # None: the config's policy.model_name as it is
    dataset: str | None = None  # None: the config's validation prompts
    split: str | None = None  # of a file / hub dataset (None: data.split)
    max_prompts: int | None = None  # the first N prompts only
    output_dir: Path | None = None  # None: DEFAULT_OUT_ROOT / label


@dataclass
class EvalResult:
    """The evaluation, its report, and where the report was written."""

    evaluation: Evaluation
    report: EvalReport
    json_path: Path
    plot_path: Path


def run_eval(cfg: GRPORunConfig | Mapping[str, Any], request: EvalRequest, *, resolve: ModelResolver) -> EvalResult:
    """What ``dualrl eval`` does (``resolve``: how a built-in model name becomes a directory)."""
    cfg = check_run_config(cfg, "grpo")
    seed_everything(cfg.grpo.seed)
    tokenizer = load_tokenizer(cfg.policy)
    held_out, prompts, dataset = eval_prompts(cfg, tokenizer, request)
    resolved = resolve(cfg, held_out)
    if request.checkpoint is not None:
        check_checkpoint_model(request.checkpoint, cfg, resolved)
    label = _label(cfg, request.checkpoint)
    out_dir = request.output_dir or DEFAULT_OUT_ROOT / label
    resolved.logger.log_dir = str(out_dir)  # the workers' output goes next to the report, not into the run's logs
    with contextlib.ExitStack() as stack:
        engine, env = _start_workers(resolved, tokenizer, request.checkpoint, stack)
        start = time.perf_counter()
        engine.sync_weights()
        plan = EvalPlan.of_grpo(cfg.grpo, len(prompts))
        evaluation = evaluate(engine, env, tokenizer, prompts, plan)
        logger.info("evaluated %d prompts in %.1f s", len(prompts), time.perf_counter() - start)
    report = build_report(evaluation, _details(cfg, request, dataset))
    json_path, plot_path = write_report(report, out_dir, title=f"dualrl eval: {label} on {dataset}")
    logger.info("%s on %s\n%s", label, dataset, format_table(report))
    own = _run_validation(request.checkpoint)
    if own:
        logger.info("the run's last validation saved with this checkpoint: %s", own)
    logger.info("report: %s, %s", json_path, plot_path)
    return EvalResult(evaluation, report, json_path, plot_path)


def eval_prompts(
    cfg: GRPORunConfig, tokenizer: PreTrainedTokenizerBase, request: EvalRequest
) -> tuple[list[str], list[PromptDatum], str]:
    """(the run's held-out prompt texts, the prompts to evaluate, what they are): the run's
    validation set, or ``request.dataset``; cut to ``request.max_prompts``."""
    g = cfg.grpo
    _, val_set = build_prompt_datasets(cfg.data, cfg.env.arithmetic, tokenizer, num_val=g.max_val_samples, seed=g.seed)
    held_out = [val_set[i].metadata["raw_prompt"] for i in range(len(val_set))]
    if request.dataset is None:
        data, what = val_set, f"the validation prompts of {cfg.data.dataset_name!r}"
    else:
        data = build_prompt_eval_dataset(
            cfg.data,
            cfg.env.arithmetic,
            tokenizer,
            request.dataset,
            request.split,
            num_builtin=g.max_val_samples,
            seed=g.seed,
        )
        what = repr(request.dataset) + (f" (split {request.split!r})" if request.split else "")
    prompts = [data[i] for i in range(len(data))][: request.max_prompts]
    return held_out, prompts, what


def check_checkpoint_model(ckpt: LoadedCheckpoint, cfg: GRPORunConfig, resolved: GRPORunConfig) -> None:
    """The checkpoint's model must be the config's (same name, same ``config.json``, same
    backend format); a :class:`CheckpointError` naming both otherwise."""
    expected = run_identity(str(ckpt.identity.get("algorithm", "grpo")), cfg, resolved)
    diffs = [
        f"  {key}: the checkpoint's is {ckpt.identity.get(key)!r}, the config's {expected[key]!r}"
        for key in MODEL_KEYS
        if ckpt.identity.get(key) != expected[key]
    ]
    if diffs:
        raise CheckpointError(
            f"dualrl eval --checkpoint {ckpt.path}: the checkpoint holds another model than the config's\n"
            + "\n".join(diffs)
            + "\n  (without --config the checkpoint's own config.yaml is used; --backend picks the backend "
            "whose format its weights are in)"
        )


def _start_workers(
    cfg: GRPORunConfig, tokenizer: PreTrainedTokenizerBase, ckpt: LoadedCheckpoint | None, stack: contextlib.ExitStack
) -> tuple[RolloutEngine, EnvironmentPool | EpisodeRunner]:
    """Ray, a policy holding the weights (no optimizer, no reference), the rollout engine and
    the environment pool; each shut down by ``stack``."""
    from core.algorithms.placement import policy_cluster, start_ray
    from core.algorithms.rollout_engine import RolloutEngine
    from core.distributed.worker_output import current_worker_log
    from core.environments import EnvironmentPool
    from core.policy import Policy

    start = time.perf_counter()
    start_ray(cfg)
    worker_log = current_worker_log()
    if worker_log:
        logger.info("worker output (vLLM, libraries): %s", worker_log)
    cluster = policy_cluster(cfg)
    stack.callback(cluster.shutdown)
    weights = ckpt.policy_dir / "weights" if ckpt is not None else None
    policy = Policy(
        cluster, cfg.policy, tokenizer, weights_path=weights, init_optimizer=False, init_reference_model=False
    )
    stack.callback(policy.shutdown)
    env: EnvironmentPool | EpisodeRunner
    if cfg.is_multi_turn():  # episodes stepped where training steps them (env.num_workers)
        from core.algorithms.grpo_setup import episode_runner

        runner = env = episode_runner(cfg, tokenizer, policy.model_config.eos_token_id)
        stack.callback(runner.executor.shutdown)
    else:
        pool = env = EnvironmentPool(cfg.env)
        stack.callback(pool.shutdown)
    engine = RolloutEngine(cfg, policy, tokenizer, cluster, cfg.grpo.seed, start_version=ckpt.step if ckpt else 0)
    stack.callback(engine.shutdown)
    logger.info(
        "workers up in %.1f s: %s policy, %s generation", time.perf_counter() - start, cfg.policy.backend, engine.kind
    )
    return engine, env


def _label(cfg: GRPORunConfig, ckpt: LoadedCheckpoint | None) -> str:
    """A file-name-safe name of what is evaluated: ``<run>-step_N`` or the model's name."""
    if ckpt is not None:
        return f"{ckpt.path.parent.parent.name}-{ckpt.path.name}"
    name = cfg.policy.model_name
    if is_builtin(name):
        return name.replace(":", "-")
    path = Path(name).expanduser()
    return path.name if path.exists() else name.replace("/", "--")


def _details(cfg: GRPORunConfig, request: EvalRequest, dataset: str) -> dict[str, Any]:
    gen = cfg.policy.generation
    details: dict[str, Any] = {"model": cfg.policy.model_name, "backend": cfg.policy.backend, "dataset": dataset}
    if request.checkpoint is not None:
        details.update(checkpoint=str(request.checkpoint.path), step=request.checkpoint.step)
    if gen is not None:  # GRPORunConfig requires it
        details["generation"] = {
            "backend": gen.backend,
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
            "max_new_tokens": gen.max_new_tokens,
            "seed": cfg.grpo.seed,
        }
    return details


def _run_validation(ckpt: LoadedCheckpoint | None) -> str:
    """The run's last validation before the checkpoint (its ``val/...`` metrics), one line."""
    if ckpt is None:
        return ""
    shown: Sequence[str] = [k for k in ckpt.metrics if k.startswith("val/") and not k.startswith("val/timing")]
    return ", ".join(f"{k} {ckpt.metrics[k]:.4g}" for k in shown if isinstance(ckpt.metrics[k], (int, float)))
