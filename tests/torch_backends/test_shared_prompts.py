"""Shared-prompt packing on the torch backends: a group's rows hold one copy of their prompt.

Through Ray and ``Policy`` (the driver deals whole groups over the data-parallel ranks and
bins them; the workers rebuild each bin's groups): the logprobs must be HF's, and the train
steps those of plain packing, on a GRPO-shaped batch -- prompts repeated over their samples,
completions of different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from tests.torch_backends.conftest import hf_logprobs, policy_config, shared_prompt_pg_batch
from tests.unit.test_losses import BASE_CFG

WIDTH = 32
#: (prompt length, row lengths): two groups per rank, one row with nothing generated.
GROUPS = [(12, [15, 20]), (20, [24, 22]), (6, [9, 6]), (9, [14, 11])]


def _run(model_dir, backend, tokenizer, shared: bool, tp: int = 1, cp: int = 1):
    cfg = policy_config(model_dir, backend, tp=tp, train_global_batch_size=8, train_micro_batch_size=4)
    cfg["parallel"]["context_parallel_size"] = cp
    cfg["make_sequence_length_divisible_by"] = 2 * cp
    cfg["optimizer"]["kwargs"]["eps"] = 1e-6  # see test_context_parallel_and_packing._layout_cfg
    cfg["sequence_packing"] = {
        **cfg["sequence_packing"],
        "enabled": True,
        "train_mb_tokens": 48,
        "logprob_mb_tokens": 48,
        "shared_prompts": shared,
    }
    data = shared_prompt_pg_batch(GROUPS, WIDTH, seed=5)
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    try:
        before = policy.get_logprobs(data)["logprobs"]
        trace = [policy.train(data, ClippedPGLossFn(BASE_CFG)) for _ in range(2)]
        after = policy.get_logprobs(data)["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    return data, before, [(float(t.loss[0]), float(t.grad_norm[0])) for t in trace], after


@pytest.mark.parametrize(
    "backend, tp, cp",
    [
        pytest.param("torch_fsdp", 1, 1, id="fsdp1-dp2"),
        pytest.param("torch_dtensor", 2, 1, id="dtensor-tp2", marks=pytest.mark.slow),
        pytest.param("torch_dtensor", 1, 2, id="dtensor-cp2", marks=pytest.mark.slow),
    ],
)
def test_shared_prompts_equal_plain_packing_and_hf(ray_session, model_dirs, tokenizer, backend, tp, cp):
    data, ref_before, ref_trace, ref_after = _run(model_dirs["llama"], backend, tokenizer, False, tp, cp)
    _, before, trace, after = _run(model_dirs["llama"], backend, tokenizer, True, tp, cp)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).float()
    assert (before - hf_logprobs(hf, data["input_ids"], data["input_lengths"])).abs().max() < 1e-5
    assert (before - ref_before).abs().max() < 1e-5
    for (loss, norm), (ref_loss, ref_norm) in zip(trace, ref_trace, strict=True):
        assert abs(loss - ref_loss) < 1e-5 and abs(norm - ref_norm) < 1e-5, (trace, ref_trace)
    assert (after - ref_after).abs().max() < 1e-4
    assert not torch.equal(after, before)  # the steps did train
