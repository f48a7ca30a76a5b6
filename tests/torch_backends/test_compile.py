"""``policy.dtensor_cfg.compile``: torch.compile per transformer block (inductor; gcc on CPU).

The fast tests check the wiring (every block compiled in place, parameter names unchanged,
tensor parallelism refused naming the fields) and, in-process with the ``aot_eager``
backend, that the traced blocks give the eager logits and gradients.  The slow test runs a
compiled (inductor) and an eager DTensor dp2 policy on the same data: logprobs, one AdamW
step's loss and gradient norm, logprobs after the step.  Measured on CPU (fp32): logprobs
differ by <= 1e-6, loss and grad norm are equal to 9 digits; the bounds leave ~5x room.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster
from core.losses import ClippedPGLossFn
from core.parallel_dims import ParallelDims
from core.policy import Policy
from core.testing.tiny_models import build_tiny_model, random_batch

from backends.torch_common.layers import decoder_layers
from backends.torch_dtensor.compile import check_compile_supported, compile_blocks
from tests.torch_backends.conftest import SEQ, VOCAB, pg_batch, policy_config
from tests.torch_backends.test_torch_policy import PG_CFG


def test_compile_blocks_in_place_keeps_names():
    model = build_tiny_model("llama")
    names = list(model.state_dict())
    assert compile_blocks(model) == 2
    assert all(block._compiled_call_impl is not None for block in decoder_layers(model))
    assert model._compiled_call_impl is None  # embeddings, lm_head, loss stay eager
    assert list(model.state_dict()) == names  # no "_orig_mod." wrapper in any name


def test_compiled_blocks_trace_to_the_eager_gradients():
    """The fast variant: dynamo + AOT autograd (backend ``aot_eager``: the graphs compile's
    inductor would get, run by eager kernels) on every block, activation checkpointing on,
    forward and backward against the eager model, in-process, ~5 s."""
    from torch._dynamo.utils import counters

    ids, lens = random_batch(3, SEQ, VOCAB, seed=2)
    mask = (torch.arange(SEQ)[None] < lens[:, None]).long()
    counters.clear()
    grads = []
    for compiled in (False, True):
        model = build_tiny_model("llama").train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if compiled:
            compile_blocks(model, backend="aot_eager")
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # as the workers call it
        (logits.float().logsumexp(-1) * mask).sum().backward()
        grads.append((logits.detach(), [p.grad for p in model.parameters()]))
    # The compiled run went through AOT autograd, and one graph served both blocks.
    assert counters["aot_autograd"]["ok"] >= 1 and counters["stats"]["unique_graphs"] == 1
    (eager_logits, eager_grads), (comp_logits, comp_grads) = grads
    torch.testing.assert_close(comp_logits, eager_logits, rtol=0, atol=1e-5)
    for g_eager, g_comp in zip(eager_grads, comp_grads):
        torch.testing.assert_close(g_comp, g_eager, rtol=1e-5, atol=1e-6)


def test_compile_with_tensor_parallel_is_refused_naming_the_fields():
    check_compile_supported(ParallelDims(4, cp=2))  # data and context parallel are supported
    with pytest.raises(ValueError, match=r"policy.dtensor_cfg.compile=true with "
                                         r"policy.dtensor_cfg.tensor_parallel_size=2"):
        check_compile_supported(ParallelDims(4, tp=2))


def _run(cfg, tokenizer):
    ids, lens = random_batch(4, SEQ, VOCAB, seed=1)
    probe = BatchedDataDict(input_ids=ids, input_lengths=lens)
    cluster = RayVirtualCluster([2], use_gpus=False)
    policy = Policy(cluster, cfg, tokenizer)
    try:
        before = policy.get_logprobs(probe)["logprobs"]
        out = policy.train(pg_batch(4, seed=10), ClippedPGLossFn(PG_CFG))
        after = policy.get_logprobs(probe)["logprobs"]
    finally:
        policy.shutdown()
        cluster.shutdown()
    return before, float(out["loss"][0]), float(out["grad_norm"][0]), after


@pytest.mark.slow  # ~65 s on the 2-core CI machine (cold inductor cache), mostly compiling
def test_compiled_blocks_match_eager(ray_session, model_dirs, tokenizer):
    """Inductor, with activation checkpointing and 2 micro batches per rank (gradient
    accumulation without sync), against the same policy uncompiled."""
    cfg = policy_config(model_dirs["llama"], "torch_dtensor", train_micro_batch_size=1)
    cfg["dtensor_cfg"]["activation_checkpointing"] = True
    eager = _run(cfg, tokenizer)
    cfg["dtensor_cfg"]["compile"] = True
    compiled = _run(cfg, tokenizer)
    assert (compiled[0] - eager[0]).abs().max() <= 5e-6
    assert math.isclose(compiled[1], eager[1], rel_tol=1e-6, abs_tol=1e-7)
    assert math.isclose(compiled[2], eager[2], rel_tol=1e-6)
    assert (compiled[3] - eager[3]).abs().max() <= 5e-6
    assert not torch.equal(compiled[3], compiled[0])  # the compiled policy did train
