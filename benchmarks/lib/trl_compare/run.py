"""The comparison's schedule: one algorithm on one layout (:class:`DualRLRunner`, a Policy on a
cluster of its own), its TRL child beside it, every dualrl step followed by one TRL step."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.errors import error_text
from benchmarks.lib.layouts import parse_layout
from benchmarks.lib.models import hf_config, load_tokenizer, param_count, prepare_model
from benchmarks.lib.policy import JaxActor, compile_counts, layout_case, noop_round_trip
from benchmarks.lib.ray_session import RaySession, ray_cpus
from benchmarks.lib.trl import TRLRunner
from benchmarks.lib.trl_compare.data import DPO_LOSS_CFG, batch_facts, build_examples, rows, to_batch, trl_examples
from benchmarks.lib.workload import default_policy_section, policy_config


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
            self.runner = TRLRunner("benchmarks.lib.trl_compare.trl_child:serve_trl", spec, threads)
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
