"""What the refit tests share: bit-exact comparison, special values, a policy section."""

from __future__ import annotations

import torch

from core.policy.config import PolicyConfig

# Integer views with the same bits, for bit-exact comparisons (NaN != NaN, -0.0 == 0.0).
_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.dtype])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def special_values(shape, dtype, seed=0) -> torch.Tensor:
    """Random values with NaN, +-inf and -0.0 mixed in (when there is room)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    flat = t.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), float("-inf"), -0.0]):
        if i < flat.numel():
            flat[i] = v
    return t


def policy_config(precision: str, generation=None) -> PolicyConfig:
    """A torch_fsdp policy section of ``precision`` with ``generation``, as a worker holds it."""
    return PolicyConfig.coerce(
        {
            "backend": "torch_fsdp",
            "model_name": "m",
            "tokenizer": {"name": "m"},
            "train_global_batch_size": 2,
            "train_micro_batch_size": 1,
            "logprob_batch_size": 1,
            "max_total_sequence_length": 16,
            "precision": precision,
            "max_grad_norm": None,
            "generation": generation,
        },
        "policy",
    )


def vllm_generation(**vllm_cfg):
    """A vLLM generation section with ``vllm_cfg`` keys."""
    return {"backend": "vllm", "max_new_tokens": 4, "vllm_cfg": {"max_model_len": 16, **vllm_cfg}}
