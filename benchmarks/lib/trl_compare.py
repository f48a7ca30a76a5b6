"""SFT and DPO steps of dualrl's layouts vs TRL's ``SFTTrainer`` / ``DPOTrainer``: the library of
``python -m benchmarks.trl_compare`` (its docstring has the methodology and the caveats).

* the data, built once in the driver by the project's own data path: the ids both sides train on;
* the TRL child (``benchmarks.lib.trl``): a trainer, one optimizer step per request;
* :class:`DualRLRunner`: one algorithm on one layout, a Policy on a cluster of its own;
* the schedule: every dualrl step followed by one TRL step of the same algorithm;
* the report.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.errors import error_text
from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.markdown import cell, spread, threads_cell
from benchmarks.lib.models import hf_config, load_tokenizer, param_count, prepare_model
from benchmarks.lib.pairing import median
from benchmarks.lib.policy import JaxActor, compile_counts, layout_case, noop_round_trip
from benchmarks.lib.ray_session import RaySession, ray_cpus
from benchmarks.lib.trl import TRLRunner, gate, train_until_stopped
from benchmarks.lib.workload import default_policy_section, policy_config

ALGORITHMS = ("sft", "dpo")
DEFAULT_LAYOUTS = ["fsdp1-dp2", "dtensor-dp2", "jax-fsdp2", "dtensor-dp1"]
#: Problem stream and TRL's seed.
SEED = 0
#: dualrl's DPO loss = TRL's ``loss_type=["sigmoid"]`` with ``beta = reference_policy_kl_penalty``.
DPO_LOSS_CFG = {
    "reference_policy_kl_penalty": 0.1,
    "preference_loss_weight": 1.0,
    "sft_loss_weight": 0.0,
    "preference_average_log_probs": False,
    "sft_average_log_probs": False,
}
#: Relative tolerance of the step-1 loss / gradient-norm check.
CHECK_RTOL = 1e-4


# ----------------------------------------------------------------------------- data (built once)


def build_examples(tokenizer, algorithm: str, batch: int) -> list:
    """One step's examples, encoded by the project's own data path (the built-in sources and
    :mod:`core.datasets.examples`, as ``dualrl sft`` / ``dualrl dpo`` encode them): SFT ``batch``
    ``SequenceDatum``s of "arithmetic", DPO ``batch // 2`` ``PreferenceDatum``s of
    "arithmetic-preferences" (rejected = a plausible slip), problems 0.. of seed ``SEED``."""
    from core.datasets.config import DataConfig
    from core.datasets.examples import PreferenceEncoder, SFTEncoder
    from core.datasets.sources import builtin_task, problem_row

    if algorithm == "sft":
        data = DataConfig(dataset_name="arithmetic", response_key="answer")
        encoder, task, n = SFTEncoder(data, tokenizer, 1 << 16), "arithmetic", batch
    else:
        data = DataConfig(dataset_name="arithmetic-preferences")
        encoder, task, n = PreferenceEncoder(data, tokenizer, 1 << 16), "arithmetic-preferences", batch // 2
    source = builtin_task(task, None)
    return [encoder.encode(problem_row(source.problem(SEED, i)), i, f"built-in {task}") for i in range(n)]


def rows(algorithm: str, examples: list) -> list[tuple[list[int], list[int]]]:
    """``(ids, loss mask)`` per sequence, in dualrl's row order (DPO: chosen, rejected, ...)."""
    sides = examples if algorithm == "sft" else [s for pair in examples for s in (pair.chosen, pair.rejected)]
    return [(list(s.input_ids), list(s.token_mask)) for s in sides]


def trl_examples(algorithm: str, examples: list) -> list[dict]:
    """The same token ids in TRL's pre-tokenized fields: SFT ``input_ids`` + ``completion_mask``;
    DPO ``prompt_ids`` (the tokens before the loss mask) + ``chosen_ids`` / ``rejected_ids``."""
    if algorithm == "sft":
        return [{"input_ids": list(e.input_ids), "completion_mask": list(e.token_mask)} for e in examples]
    out = []
    for pair in examples:
        start = pair.chosen.token_mask.index(1)
        assert pair.rejected.input_ids[:start] == pair.chosen.input_ids[:start], "sides must share the prompt"
        out.append(
            {
                "prompt_ids": list(pair.chosen.input_ids[:start]),
                "chosen_ids": list(pair.chosen.input_ids[start:]),
                "rejected_ids": list(pair.rejected.input_ids[start:]),
            }
        )
    return out


