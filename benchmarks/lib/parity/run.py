"""A whole parity run: every layout started, measured, cross-loaded and closed, one at a time."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.lib.errors import error_text
from benchmarks.lib.layouts import dcp_layouts, device_layout, parse_layout
from benchmarks.lib.models import load_tokenizer, prepare_model, vocab_size
from benchmarks.lib.parity.checks import collect, crossload_pairs, is_lora
from benchmarks.lib.parity.engine import engine_check, engine_prompts, parity_engine
from benchmarks.lib.parity.exact import exact_prompts, exact_sampler_check
from benchmarks.lib.parity.grpo import grpo_batch
from benchmarks.lib.parity.hf_reference import HFReference, hf_export_logprobs
from benchmarks.lib.parity.measure import after_one_more_step, measure_policy, policy_logprobs
from benchmarks.lib.parity.models import (
    check_arguments,
    jax_devices,
    layout_problem,
    model_problem,
    parity_settings,
)
from benchmarks.lib.parity.multi_turn import MultiTurnWorkload
from benchmarks.lib.parity.runners import new_runner, parity_runner
from benchmarks.lib.parity.settings import (
    BF16_TOLERANCES,
    DEFAULT_LAYOUTS,
    GRPO_STEPS,
    HF,
    HF_LORA,
    LEARNING_RATE,
    LORA,
    OTHER_SEED,
    STEPS,
    TOLERANCES,
)
from benchmarks.lib.ray_session import RaySession, ray_cpus
from benchmarks.lib.refit import Engine
from benchmarks.lib.workload import default_policy_section, make_batch


def _error(what: str, err: BaseException) -> str:
    """One line for the report (called in the ``except`` block: the traceback goes to stderr)."""
    return f"{what}: {error_text(err)}"


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
        self.engine: Engine | None = None
        self.engine_error: str | None = None
        self.engine_startup_s: list[float] = []
        #: The episodes of ``grpo_multi_turn_step0`` (a ``MultiTurnWorkload``; None: not run).
        self.multi_turn = None
        #: ``--exact``: the exact sampler's prompts (``benchmarks.lib.parity.exact``).
        self.exact_prompts = None

    # ------------------------------------------------------------------ Ray / engine
    def start(self, name: str, model_path: str | None = None):
        """A runner of ``name`` (initial model by default); Ray restarted first if the layout
        needs another XLA device count (the engine is closed first: it would die with Ray)."""
        devices = jax_devices(name)
        if self.engine is not None and self.session.restarts_for(devices):
            self.close_engine()
        self.session.start(devices)
        return new_runner(name, model_path or self.paths[0], self.paths[1], self.tokenizer, self.args)

    def get_engine(self) -> Engine | None:
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
            out = measure_policy(runner, data, other, self.args.steps, grpo_base, grpo_steps, self.multi_turn)
            export = self.tmp / f"export-{name}"
            runner.policy.save_hf_checkpoint(str(export))
            out.update(startup_s=startup, export=str(export))
            if self.args.exact:
                out["exact"] = exact_sampler_check(runner.policy, self.exact_prompts)
            self.measured[name] = out
            if engine:
                self.engine_layout(name, runner.policy, prompts)
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
            runner.policy.save_checkpoint(str(weights), str(optim))
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
                        runner.policy, data["input_ids"], data["input_lengths"]
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
            runner = parity_runner(
                tgt,
                *self.paths,
                self.tokenizer,
                self.args,
                weights_path=ckpt["weights"],
                optimizer_path=ckpt["optimizer"],
            )
            try:
                loaded = {"logprobs": policy_logprobs(runner.policy, data["input_ids"], data["input_lengths"])}
                loaded["resumed"] = after_one_more_step(runner, data)
            finally:
                runner.close()
            self.dcp[(src, tgt)] = loaded
            self.timings[f"dcp {src} -> {tgt}"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            self.errors[f"dcp {src} -> {tgt}"] = _error(f"dcp_crossload {src} -> {tgt}", err)

    # ------------------------------------------------------------------ the whole run
    def screen(self, layouts: list[str], model: str, engine_layouts: list[str]) -> list[str]:
        """The layouts that can run here; an error (or, on the caller's Ray, a skip) line for the others."""
        threads, cluster_cpus = self.args.threads, _ray_cpus()
        if engine_layouts and cluster_cpus is not None and 2 * threads > cluster_cpus:
            self.engine_error = self.errors["engine"] = (
                f"token_mult_prob_error: the vLLM engine does not fit: its bundle of --threads {threads} CPUs "
                f"next to a policy's needs {2 * threads}, the Ray cluster has {cluster_cpus:g}"
            )
        runnable, model_problems = [], {}
        for name in layouts:
            problem = layout_problem(name, self.args.batch, threads, cluster_cpus)
            if problem is None:
                backend = parse_layout(name).backend
                if backend not in model_problems:  # the model's problem, asked once per backend
                    model_problems[backend] = model_problem(name, model, self.paths[0])
                problem = model_problems[backend]
            if problem is not None:
                self.errors[name] = f"{name}: {problem}"
            elif not self.session.fits(jax_devices(name)):
                given = self.session.devices
                self.skipped[name] = (
                    f"needs {jax_devices(name)} XLA host devices per actor; the caller's Ray gives {given}"
                )
            else:
                runnable.append(name)
        return runnable

    def measure_all(self, names: list[str], data, other, base, grpo_steps: int, engine_layouts, prompts) -> None:
        """Each layout measured on the initial model, one at a time; the engine closed afterwards."""
        dcp_sources = {src for src, _ in dcp_ring(names)}
        for name in names:
            try:
                self.measure_layout(
                    name, data, other, base, grpo_steps, name in engine_layouts, prompts, name in dcp_sources
                )
                self.timings[name] = self.measured[name]["seconds"]
            except Exception as err:  # noqa: BLE001 -- report it, go on with the other layouts
                self.measured.pop(name, None)
                self.errors[name] = _error(name, err)
        self.close_engine()

    def cross_load_all(self, names: list[str], data, crossload: str) -> None:
        """Every measured layout's HF export into ``hf`` and the ``crossload`` pairs; the DCP ring."""
        ran = [n for n in names if n in self.measured]
        for src, tgt in [(n, HF) for n in ran] + crossload_pairs(ran, crossload):
            self.crossload(src, tgt, data)
        for src, tgt in dcp_ring(names):
            if "dcp" in self.measured.get(src, {}) and tgt in ran:
                self.dcp_load(src, tgt, data)


def dcp_ring(names: list[str]) -> list[tuple[str, str]]:
    """(source, target) DCP pairs: a ring over the layouts that checkpoint in torch DCP, full and ``-lora``
    apart (none with fewer than two): a LoRA checkpoint holds adapters and their AdamW state
    that a full fine-tuning target has no place for, and the reverse."""
    torch_names = dcp_layouts(names)
    return [
        pair
        for lora in (False, True)
        for pair in crossload_pairs([n for n in torch_names if is_lora(n) == lora], "ring")
    ]


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
    exact: bool = False,
) -> dict:
    """Measure ``hf`` and every layout, compare them; the results (plain JSON-able data).

    ``engine``: the ``token_mult_prob_error`` check on every layout (``True``) or on the named
    ones.  ``exact``: every layout in exact mode, with the bitwise checks of
    ``benchmarks.lib.parity.exact``.  A layout that cannot run is reported (``errors``) and the others still run;
    ``ValueError`` only for arguments that make the whole run meaningless."""
    layouts = list(DEFAULT_LAYOUTS if layouts is None else layouts)
    check_arguments(layouts, engine, crossload, seq, steps, batch)
    engine_layouts = list(layouts) if engine is True else list(engine or [])
    import ray

    from core.testing.tiny_models import random_batch

    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
    tolerances = tolerances or (BF16_TOLERANCES if precision == "bfloat16" else TOLERANCES)
    args = argparse.Namespace(
        batch=batch, seq=seq, precision=precision, threads=threads, lr=lr, steps=steps, lora=LORA, exact=exact
    )
    # Ray (when started here) sized for a policy plus, with the engine, its bundle of --threads CPUs.
    torch_layouts = [layout for layout in map(device_layout, layouts) if layout is not None]
    num_cpus = max(ray_cpus(torch_layouts, threads), threads * (2 if engine_layouts else 1))
    wall0 = time.perf_counter()
    cfg = parity_settings(default_policy_section(), lr)
    with tempfile.TemporaryDirectory(prefix="dualrl-parity-") as tmp:
        model_path, tokenizer_path = prepare_model(model, Path(tmp))
        tokenizer = load_tokenizer(tokenizer_path)
        vocab = vocab_size(model_path)
        data = make_batch(batch, seq, vocab)
        ids, lengths = random_batch(batch, seq, vocab, seed=OTHER_SEED)
        other = {"input_ids": ids, "input_lengths": lengths}
        session = RaySession(num_cpus)
        run = ParityRun(args, model_path, tokenizer_path, tokenizer, session, Path(tmp))
        t0 = time.perf_counter()
        hf = HFReference(model_path, cfg, precision)
        initial = hf.logprobs(data["input_ids"], data["input_lengths"])
        base = grpo_batch(data, initial)  # GRPO's batch: hf's initial logprobs stand in for the engine's
        grpo_steps = GRPO_STEPS if batch % GRPO_STEPS == 0 else 1
        run.multi_turn = multi_turn = MultiTurnWorkload.build(vocab, seq)
        run.exact_prompts = exact_prompts(vocab) if exact else None
        kinds = {is_lora(n) for n in layouts}
        if False in kinds:
            run.measured[HF] = hf.measure(data, other, steps, base, grpo_steps, multi_turn)
            run.timings[HF] = time.perf_counter() - t0
        if True in kinds:
            t0 = time.perf_counter()
            hf_lora = HFReference(model_path, cfg, precision, lora=LORA)
            measured = hf_lora.measure(data, other, steps, base, grpo_steps, multi_turn)
            run.measured[HF_LORA] = {**measured, "base_logprobs": initial}
            run.timings[HF_LORA] = time.perf_counter() - t0
        prompts = engine_prompts(vocab, getattr(tokenizer, "bos_token_id", None)) if engine_layouts else None
        try:
            first_jax = next((jax_devices(n) for n in layouts if jax_devices(n)), None)
            if session.owned:
                session.start(first_jax)  # once, before any layout (a JAX layout may restart it)
            runnable = run.screen(layouts, model, engine_layouts)
            run.measure_all(runnable, data, other, base, grpo_steps, engine_layouts, prompts)
            run.cross_load_all(runnable, data, crossload)
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
        exact=exact,
    )
