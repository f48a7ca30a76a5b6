"""The child process of :class:`benchmarks.lib.trl_grpo.TRLGRPORunner`: TRL's ``GRPOTrainer`` built
from the runner's spec, with the patches and timers ``benchmarks.lib.trl_grpo``'s docstring
describes (dualrl's prompt tokenization, the optional old-policy log-prob pass, the per-phase
seconds of each step), one optimizer step per ``step`` line from the driver."""

from __future__ import annotations

import time
import types

from benchmarks.lib.trl import gate, train_until_stopped
from benchmarks.lib.trl_grpo import METRICS, check_spec, cycled_rows, grpo_config_kwargs


def _reward_function(env_cfg: dict):
    """A TRL reward function scoring with dualrl's environment (``ground_truth`` = the answer)."""
    from core.environments import check_environment_return, make_environment

    env = make_environment(env_cfg)

    def dualrl_env(prompts, completions, answer, **_kwargs):
        meta = [{"ground_truth": a} for a in answer]
        ret = check_environment_return(
            env.score(list(prompts), list(completions), meta), prompts, completions, env.name
        )
        return ret.rewards

    return dualrl_env


def _trainer_class():
    """``GRPOTrainer`` recording each step's loss, pre-clip grad norm and phase times; dualrl's
    prompt-tokenization rule; the optional old-policy log-prob pass (module docstring)."""
    import torch
    from trl import GRPOTrainer

    class Recording(GRPOTrainer):
        _bench_add_special_tokens = True
        _bench_old_logprobs_pass = True

        def bench_reset(self) -> None:
            self._bench = {
                "loss": 0.0,
                "grad_norm": None,
                "generation_s": 0.0,
                "reference_s": 0.0,
                "old_logprobs_s": 0.0,
                "rollout_s": 0.0,
            }

        def _add(self, key: str, seconds: float) -> None:
            self._bench[key] += seconds

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self._bench["loss"] += float(loss)  # summed over the micro batches of a step
            return loss

        def _clip_grad_norm(self, model):
            norm = super()._clip_grad_norm(model)
            self._bench["grad_norm"] = float(norm)
            return norm

        def _tokenize_prompts(self, prompts):
            if prompts and isinstance(prompts[0], str):  # dualrl: special tokens only without a chat template
                ids = self.processing_class(text=list(prompts), add_special_tokens=self._bench_add_special_tokens)
                return ids["input_ids"], None, {}
            return super()._tokenize_prompts(prompts)

        def _generate_single_turn(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self._add("generation_s", time.perf_counter() - t0)

        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            finally:
                if self.ref_model is not None and model is self.ref_model:
                    self._add("reference_s", time.perf_counter() - t0)

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            if self._bench_old_logprobs_pass and out.get("old_per_token_logps") is None and self.model.training:
                t1 = time.perf_counter()
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
                mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
                with torch.no_grad():
                    # TRL's own off-policy pass (as in _generate_and_score_completions), text-only inputs
                    old, _, _ = self._get_per_token_logps_and_entropies(
                        self.model,
                        ids,
                        mask,
                        out["completion_ids"].size(1),
                        batch_size=self.args.per_device_train_batch_size,
                    )
                out["old_per_token_logps"] = old
                self._add("old_logprobs_s", time.perf_counter() - t1)
            self._add("rollout_s", time.perf_counter() - t0)
            return out

    return Recording


def _step_metrics(metrics: dict, marks: dict) -> dict:
    """Mean of each reported TRL metric over the entries this step appended (``None`` if none)."""
    out = {}
    for name, key in METRICS.items():
        new = list(metrics.get(key, []))[marks.get(key, 0) :]
        out[name] = sum(new) / len(new) if new else None
    return out


def _optimizer(model, spec: dict):
    """``torch.optim.AdamW`` with the spec's values and a constant LR (no warm-up)."""
    import torch

    opt_kwargs = dict(
        lr=float(spec["learning_rate"]),
        betas=tuple(spec["betas"]),
        eps=float(spec["eps"]),
        weight_decay=float(spec["weight_decay"]),
    )
    opt_kwargs.update({k: spec[k] for k in ("foreach", "fused") if spec[k] is not None})
    optimizer = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)


#: The resolved GRPOConfig fields the child reports (``ready["config"]``).
CONFIG_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "epsilon",
    "epsilon_high",
    "loss_type",
    "scale_rewards",
    "importance_sampling_level",
    "max_grad_norm",
    "bf16",
    "use_vllm",
    "seed",
    "generation_kwargs",
)


def _ready(trainer, trainer_cls, rows: list[dict]) -> dict:
    """The child's versions, model facts and resolved config, answered once training begins."""
    import torch
    import transformers
    import trl

    model = trainer.model
    return {
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": model.config._attn_implementation,
        "gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "reference_model": trainer.ref_model is not None,
        "add_special_tokens": trainer_cls._bench_add_special_tokens,
        "old_logprobs_pass": trainer_cls._bench_old_logprobs_pass,
        "dataset_rows": len(rows),
        "config": {k: getattr(trainer.args, k) for k in CONFIG_FIELDS},
        # accelerate wraps model.forward in autocast (bf16) when it prepares the model: every
        # forward then runs under it, HF generate's included
        "autocast_forward": hasattr(model, "_original_forward"),
    }


def _step_reply(trainer, marks: dict, seconds: float, loop_s: float) -> dict:
    bench = trainer._bench
    return {
        "seconds": seconds,
        "loop_s": loop_s,
        "loss": bench["loss"],
        "grad_norm": bench["grad_norm"],
        "generation_s": bench["generation_s"],
        "reference_s": bench["reference_s"],
        "old_logprobs_s": bench["old_logprobs_s"],
        "rollout_s": bench["rollout_s"],
        "train_s": seconds - bench["rollout_s"],
        **_step_metrics(trainer._metrics["train"], marks),
    }


def serve_trl_grpo(spec: dict) -> None:
    """The child (``benchmarks.lib.trl``): build the trainer from the spec, then one optimizer step
    per ``step`` line (answering with its timings and metrics) until ``quit``."""
    t0 = time.perf_counter()
    threads, output_dir = spec.pop("threads"), spec.pop("output_dir")
    spec = check_spec(spec)
    import torch

    torch.set_num_threads(threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.datasets.prompts import chat_template_used

    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_path"])
    # fp32 weights whatever the precision (bf16 = autocast, fp32 master weights and AdamW state)
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    trainer_cls = _trainer_class()
    # the rule reads data.use_chat_template off the typed data section: the one field it needs
    use_template = types.SimpleNamespace(use_chat_template=spec["use_chat_template"])
    trainer_cls._bench_add_special_tokens = not chat_template_used(use_template, tokenizer)
    trainer_cls._bench_old_logprobs_pass = bool(spec["old_logprobs_pass"])
    rows = cycled_rows(spec["prompts"], spec["answers"], spec["prompts_per_step"])
    marks: dict = {}

    def reset() -> None:  # where this step's metrics start, and the step's own timers
        marks.update({k: len(v) for k, v in trainer._metrics["train"].items()})
        trainer.bench_reset()

    trainer = trainer_cls(
        model=model,
        reward_funcs=[_reward_function(spec["env"])],
        args=trl.GRPOConfig(**grpo_config_kwargs(spec, output_dir)),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        optimizers=_optimizer(model, spec),
        callbacks=[
            gate(
                t0,
                lambda: _ready(trainer, trainer_cls, rows),
                lambda seconds, loop_s: _step_reply(trainer, marks, seconds, loop_s),
                reset,
            )
        ],
    )
    trainer.bench_reset()
    train_until_stopped(trainer)