def to_batch(algorithm: str, examples: list, pad_id: int):
    """Right-padded ``BatchedDataDict`` as the loops build it (``core.algorithms.sft`` / ``dpo``)."""
    from core.algorithms.dpo import preference_batch
    from core.algorithms.sft import sequence_batch

    return (sequence_batch if algorithm == "sft" else preference_batch)(examples, pad_id)


def batch_facts(seqs) -> dict:
    return {
        "rows": len(seqs),
        "width": max(len(ids) for ids, _ in seqs),
        "real_tokens": sum(len(ids) for ids, _ in seqs),
        "loss_tokens": sum(sum(m) for _, m in seqs),
    }


# ----------------------------------------------------------------------------- TRL (child process)


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


# ----------------------------------------------------------------------------- dualrl


class DualRLRunner:
    """One algorithm on one layout: a Policy on a cluster of its own (DPO: with a reference model,
    loss ``DPOLossFn``; SFT: ``NLLLoss``), constant LR; steps timed on the driver."""

    def __init__(
        self, name: str, algorithm: str, data, width: int, model_path: str, tokenizer_path: str, tokenizer, args
    ) -> None:
        from core.losses import DPOLossFn, NLLLoss

        layout = parse_layout(name)
        self.name, self.algorithm, self.data, self.workers = name, algorithm, data, layout.workers
        cfg = policy_config(model_path, tokenizer_path, layout, args.batch, width, "float32", args.micro)
        cfg["scheduler"] = None
        self.mbs = cfg["train_micro_batch_size"]
        self.loss = NLLLoss() if algorithm == "sft" else DPOLossFn(DPO_LOSS_CFG)
        name_prefix = f"trlcmp-{name}-{algorithm}"
        self.case = layout_case(
            layout, cfg, tokenizer, name_prefix, args.threads, init_reference_model=algorithm == "dpo"
        )
        self.policy, self.startup_s, self.jax = self.case.policy, self.case.startup_s, None
        try:
            self.noop_s = noop_round_trip(self.policy)
            self.threads = [info.get("torch_num_threads") for info in self.policy.get_gpu_info()]
            if layout.per_host:
                self.jax = JaxActor(self.policy, layout, args.threads)
                self.threads = self.jax.threads
        except BaseException:
            self.close()
            raise

    @property
    def pinned(self) -> set[int] | None:
        return self.jax.pinned if self.jax else None

    def step(self) -> dict:
        """One optimizer step (DPO: reference pass + step); seconds, loss and grad norm."""
        from core.data import BatchedDataDict

        t0 = time.perf_counter()
        ref_s = None
        data = self.data
        if self.algorithm == "dpo":
            ref = self.policy.get_reference_policy_logprobs(data)["reference_logprobs"]
            ref_s = time.perf_counter() - t0
            data = BatchedDataDict({**data, "reference_policy_logprobs": ref})
        out = self.policy.train(data, self.loss, gbs=data.size, mbs=self.mbs)
        seconds = time.perf_counter() - t0
        return {
            "step_s": seconds,
            "ref_s": ref_s,
            "loss": out.loss[0],
            "grad_norm": out.grad_norm[0],
        }

    def compile_counts(self) -> dict | None:
        return compile_counts(self.policy) if self.jax else None

    def close(self) -> None:
        self.case.close()


# ----------------------------------------------------------------------------- schedule


def _trl_spec(algorithm: str, examples, seqs, model_path, tokenizer_path, root: Path, args) -> dict:
    dual_cfg = default_policy_section()
    return {
        "algorithm": algorithm,
        "examples": examples,
        "rows": seqs,
        "model_path": model_path,
        "tokenizer_path": tokenizer_path,
        "threads": args.threads,
        "batch": args.batch,
        "micro": args.micro or args.batch,
        "optimizer_kwargs": dual_cfg["optimizer"]["kwargs"],
        "max_grad_norm": dual_cfg["max_grad_norm"],
        "beta": DPO_LOSS_CFG["reference_policy_kl_penalty"],
        "output_dir": str(root / f"trl-{algorithm}-out"),
    }


