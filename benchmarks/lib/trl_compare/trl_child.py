"""The TRL side of the comparison, run in a child process (``benchmarks.lib.trl``): an
``SFTTrainer`` / ``DPOTrainer`` on the same rows, one optimizer step per request, recording
each step's loss and pre-clip gradient norm for the step-1 check."""

from __future__ import annotations

import time

from benchmarks.lib.trl import gate, train_until_stopped
from benchmarks.lib.trl_compare.data import SEED


def _trainer_classes():
    """``SFTTrainer`` / ``DPOTrainer`` subclasses that record each step's loss and pre-clip
    gradient norm (for the step-1 check); the DPO one takes pre-tokenized pairs as is."""
    from trl import DPOTrainer, SFTTrainer

    class Recording:
        _bench_loss, _bench_grad_norm = 0.0, None

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self._bench_loss += float(loss)  # summed over the micro batches of a step
            return loss

        def _clip_grad_norm(self, model):
            norm = super()._clip_grad_norm(model)
            self._bench_grad_norm = float(norm)
            return norm

    class SFT(Recording, SFTTrainer):
        pass

    class DPO(Recording, DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            # trl 1.16's DPOTrainer always tokenizes text; our dataset is already
            # prompt_ids / chosen_ids / rejected_ids, which its collator takes as is.
            return dataset

    return SFT, DPO


def _check_collated(trainer, algorithm: str, spec: dict) -> dict:
    """Collate the whole prepared dataset with the trainer's own collator and compare its
    rows and loss masks with ours (order-free: TRL's sampler shuffles)."""
    import torch

    dataset = trainer.train_dataset
    features = [dataset[i] for i in range(len(dataset))]
    if algorithm == "sft":
        features = [{k: f[k] for k in ("input_ids", "labels")} for f in features]
    out = trainer.data_collator(features)
    ids, attention = out["input_ids"], out["attention_mask"]
    if algorithm == "sft":
        # labels[t] != -100 <=> token t is a target (the shift happens in the model)
        loss_mask = (out["labels"] != -100).long()
    else:
        loss_mask = out["completion_mask"]
    theirs = []
    for i in range(ids.shape[0]):
        n = int(attention[i].sum())
        if not bool((attention[i, :n] == 1).all()):
            raise RuntimeError("TRL's collator produced a non right-padded row")
        theirs.append((ids[i, :n].tolist(), loss_mask[i, :n].tolist()))
    ours = [(list(a), list(b)) for a, b in spec["rows"]]
    return {
        "same_rows_and_masks": sorted(theirs) == sorted(ours),
        "width": int(ids.shape[1]),
        "real_tokens": int(attention.sum()),
        "loss_tokens": int(loss_mask.sum()),
        "padded_tokens": int(torch.numel(ids)),
    }


def _trainer_args(spec: dict, opt_kwargs: dict) -> dict:
    """What both trainers' configs share: CPU, fp32, no checkpointing / logging / saving, the
    optimizer's values, one optimizer step per ``batch`` rows."""
    return dict(
        output_dir=spec["output_dir"],
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        max_steps=10**6,
        gradient_accumulation_steps=spec["batch"] // spec["micro"],
        max_grad_norm=spec["max_grad_norm"],
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        seed=SEED,
        max_length=None,
        learning_rate=opt_kwargs["lr"],
        weight_decay=opt_kwargs["weight_decay"],
        adam_beta1=opt_kwargs["betas"][0],
        adam_beta2=opt_kwargs["betas"][1],
        adam_epsilon=opt_kwargs["eps"],
    )


def _trainer(spec: dict, model, tokenizer, opt_kwargs: dict, optimizers, callback):
    """The algorithm's trainer on the spec's pre-tokenized examples."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    sft_cls, dpo_cls = _trainer_classes()
    common = _trainer_args(spec, opt_kwargs)
    data = Dataset.from_list(spec["examples"])
    kwargs = dict(train_dataset=data, processing_class=tokenizer, optimizers=optimizers, callbacks=[callback])
    if spec["algorithm"] == "sft":
        config = trl.SFTConfig(
            **common,
            per_device_train_batch_size=spec["micro"],
            completion_only_loss=True,
            packing=False,
            padding_free=False,
        )
        return sft_cls(model=model, args=config, **kwargs)
    ref_model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    config = trl.DPOConfig(
        **common,
        per_device_train_batch_size=spec["micro"] // 2,
        beta=spec["beta"],
        loss_type=["sigmoid"],
        precompute_ref_log_probs=False,
        padding_free=False,
    )
    return dpo_cls(model=model, ref_model=ref_model, args=config, **kwargs)


def serve_trl(spec: dict) -> None:
    """The TRL child (``benchmarks.lib.trl``): build the trainer from the spec, then one training
    step per ``step`` line (answering with its timings, loss and grad norm) until ``quit``."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    opt_kwargs = {**spec["optimizer_kwargs"], "betas": tuple(spec["optimizer_kwargs"]["betas"])}
    optimizer = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    ready: dict = {}

    def step_reply(step_s: float, loop_s: float) -> dict:
        return {"step_s": step_s, "loop_s": loop_s, "loss": trainer._bench_loss, "grad_norm": trainer._bench_grad_norm}

    def reset() -> None:
        trainer._bench_loss = 0.0  # summed over the step's micro batches

    callback = gate(t0, lambda: ready, step_reply, reset)
    trainer = _trainer(spec, model, tokenizer, opt_kwargs, (optimizer, scheduler), callback)
    ready.update(
        threads=torch.get_num_threads(),
        params=sum(p.numel() for p in model.parameters()),
        trl=trl.__version__,
        transformers=transformers.__version__,
        torch=torch.__version__,
        attn_implementation=model.config._attn_implementation,
        gradient_checkpointing=bool(getattr(model, "is_gradient_checkpointing", False)),
        check=_check_collated(trainer, spec["algorithm"], spec),
    )
    train_until_stopped(trainer)
