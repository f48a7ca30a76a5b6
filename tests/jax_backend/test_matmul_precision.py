"""``policy.matmul_precision`` reaches every program the JAX worker compiles.

On CPU every precision computes in fp32, so the evidence is the programs themselves: with
``jax_dump_ir_to`` set, every module the worker lowers while it trains, computes logprobs
and generates (plain and packed grad steps, logprob steps, the optimizer update, prefill
and the decode step) is written out as StableHLO, and every ``dot_general`` in them must
carry the configured precision -- a step added later is covered the same way, since the
dump sees whatever compiles.  Workers run in-process from a validated policy config.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import jax
import pytest

from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.policy.config import PolicyConfig
from core.policy.matmul_precision import resolve_matmul_precision
from core.testing.tiny_models import random_batch
from tests.jax_backend.test_sequence_packing import packing
from tests.torch_backends.conftest import SEQ, VOCAB, pg_batch, policy_config
from tests.unit.test_losses import BASE_CFG

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) jax devices")

DOT = re.compile(r"stablehlo\.dot_general [^\n]*?precision = \[(\w+), (\w+)\]")


@contextlib.contextmanager
def dumped_programs(path: Path):
    """Every module jax lowers inside the block is written to ``path`` (StableHLO text)."""
    jax.config.update("jax_dump_ir_modes", "stablehlo")
    jax.config.update("jax_dump_ir_to", str(path))
    try:
        yield
    finally:
        jax.config.update("jax_dump_ir_to", "")


def dot_precisions(path: Path) -> dict[str, set[str]]:
    """``{module file: the precisions of its dot_generals}`` for modules with a dot_general."""
    out = {}
    for f in sorted(path.iterdir()):
        text = f.read_text()
        found = {p for pair in DOT.findall(text) for p in pair}
        assert text.count("stablehlo.dot_general ") == len(DOT.findall(text)), f"{f.name}: unparsed dot_general"
        if found:
            out[f.name] = found
    return out


def _worker(model_dir, tokenizer, precision, **overrides):
    from backends.jax_pjit.worker import JaxPolicyWorker

    cfg = policy_config(model_dir, "jax_pjit", matmul_precision=precision, **overrides)
    cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    return JaxPolicyWorker(PolicyConfig.checked(cfg), tokenizer)


def _prompts():
    return BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(2, 6, VOCAB, seed=5), strict=True))


def _run_everything(worker) -> None:
    worker.train(pg_batch(4, seed=1), ClippedPGLossFn(BASE_CFG))
    worker.get_logprobs(
        BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(2, SEQ, VOCAB, seed=2), strict=True))
    )


def test_fp32_resolves_to_highest():
    def section(precision):  # matmul_precision left out (null); the model path is never opened
        return PolicyConfig.checked(
            policy_config(Path("unused-model"), "jax_pjit", precision=precision, matmul_precision=None)
        )

    assert resolve_matmul_precision(section("float32")) == "highest"
    assert resolve_matmul_precision(section("bfloat16")) == "default"


def test_highest_reaches_every_step_of_the_worker(model_dirs, tokenizer, tmp_path):
    """Plain steps, the optimizer update and both decode programs under ``highest``; the
    programs are named after their step functions (``step``, ``apply``, ``_prefill``, ``_step``)."""
    worker = _worker(model_dirs["llama"], tokenizer, "highest")
    assert worker.matmul_precision == "highest"
    with dumped_programs(tmp_path):
        _run_everything(worker)
        worker.generate(_prompts(), greedy=True)
    programs = dot_precisions(tmp_path)
    assert all(p == {"HIGHEST"} for p in programs.values()), programs
    names = " ".join(programs)
    for step in ("jit_step", "jit__prefill", "jit__step"):  # grad + logprob steps, prefill, decode step
        assert step in names, names
    assert sum("jit_step" in n for n in programs) >= 2  # the grad step and the logprob step
    assert any("jit_apply" in f.name for f in tmp_path.iterdir())  # the update compiled in there too
    _same_program_only_under_the_same_precision(worker)


def _same_program_only_under_the_same_precision(worker) -> None:
    """The program ``get_logprobs`` ran is the one compiled under the worker's precision: the
    same call (same host path, shapes and shardings) under that precision hits jit's cache,
    under another one compiles anew -- the precision is part of the compile key."""
    from backends.jax_pjit import steps

    ids, lengths = random_batch(2, SEQ, VOCAB, seed=2)
    host = {"input_ids": ids.numpy(), "input_lengths": lengths.numpy()}
    rows = worker._micro_batch_rows(worker.cfg.logprob_batch_size)  # get_logprobs' micro batch
    host = steps.pad_micro_batch(host, rows, worker.rows.bucket(SEQ))
    dev = worker.rows.device_batch(host)
    assert worker.get_compile_counts()["logprobs"] == 1
    for precision, programs in (("highest", 1), ("default", 2)):
        with worker._on_mesh(), jax.default_matmul_precision(precision):
            worker._logprob_step(worker.params, dev["input_ids"], dev["input_lengths"])
        assert worker.get_compile_counts()["logprobs"] == programs, precision


def test_highest_reaches_the_packed_layout_steps(model_dirs, tokenizer, tmp_path):
    """Sequence packing: the explicit-layout grad and logprob steps (also context parallelism's)."""
    worker = _worker(model_dirs["llama"], tokenizer, "highest", sequence_packing=packing())
    with dumped_programs(tmp_path):
        _run_everything(worker)
    programs = dot_precisions(tmp_path)
    assert sum("jit_step" in n for n in programs) >= 2, programs
    assert all(p == {"HIGHEST"} for p in programs.values()), programs


def test_default_leaves_the_dots_at_default(model_dirs, tokenizer, tmp_path):
    worker = _worker(model_dirs["llama"], tokenizer, "default")
    with dumped_programs(tmp_path):
        _run_everything(worker)
    programs = dot_precisions(tmp_path)
    assert sum("jit_step" in n for n in programs) >= 2, programs
    assert all(p == {"DEFAULT"} for p in programs.values()), programs