class _TRLSide:
    """The TRL row of one algorithm and its child; a failing child is reported once and then left out."""

    def __init__(self, algorithm: str, spec: dict | None, threads: int) -> None:
        self.row: dict = {"case": "trl", "workers": 1, "step_s": [], "loop_s": [], "first": None}
        self.runner = None
        if spec is None:
            return
        print(f"[trl_compare] starting TRL {algorithm} ...", file=sys.stderr, flush=True)
        try:
            self.runner = TRLRunner("benchmarks.lib.trl_compare:serve_trl", spec, threads)
            self.row.update(threads=self.runner.threads, startup_s=self.runner.startup_s, ready=self.runner.ready)
        except Exception as err:  # noqa: BLE001 -- report it; the dualrl rows can still run
            self.row["error"] = error_text(err)

    def step(self, timed: bool) -> dict | None:
        if self.runner is None or "error" in self.row:
            return None
        try:
            out = self.runner.step()
        except Exception as err:  # noqa: BLE001
            self.row["error"] = error_text(err)
            return None
        self.row["first"] = self.row["first"] or out
        if timed:
            self.row["step_s"].append(out["step_s"])
            self.row["loop_s"].append(out["loop_s"])
        return out

    def close(self) -> None:
        if self.runner is not None:
            try:
                self.runner.close()
            except Exception as err:  # noqa: BLE001
                self.row.setdefault("error", error_text(err))


def _paired_steps(runner: DualRLRunner, trl: _TRLSide, row: dict, args) -> None:
    """Warm-up + timed steps, each dualrl step followed by one TRL step."""
    for i in range(args.warmup + args.steps):
        timed = i >= args.warmup
        mine = runner.step()
        theirs = trl.step(timed)
        row["first"] = row.get("first") or mine
        if not timed:
            continue
        row["step_s"].append(mine["step_s"])
        if mine["ref_s"] is not None:
            row["ref_s"].append(mine["ref_s"])
        if theirs is not None:
            row["trl_step_s"].append(theirs["step_s"])
            row["trl_loop_s"].append(theirs["loop_s"])


def _run_layout(name: str, algorithm: str, session, data, width: int, trl: _TRLSide, paths, tokenizer, args) -> dict:
    """One Policy for one algorithm, its steps paired with TRL's; ``paths``: (model, tokenizer)."""
    layout = parse_layout(name)
    row = {"case": name, "workers": layout.workers, "step_s": [], "ref_s": [], "trl_step_s": [], "trl_loop_s": []}
    if not session.fits(session.devices_for(layout)):
        row["skipped"] = f"needs {layout.devices} XLA host devices per actor; the caller's Ray gives {session.devices}"
        return row
    print(f"[trl_compare] starting {name} {algorithm} ...", file=sys.stderr, flush=True)
    try:
        session.start(session.devices_for(layout))
        runner = DualRLRunner(name, algorithm, data, width, *paths, tokenizer, args)
    except Exception as err:  # noqa: BLE001 -- report it and go on with the other layouts
        row["error"] = error_text(err)
        return row
    try:
        pinned = sorted(runner.pinned) if runner.pinned else None
        row.update(threads=runner.threads, startup_s=runner.startup_s, noop_s=runner.noop_s, pinned=pinned)
        _paired_steps(runner, trl, row, args)
        row["compile_counts"] = runner.compile_counts()
    except Exception as err:  # noqa: BLE001
        row["error"] = error_text(err)
    finally:
        runner.close()
    return row


def run_algorithm(algorithm: str, layouts: list[str], session, paths, tokenizer, root: Path, args) -> dict:
    """The TRL child of this algorithm lives throughout; the layouts' Policies one at a time."""
    examples = build_examples(tokenizer, algorithm, args.batch)
    seqs = rows(algorithm, examples)
    facts = batch_facts(seqs)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    data = to_batch(algorithm, examples, pad_id)
    spec = _trl_spec(algorithm, trl_examples(algorithm, examples), seqs, *paths, root, args) if args.trl else None
    trl = _TRLSide(algorithm, spec, args.threads)
    try:
        cases = [
            _run_layout(name, algorithm, session, data, facts["width"], trl, paths, tokenizer, args) for name in layouts
        ]
        if not any(c.get("trl_step_s") for c in cases):  # no layout ran: time TRL on its own
            for i in range(args.warmup + args.steps):
                trl.step(i >= args.warmup)
    finally:
        trl.close()
    return {"algorithm": algorithm, "batch": facts, "cases": ([trl.row] if args.trl else []) + cases}


