"""Gemma 3 text under DTensor tensor parallelism (``tp_plans.gemma3_plan``), with and without
sequence parallelism: logprobs equal HF's single-process ones within 1e-5 (fp32) on rows longer
than the sliding window.  Slow: each layout starts a 2-worker policy."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lib.layouts import parse_layout
from core.testing.tiny_models import save_tiny_model
from tests.backends.conftest import layout_config, started_policy
from tests.torch_backends.conftest import SEQ, hf_logprobs, pg_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return save_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3"))


@pytest.mark.parametrize("layout", ["dtensor-tp2", "dtensor-tp2-sp"])
def test_gemma3_tp_logprobs_match_hf(layout, gemma3_dir, ray_session, tokenizer):
    from transformers import AutoModelForCausalLM

    lay = parse_layout(layout)
    data = pg_batch(5, seed=3)
    ref = hf_logprobs(
        AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval(),
        data["input_ids"],
        data["input_lengths"],
    )
    assert int(data["input_lengths"].max()) == SEQ > 4  # longer than the sliding window
    with started_policy(lay, layout_config(lay, gemma3_dir), tokenizer, f"gemma3-{layout}") as policy:
        out = policy.get_logprobs(data)["logprobs"]
    assert out.shape == ref.shape and (out[:, 0] == 0).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
