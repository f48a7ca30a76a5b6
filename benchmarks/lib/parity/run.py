"""A whole parity run: every layout started, measured, cross-loaded and closed, one at a time."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import jax_backend as jb
from benchmarks import refit as rf
from benchmarks import torch_backends as tb
from benchmarks.layouts import torch_layout
from benchmarks.parity.checks import collect, crossload_pairs
from benchmarks.parity.engine import engine_check, engine_prompts, parity_engine
from benchmarks.parity.grpo import grpo_batch
from benchmarks.parity.hf_reference import HFReference, hf_export_logprobs
from benchmarks.parity.measure import after_one_more_step, measure_policy, policy_logprobs
from benchmarks.parity.models import (
    check_arguments,
    jax_devices,
    jax_model_problem,
    layout_problem,
    parity_settings,
    prepare_model,
)
from benchmarks.parity.runners import TorchPolicyStart, new_runner
from benchmarks.parity.settings import (
    BF16_TOLERANCES,
    DEFAULT_LAYOUTS,
    GRPO_STEPS,
    HF,
    LEARNING_RATE,
    OTHER_SEED,
    STEPS,
    TOLERANCES,
)


def _error(what: str, err: BaseException) -> str:
    """One line for the report (called in the ``except`` block: the traceback goes to stderr)."""
    traceback.print_exc()
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{what}: {type(err).__name__}: {lines[-1].strip() if lines else ''}"


class ParityRun:
    """The state of one :func:`run_parity`: model, batches, Ray session, the engine, results."""

    def __init__(self, args, model_path: str, tokenizer_path: str, tokenizer, session, tmp: Path) -> None:
        self.args, self.session, self.tmp = args, session, tmp
        self.paths, self.tokenizer = (model_path, tokenizer_path), tokenizer
        self.measured: dict[str, dict] = {}
        self.crossloaded: dict[tuple[str, str], Any] = {}
        self.dcp: dict[tuple[str, str], dict] = {}
        self.errors: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.engine: rf.Engine | None = None
        self.engine_error: str | None = None
        self.engine_startup_s: list[float] = []

    # ------------------------------------------------------------------ Ray / engine
    def start(self, name: str, model_path: str | None = None):
        """A runner of ``name`` (initial model by default); Ray restarted first if the layout
        needs another XLA device count (the engine is closed first: it would die with Ray)."""
        devices = jax_devices(name)
        if self.engine is not None and self.session.owned and devices is not None and devices != self.session.devices:
            self.close_engine()
        self.session.start(devices)
        return new_runner(name, model_path or self.paths[0], self.paths[1], self.tokenizer, self.args)

    def get_engine(self) -> rf.Engine | None:
        """The engine (started on first use, replaced if it died); ``None`` once it failed to start."""
        if self.engine_error is not None:
            return None
        if self.engine is not None and not self.engine.alive():
            self.close_engine()
        if self.engine is None:
            try:
                self.engine = parity_engine(*self.paths, self.tokenizer, self.args)
                self.engine_startup_s.append(self.engine.startup_s)
            except Exception as err:  # noqa: BLE001 -- one error line, every other check still runs
                self.engine_error = _error("token_mult_prob_error: the vLLM engine did not start", err)
                self.errors["engine"] = self.engine_error
                return None
        return self.engine

    def close_engine(self) -> None:
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 -- a dead engine's shutdown may fail; nothing left to free
                traceback.print_exc()
            self.engine = None

    # ------------------------------------------------------------------ phases
    def measure_layout(
        self, name: str, data, other, grpo_base, grpo_steps: int, engine: bool, prompts, dcp_source: bool
    ) -> None:
        """Start ``name`` on the initial model; measure (GRPO step 0 included); export (HF); the
        engine check; the DCP checkpoint and one more step (a DCP source); shut it down."""
        t0 = time.perf_counter()
        runner = self.start(name)
        try:
            startup = time.perf_counter() - t0
            out = measure_policy(runner, data, other, self.args.steps, grpo_base, grpo_steps)
            export = self.tmp / f"export-{name}"
            runner._policy.save_hf_checkpoint(str(export))
            out.update(startup_s=startup, export=str(export))
            self.measured[name] = out
            if engine:
                self.engine_layout(name, runner._policy, prompts)
            if dcp_source:
                self.dcp_save(name, runner, data)
        finally:
            runner.close()
            if name in self.measured:
                self.measured[name]["seconds"] = time.perf_counter() - t0

    def dcp_save(self, name: str, runner, data) -> None:
        """``save_checkpoint`` (weights + optimizer) of the trained policy, then one more step."""
        out = self.measured[name]
        try:
            weights, optim = self.tmp / f"dcp-{name}" / "weights", self.tmp / f"dcp-{name}" / "optim"
            runner._policy.save_checkpoint(str(weights), str(optim))
            resumed = after_one_more_step(runner, data)
            out.update(dcp={"weights": str(weights), "optimizer": str(optim)}, resumed=resumed)
        except Exception as err:  # noqa: BLE001 -- the layout's other checks stand
            self.errors[f"dcp {name}"] = _error(f"dcp_crossload {name}: save_checkpoint", err)

    def engine_layout(self, name: str, policy, prompts) -> None:
        generation = self.get_engine()
        if generation is None:
            return
        try:
            t0 = time.perf_counter()
            self.measured[name]["engine"] = engine_check(policy, generation.generation, prompts)
            self.timings[f"engine {name}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            message = _error(f"token_mult_prob_error {name}", err)
            if "head_dim" in message:  # the model, not the layout: the next layouts would fail alike
                message += " (vLLM's CPU attention has no kernel for this head_dim: try --model tiny-llama-hd32)"
                self.engine_error = message
            self.errors[f"engine {name}"] = message

    def crossload(self, src: str, tgt: str, data) -> None:
        """``tgt``'s logprobs of ``src``'s export (``tgt`` = ``hf``: loaded in this process)."""
        export = self.measured[src]["export"]
        t0 = time.perf_counter()
        try:
            if tgt == HF:
                self.crossloaded[(src, tgt)] = hf_export_logprobs(export, data, self.args.precision)
            else:
                runner = self.start(tgt, export)
                try:
                    self.crossloaded[(src, tgt)] = policy_logprobs(
                        runner._policy, data["input_ids"], data["input_lengths"]
                    )
                finally:
                    runner.close()
            self.timings[f"{src} -> {tgt}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            self.errors[f"{src} -> {tgt}"] = _error(f"crossload {src} -> {tgt}", err)

    def dcp_load(self, src: str, tgt: str, data) -> None:
        """``tgt`` started on the initial model with ``src``'s DCP checkpoint: its logprobs, then
        one more step (from the loaded optimizer state) and its logprobs."""
        ckpt = self.measured[src]["dcp"]
        print(f"[parity] starting {tgt} from {src}'s DCP checkpoint ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            self.session.start(None)
            runner = TorchPolicyStart(
                torch_layout(tgt),
                *self.paths,
                self.tokenizer,
                self.args,
                weights_path=ckpt["weights"],
                optimizer_path=ckpt["optimizer"],
                tag="parity-dcp",
            )
            try:
                loaded = {"logprobs": policy_logprobs(runner._policy, data["input_ids"], data["input_lengths"])}
                loaded["resumed"] = after_one_more_step(runner, data)
            finally:
                runner.close()
            self.dcp[(src, tgt)] = loaded
            self.timings[f"dcp {src} -> {tgt}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            self.errors[f"dcp {src} -> {tgt}"] = _error(f"dcp_crossload {src} -> {tgt}", err)


def dcp_ring(names: list[str]) -> list[tuple[str, str]]:
    """(source, target) DCP pairs: a ring over the torch layouts (none with fewer than two)."""
    torch_names = [n for n in names if torch_layout(n) is not None]
    return crossload_pairs(torch_names, "ring")


def _ray_cpus() -> float | None:
    import ray

    return ray.cluster_resources().get("CPU") if ray.is_initialized() else None


def run_parity(
    layouts: list[str] | None = None,
    model: str = "llama",
    *,
    batch: int = 8,
    seq: int = 24,
    threads: int = 2,
    crossload: str = "ring",
    lr: float = LEARNING_RATE,
    steps: int = STEPS,
    engine: bool | list[str] = False,
    tolerances: dict | None = None,
    precision: str = "float32",
) -> dict:
    """Measure ``hf`` and every layout, compare them; the results (plain JSON-able data).

    ``engine``: the ``token_mult_prob_error`` check on every layout (``True``) or on the named
    ones.  A layout that cannot run is reported (``errors``) and the others still run;
    ``ValueError`` only for arguments that make the whole run meaningless."""
    layouts = list(DEFAULT_LAYOUTS if layouts is None else layouts)
    check_arguments(layouts, engine, crossload, seq, steps)
    engine_layouts = list(layouts) if engine is True else list(engine or [])
    import ray

    from core.testing.tiny_models import random_batch

    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    tolerances = tolerances or (BF16_TOLERANCES if precision == "bfloat16" else TOLERANCES)
    args = argparse.Namespace(
        batch=batch, seq=seq, precision=precision, threads=threads, cases=layouts, lr=lr, steps=steps
    )
    # Ray (when started here) sized for a policy plus, with the engine, its bundle of --threads CPUs.
    ray_threads = threads * (2 if engine_layouts else 1)
    torch_need = [
        layout.workers * (threads // layout.workers)
        for layout in map(torch_layout, layouts)
        if layout is not None and layout.workers <= threads
    ]
    session_args = argparse.Namespace(
        **{**vars(args), "threads": ray_threads, "ray_cpus": max([4, ray_threads, *torch_need])}
    )
    wall0 = time.perf_counter()
    cfg = parity_settings(tb.default_policy_section(), lr)
    with tempfile.TemporaryDirectory(prefix="dualrl-parity-") as tmp:
        model_path, tokenizer_path = prepare_model(model, Path(tmp))
        tokenizer = tb.load_tokenizer(tokenizer_path)
        vocab = tb.vocab_size(model_path)
        data = tb.make_batch(batch, seq, vocab)
        ids, lengths = random_batch(batch, seq, vocab, seed=OTHER_SEED)
        other = {"input_ids": ids, "input_lengths": lengths}
        session = jb.RaySession(session_args)
        run = ParityRun(args, model_path, tokenizer_path, tokenizer, session, Path(tmp))
        t0 = time.perf_counter()
        hf = HFReference(model_path, cfg, precision)
        # GRPO's batch: hf's initial logprobs stand in for the engine's
        base = grpo_batch(data, hf.logprobs(data["input_ids"], data["input_lengths"]))
        grpo_steps = GRPO_STEPS if batch % GRPO_STEPS == 0 else 1
        run.measured[HF] = hf.measure(data, other, steps, base, grpo_steps)
        run.timings[HF] = time.perf_counter() - t0
        prompts = engine_prompts(vocab, getattr(tokenizer, "bos_token_id", None)) if engine_layouts else None
        try:
            first_jax = next((jax_devices(n) for n in layouts if jax_devices(n)), None)
            if session.owned:
                session.start(first_jax)  # once, before any layout (a JAX layout may restart it)
            ray_cpus = _ray_cpus()
            if engine_layouts and ray_cpus is not None and 2 * threads > ray_cpus:
                run.engine_error = run.errors["engine"] = (
                    f"token_mult_prob_error: the vLLM engine does not fit: its bundle of --threads {threads} CPUs "
                    f"next to a policy's needs {2 * threads}, the Ray cluster has {ray_cpus:g}"
                )
            runnable, jax_model = [], None
            for name in layouts:
                problem = layout_problem(name, batch, threads, ray_cpus)
                if problem is None and jax_devices(name) is not None:
                    if jax_model is None:
                        jax_model = jax_model_problem(model, model_path) or ""
                    problem = jax_model or None
                if problem is not None:
                    run.errors[name] = f"{name}: {problem}"
                elif jax_devices(name) is not None and not session.fits(jax_devices(name)):
                    run.skipped[name] = (
                        f"needs {jax_devices(name)} XLA host devices per actor; the caller's "
                        f"Ray gives {session.devices}"
                    )
                else:
                    runnable.append(name)
            dcp_pairs = dcp_ring(runnable)
            dcp_sources = {src for src, _ in dcp_pairs}
            for name in runnable:
                try:
                    run.measure_layout(
                        name, data, other, base, grpo_steps, name in engine_layouts, prompts, name in dcp_sources
                    )
                    run.timings[name] = run.measured[name]["seconds"]
                except Exception as err:  # noqa: BLE001 -- report it, go on with the other layouts
                    run.measured.pop(name, None)
                    run.errors[name] = _error(name, err)
            run.close_engine()
            ran = [n for n in runnable if n in run.measured]
            for src, tgt in [(n, HF) for n in ran] + crossload_pairs(ran, crossload):
                run.crossload(src, tgt, data)
            for src, tgt in dcp_pairs:
                if "dcp" in run.measured.get(src, {}) and tgt in ran:
                    run.dcp_load(src, tgt, data)
        finally:
            run.close_engine()
            if session.owned and ray.is_initialized():
                ray.shutdown()
        real_tokens = int(data["input_lengths"].sum())
    run.timings["total"] = time.perf_counter() - wall0
    if run.engine_startup_s:
        run.timings["engine start"] = sum(run.engine_startup_s)
    return collect(
        run.measured,
        run.crossloaded,
        errors=run.errors,
        skipped=run.skipped,
        seconds=run.timings,
        tolerances=tolerances,
        dcp=run.dcp,
        model=model,
        layouts=layouts,
        batch=batch,
        seq=seq,
        precision=precision,
        real_tokens=real_tokens,
        steps=steps,
        lr=lr,
        max_grad_norm=cfg["max_grad_norm"],
        crossload=crossload,
        engine_layouts=engine_layouts,
        grpo_steps=grpo_steps,
    )