def run_trl_compare(args) -> tuple[list[dict], dict]:
    """Every algorithm on every layout; the results and the run's facts (model size, load, Ray
    session, the TRL child's versions) for the report."""
    session = None
    if args.layouts:
        threads = args.threads
        session = RaySession(ray_cpus([parse_layout(n) for n in args.layouts], threads))
        first_jax = next((parse_layout(n).devices for n in args.layouts if parse_layout(n).per_host), None)
        if session.owned:
            session.start(first_jax)  # before anything is timed
    results = []
    with tempfile.TemporaryDirectory(prefix="dualrl-trl-") as tmp:
        root = Path(tmp)
        paths = prepare_model(args.model, root)
        config = hf_config(paths[0])
        args.vocab, args.params = config.vocab_size, param_count(config)
        tokenizer = load_tokenizer(paths[1])
        load0 = os.getloadavg()[0]
        for algorithm in args.algorithms:
            results.append(run_algorithm(algorithm, args.layouts, session, paths, tokenizer, root, args))
        load = (load0, os.getloadavg()[0])
    ready = next((r["ready"] for res in results for r in res["cases"] if r["case"] == "trl" and r.get("ready")), {})
    return results, {"params": args.params, "load": load, "session": session, "versions": ready}


# ----------------------------------------------------------------------------- report


def _ok(r: dict) -> bool:
    return "error" not in r and "skipped" not in r and bool(r.get("step_s"))


def ratio(r: dict, trl: dict | None, stat=statistics.median) -> float | None:
    """case tokens/s ÷ TRL tokens/s, against the case's own paired TRL steps (TRL row: itself)."""
    if not _ok(r):
        return None
    base = r.get("trl_step_s") if r["case"] != "trl" else r["step_s"]
    return stat(base) / stat(r["step_s"]) if base else None


def _procs(r: dict) -> str:
    threads = r.get("threads") or []
    t = threads_cell(r) if threads else "?"
    layout = parse_layout(r["case"]) if r["case"] != "trl" else None
    if layout is not None and layout.per_host:
        return f"1 ({layout.devices} dev) × {t} XLA"
    return f"{r['workers']} × {t}"


def _check(mine: dict | None, theirs: dict | None) -> str:
    if not mine or not theirs:
        return "-"
    parts = []
    for key in ("loss", "grad_norm"):
        a, b = mine.get(key), theirs.get(key)
        if a is None or b is None:
            parts.append(f"{key} ?")
            continue
        rel = abs(a - b) / max(abs(b), 1e-12)
        parts.append(f"{key} {a:.6g} vs {b:.6g} ({'ok' if rel <= CHECK_RTOL else f'DIFF {rel:.1e}'})")
    return "; ".join(parts)


def _header(args, facts: dict) -> list[str]:
    params, load, session, versions = facts["params"], facts["load"], facts["session"], facts["versions"]
    cores = os.cpu_count() or 1
    size = f"{params / 1e6:.2f}M params, " if params else ""
    micro = f"{args.micro} rows per rank" if args.micro else "whole local batch per rank"
    trl = (
        f"TRL {versions.get('trl')} (transformers {versions.get('transformers')}, torch {versions.get('torch')})"
        if args.trl
        else f"TRL: not run ({args.no_trl_reason})"
    )
    policy = default_policy_section()
    lines = [
        f"dualrl vs {trl}; model {args.model} ({size}vocab {args.vocab}), float32, attention "
        f"{versions.get('attn_implementation', 'sdpa')}; {args.batch} sequences per optimizer step (SFT: {args.batch} "
        f"examples, DPO: {args.batch // 2} pairs); micro batch: {micro}; {args.steps} timed steps after "
        f"{args.warmup} warm-up per (layout, algorithm); "
        f"AdamW {json.dumps(policy['optimizer']['kwargs'])}, "
        f"constant LR, max_grad_norm {policy['max_grad_norm']}",
        f"threads: {args.threads} per case on {cores} CPU cores (TRL: one process, torch.set_num_threads; torch "
        f"layouts: Ray bundles of threads/workers CPUs; JAX: one actor, XLA pool)",
        "tokens/s = real (non-pad) tokens of the step's batch / median step seconds. TRL step = on_step_begin -> "
        "on_step_end (callback); dualrl step = driver wall time of policy.train "
        "(DPO: + get_reference_policy_logprobs). "
        "Each dualrl step is followed by one TRL step; ×TRL = median paired TRL s / median dualrl s.",
        f"machine load average (1 min): {load[0]:.2f} at start, {load[1]:.2f} at end"
        + (f"  -- above {cores} cores: trust ×TRL (paired) more than absolute tokens/s" if max(load) > cores else ""),
        "",
    ]
    if session is not None and session.owned and session.restarts:
        lines.insert(
            4,
            "Ray restarts for another XLA device count: "
            + ", ".join(f"to {n} in {s:.1f} s" for n, s in session.restarts)
            + " (not timed)",
        )
    return lines


