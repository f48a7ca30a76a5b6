"""The ``eager_torch`` plug-in backend, registered from outside the repository's packages by an
entry point, works through the same doors as a built-in one: the CLI's ``--backend``, ``dualrl
config``, a ``Policy`` on its layout matching HF, and ``dualrl parity`` (slow).  The whole
layout contract suite runs it too (tests/backends: layout ``eager-dp1``, slow)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.lib.layouts import apply_settings, parse_layout
from core.data import BatchedDataDict
from core.losses import ClippedPGLossFn
from core.policy.registry import backend_names
from core.testing.tiny_models import random_batch
from tests.hf_reference import PG_CFG, reference_loss_and_norm
from tests.plugin_backend.site import PLUGIN_SESSION_ENV, session_site, subprocess_env
from tests.torch_backends.conftest import SEQ, VOCAB, hf_logprobs, pg_batch, policy_config

REPO = Path(__file__).resolve().parents[2]
LAYOUT = "eager-dp1"


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dualrl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=subprocess_env(session_site()),
                          timeout=timeout)  # fmt: skip


def test_the_entry_point_registers_it():
    assert "eager_torch" in backend_names()
    layout = parse_layout(LAYOUT)
    assert (layout.backend, layout.workers, layout.per_host) == ("eager_torch", 1, False)


def test_dualrl_config_selects_it_and_refuses_what_it_lacks_by_name():
    ok = _cli("config", "--backend", "eager_torch", "cluster.gpus_per_node=1")
    assert ok.returncode == 0, ok.stderr
    assert "backend: eager_torch" in ok.stdout
    refused = _cli("config", "--backend", "eager_torch", "policy.compile=true", "policy.cpu_offload=true")
    assert refused.returncode == 2, refused.stdout
    assert "policy.compile: true: the eager_torch backend does not support" in refused.stderr
    assert "policy.cpu_offload: true: the eager_torch backend does not support CPU offload" in refused.stderr
    # Its own layout rule: the default cluster has 2 devices, the backend runs one worker.
    assert "policy.parallel: the eager_torch backend runs on exactly 1 worker, the layout asks for 2" in refused.stderr


@pytest.mark.slow
def test_a_session_with_the_plugin_installed_passes_its_policy_and_contract_rows():
    """The next test and the layout contract suite's ``eager-dp1`` row, in a pytest session started
    with the plug-in on ``PYTHONPATH`` (as ``pip install`` would put it), so its Ray workers see it."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           "tests/plugin_backend/test_plugin_backend.py::test_a_policy_on_it_matches_hf",
           "tests/backends", "-k", "policy_on_it or eager-dp1"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, env=subprocess_env(session_site()), timeout=1800
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]


@pytest.mark.slow
def test_a_policy_on_it_matches_hf(ray_session, model_dirs, tokenizer):
    """get_logprobs and one train step (loss and gradient norm) against single-process HF at 1e-5."""
    if not os.environ.get(PLUGIN_SESSION_ENV):
        pytest.skip("needs a session started with the plug-in installed: run by the test above")
    from transformers import AutoModelForCausalLM

    from core.distributed import RayVirtualCluster
    from core.policy import Policy

    layout = parse_layout(LAYOUT)
    model_dir = model_dirs["llama"]
    cfg = apply_settings(policy_config(model_dir, layout.backend), layout.policy_settings())
    cluster = RayVirtualCluster([layout.workers], use_gpus=False, name="plugin_eager")
    try:
        policy = Policy(cluster, cfg, tokenizer, name_prefix="plugin_eager")
        try:
            ids, lens = random_batch(5, SEQ, VOCAB, seed=1)
            out = policy.get_logprobs(BatchedDataDict(input_ids=ids, input_lengths=lens))["logprobs"]
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            torch.testing.assert_close(out, hf_logprobs(hf, ids, lens), rtol=0, atol=1e-5)

            data, loss_fn = pg_batch(4, seed=3), ClippedPGLossFn(PG_CFG)
            ref_loss, ref_norm = reference_loss_and_norm(model_dir, data, loss_fn)
            step = policy.train(data, loss_fn)
            assert math.isclose(float(step.loss[0]), ref_loss, rel_tol=1e-5, abs_tol=1e-6)
            assert math.isclose(float(step.grad_norm[0]), ref_norm, rel_tol=1e-5)
        finally:
            policy.shutdown()
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_dualrl_parity_passes_against_hf():
    """The real CLI: every parity check of its layout against HF within the stated tolerances."""
    out = _cli("parity", "--layouts", LAYOUT, timeout=580)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "eager-dp1" in out.stdout
    assert " 0 error(s), 0 layout(s) skipped" in out.stdout and "\nPASS: " in out.stdout, out.stdout[-3000:]
