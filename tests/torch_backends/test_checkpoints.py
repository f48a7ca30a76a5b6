"""DCP resume, HF export and HF generation through the Policy, on two layouts."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.policy import Policy
from core.testing.tiny_models import random_batch
from tests.torch_backends.conftest import SEQ, VOCAB, hf_logprobs, pg_batch, policy_config
from tests.torch_backends.test_torch_policy import PG_CFG

CKPT_LAYOUTS = [
    pytest.param(("torch_fsdp", 1, False), id="fsdp1-dp2"),
    pytest.param(("torch_dtensor", 2, True), id="dtensor-tp2-sp"),
]


def _policy(cfg, tokenizer, **kwargs):
    cluster = RayVirtualCluster([2], use_gpus=False)
    return cluster, Policy(cluster, cfg, tokenizer, **kwargs)


@pytest.mark.parametrize("layout", CKPT_LAYOUTS)
def test_dcp_resume_gives_the_uninterrupted_next_step(layout, ray_session, model_dirs, tokenizer, tmp_path):
    backend, tp, sp = layout
    cfg = policy_config(model_dirs["llama"], backend, tp=tp, sp=sp)
    loss_fn = ClippedPGLossFn(PG_CFG)
    b1, b2 = pg_batch(4, seed=40), pg_batch(4, seed=41)
    probe = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(4, SEQ, VOCAB, seed=42), strict=True))

    cluster, policy = _policy(cfg, tokenizer)
    try:
        policy.train(b1, loss_fn)
        policy.save_checkpoint(tmp_path / "weights", tmp_path / "optim", tmp_path / "tok")
        uninterrupted = policy.train(b2, loss_fn)
        expected_lp = policy.get_logprobs(probe)["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()

    # Same layout; and for the FSDP1 checkpoint also the other backend (DCP reshards
    # by HF parameter name, so a run can move between backends).
    resume_cfgs = [cfg] + (
        [policy_config(model_dirs["llama"], "torch_dtensor", tp=2, sp=True)] if backend == "torch_fsdp" else []
    )
    for resume_cfg in resume_cfgs:
        cluster, resumed = _policy(
            resume_cfg, tokenizer, weights_path=tmp_path / "weights", optimizer_path=tmp_path / "optim"
        )
        try:
            step = resumed.train(b2, loss_fn)
            assert math.isclose(float(step["loss"][0]), float(uninterrupted["loss"][0]), rel_tol=1e-6, abs_tol=1e-7)
            assert math.isclose(float(step["grad_norm"][0]), float(uninterrupted["grad_norm"][0]), rel_tol=1e-5)
            assert step["lr"] == pytest.approx(uninterrupted["lr"])  # scheduler state restored
            # Same Adam moments => same update => same weights after the step.
            torch.testing.assert_close(resumed.get_logprobs(probe)["logprobs"], expected_lp, rtol=0, atol=1e-5)
        finally:
            resumed.shutdown()
            cluster.shutdown()
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


@pytest.mark.parametrize("layout", CKPT_LAYOUTS)
def test_hf_export_and_generate(layout, ray_session, model_dirs, tokenizer, tmp_path):
    """After a training step: the HF export loads in transformers with the policy's logprobs,
    and the policy's greedy generate equals a plain HF greedy decode of those weights."""
    backend, tp, sp = layout
    cfg = policy_config(model_dirs["qwen2"], backend, tp=tp, sp=sp)
    cluster, policy = _policy(cfg, tokenizer)
    try:
        policy.train(pg_batch(4, seed=50), ClippedPGLossFn(PG_CFG))
        policy.save_hf_checkpoint(tmp_path / "hf")
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()

        probe = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(5, SEQ, VOCAB, seed=51), strict=True))
        torch.testing.assert_close(
            policy.get_logprobs(probe)["logprobs"],
            hf_logprobs(exported, probe["input_ids"], probe["input_lengths"]),
            rtol=0,
            atol=1e-5,
        )

        prompts = BatchedDataDict(zip(("input_ids", "input_lengths"), random_batch(3, 6, VOCAB, seed=52), strict=True))
        out = policy.generate(prompts, greedy=True)
        n_new = cfg["generation"]["max_new_tokens"]
        for row in range(3):
            n = int(prompts["input_lengths"][row])
            expected = _greedy(exported, prompts["input_ids"][row, :n], n_new)
            got = out["output_ids"][row, : int(out["unpadded_sequence_lengths"][row])]
            assert got.tolist() == expected.tolist(), row
        # Generation logprobs are the policy's own logprobs of the generated tokens.
        lp = policy.get_logprobs(
            BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
        )["logprobs"]
        gen = torch.arange(out["output_ids"].shape[1])[None] >= prompts["input_lengths"][:, None]
        torch.testing.assert_close(out["logprobs"], torch.where(gen, lp, 0.0), rtol=0, atol=1e-5)
    finally:
        policy.shutdown()
        cluster.shutdown()


def _greedy(model, prompt: torch.Tensor, n_new: int) -> torch.Tensor:
    """Unbatched greedy decoding with plain forward passes (no KV cache, no padding).
    The tiny models' eos is id 2; stop after it like generate does."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n_new):
            nxt = model(input_ids=ids[None]).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt[None]])
            if int(nxt) == model.config.eos_token_id:
                break
    return ids