def _trl_row(res: dict) -> dict | None:
    return next((r for r in res["cases"] if r["case"] == "trl"), None)


def _table(results: list[dict]) -> list[str]:
    lines = [
        "| algorithm | case | processes × threads | tokens/s | ×TRL | step s: median [min, max] |",
        "|---|---|---|---:|---:|---|",
    ]
    for res in results:
        tokens = res["batch"]["real_tokens"]
        for r in res["cases"]:
            cells = [res["algorithm"], r["case"], _procs(r)]
            if not _ok(r):
                word = "skipped" if "skipped" in r else "FAILED"
                cells += [word, "-", r.get("skipped") or r.get("error") or "no steps"]
            else:
                cells += [
                    f"{tokens / statistics.median(r['step_s']):.0f}",
                    cell(ratio(r, _trl_row(res)), ".2f"),
                    spread(r["step_s"]),
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _same_batch(check: dict | None, b: dict) -> str:
    """Whether TRL's collator held exactly our rows and loss masks."""
    if not check:
        return "-"
    same = check["same_rows_and_masks"] and all(check[k] == b[k] for k in ("real_tokens", "loss_tokens", "width"))
    return "yes" if same else f"NO: {check}"


def _batches(results: list[dict]) -> list[str]:
    lines = [
        "",
        "Batches (identical ids for both frameworks; TRL's check = its collator's output of the whole "
        "batch holds exactly these rows and loss masks):",
    ]
    for res in results:
        b = res["batch"]
        same = _same_batch((_trl_row(res) or {}).get("ready", {}).get("check"), b)
        lines.append(
            f"  {res['algorithm']}: {b['rows']} rows x width {b['width']} = {b['rows'] * b['width']} padded, "
            f"{b['real_tokens']} real tokens, {b['loss_tokens']} loss tokens; TRL same rows/masks: {same}"
        )
    return lines


def _detail(algorithm: str, r: dict, trl_row: dict | None) -> list[str]:
    noop = r["noop_s"] * 1e3 if r.get("noop_s") is not None else None
    paired = r["step_s"] if r["case"] == "trl" else r.get("trl_step_s")
    loop = r.get("loop_s") if r["case"] == "trl" else r.get("trl_loop_s")
    check = (
        f"TRL first step: loss {r['first']['loss']:.6g}, grad norm {r['first']['grad_norm']:.6g}"
        if r["case"] == "trl" and r.get("first")
        else _check(r.get("first"), (trl_row or {}).get("first"))
    )
    lines = [
        f"{algorithm:9} {r['case']:12} {cell(r.get('startup_s'), '.1f'):>7} "
        f"{cell(noop, '.1f'):>8} {cell(median(paired), '.4f'):>12} "
        f"{cell(ratio(r, trl_row, min), '.2f'):>9} {cell(median(r.get('ref_s')), '.4f'):>6} "
        f"{cell(median(loop), '.4f'):>10}  {check}"
    ]
    if r.get("compile_counts"):
        lines.append(
            f"{'':22} JAX get_compile_counts() at the end: {r['compile_counts']}"
            + (f"; pinned to CPUs {r['pinned']}" if r.get("pinned") else "")
        )
    return lines


def _details(results: list[dict]) -> list[str]:
    lines = [
        "",
        "Details: start s = Policy construction / TRL child start-up (not timed); no-op ms = a Policy call "
        "that does nothing on the workers; paired TRL = median of the TRL steps run alongside; ×TRL(min) = "
        "fastest paired TRL step / fastest step; ref s = the DPO reference pass inside the dualrl step; TRL "
        "loop s = driver's go -> on_step_end (adds the trainer loop's between-step work and the next batch's "
        "collation)",
        f"{'algorithm':9} {'case':12} {'start s':>7} {'no-op ms':>8} {'paired TRL s':>12} {'×TRL(min)':>9} "
        f"{'ref s':>6} {'TRL loop s':>10}  step-1 check vs TRL's first step (loss; pre-clip grad norm)",
    ]
    for res in results:
        for r in res["cases"]:
            if _ok(r):
                lines += _detail(res["algorithm"], r, _trl_row(res))
    return lines


def report(results: list[dict], args, facts: dict) -> str:
    """The text report; ``facts``: :func:`run_trl_compare`'s."""
    return "\n".join(_header(args, facts) + _table(results) + _batches(results) + _details(results))
