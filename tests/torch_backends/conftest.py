"""Helpers for the backend tests: policy configs, HF references, training batches, collective counts.

(The tiny-model fixtures ``model_dirs`` and ``tokenizer`` live in tests/conftest.py.)

Every model is built from a config with a fixed seed (no downloads) and loaded by the
workers through ``from_pretrained`` on its path, the same code path as a hub model.
"""

from __future__ import annotations

import collections
import copy
import json
import os
from pathlib import Path

import torch

from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config
from core.testing.tiny_models import random_batch

SEQ = 12
VOCAB = 256


def policy_config(model_dir: Path, backend: str, tp: int = 1, sp: bool = False, **overrides) -> dict:
    """The default policy section pointed at a tiny model, with test-sized batches and a
    learning rate large enough that three steps visibly move the weights.  Batch sizes are
    per data-parallel device: 2 rows on each of a torch layout's (at most 2) ranks; 1 on each
    device of a JAX mesh's fsdp axis (the session's JAX worker owns 8 devices: mostly fsdp 4
    x tp 2, whose micro batch is the 4-row global batch)."""
    rows = 1 if backend == "jax_pjit" else 2
    cfg = copy.deepcopy(load_raw_config(DEFAULT_CONFIG_PATH)["policy"])
    cfg.update(
        backend=backend,
        model_name=str(model_dir),
        train_global_batch_size=4,
        train_micro_batch_size=rows,
        logprob_batch_size=rows,
        max_total_sequence_length=32,
    )
    cfg["tokenizer"]["name"] = str(model_dir / "tokenizer")
    cfg["parallel"].update(tensor_parallel_size=tp, sequence_parallel=sp)
    cfg["optimizer"]["kwargs"].update(lr=1e-2, weight_decay=0.01)
    cfg["scheduler"] = [
        {
            "name": "torch.optim.lr_scheduler.LinearLR",
            "kwargs": {"start_factor": 0.5, "end_factor": 1.0, "total_iters": 2},
        },
    ]
    cfg["max_grad_norm"] = 1.0
    cfg["generation"].update(max_new_tokens=6, temperature=1.0)
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def hf_logprobs(model, input_ids: torch.Tensor, input_lengths: torch.Tensor, temperature: float = 1.0):
    """Single-process HF reference in the ``get_logprobs`` layout: [0, logp...], padding 0."""
    mask = torch.arange(input_ids.shape[1])[None] < input_lengths[:, None]
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask.long()).logits.double() / temperature
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], 1)
    return (lp * mask).float()


def pg_batch(batch: int, seed: int):
    """A ClippedPG training batch with ragged right padding and a masked-out prompt token."""
    from core.data import BatchedDataDict

    ids, lens = random_batch(batch, SEQ, VOCAB, seed=seed, min_len=4)
    g = torch.Generator().manual_seed(seed + 1)
    valid = (torch.arange(SEQ)[None] < lens[:, None]).float()
    token_mask = valid.clone()
    token_mask[:, :2] = 0  # the "prompt": no loss on it
    old = -torch.rand(batch, SEQ, generator=g) * 3 * valid
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=token_mask,
        sample_mask=torch.ones(batch),
        advantages=torch.randn(batch, SEQ, generator=g) * valid,
        prev_logprobs=old,
        generation_logprobs=old,
        reference_policy_logprobs=old,
    )


def uneven_pg_batch(lengths, width: int, seed: int):
    """A ClippedPG batch with the given real lengths (right padding to ``width``, the first two
    tokens a masked-out prompt): the packing / context-parallel tests' batch."""
    from core.data import BatchedDataDict

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    valid = torch.arange(width)[None] < lens[:, None]
    ids = torch.randint(4, VOCAB, (len(lengths), width), generator=g) * valid
    token_mask = valid.float()
    token_mask[:, :2] = 0
    old = -torch.rand(len(lengths), width, generator=g) * 3 * valid
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=token_mask,
        sample_mask=torch.ones(len(lengths)),
        advantages=torch.randn(len(lengths), width, generator=g) * valid,
        prev_logprobs=old,
        generation_logprobs=old,
        reference_policy_logprobs=old,
    )


def shared_prompt_pg_batch(groups, width: int, seed: int):
    """A ClippedPG batch of prompt groups, as GRPO builds one: ``groups`` is a list of
    ``(prompt length, [row lengths])``; a group's rows repeat one random prompt and go on with
    their own random completions (``token_mask`` 1 on them), right-padded to ``width``."""
    g = torch.Generator().manual_seed(seed)
    rows = [(p, n) for p, lengths in groups for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    r = 0
    for p, lengths in groups:
        prompt = torch.randint(4, VOCAB, (p,), generator=g)
        for n in lengths:
            ids[r, :p] = prompt
            ids[r, p:n] = torch.randint(4, VOCAB, (n - p,), generator=g)
            token_mask[r, p:n] = 1
            r += 1
    batch = uneven_pg_batch([n for _, n in rows], width, seed)
    batch["input_ids"], batch["token_mask"] = ids, token_mask
    batch["advantages"] = batch["advantages"] * token_mask
    return batch


# c10d ops in a worker's profiler trace, FSDP2 / FSDP1 (FSDP1 all-gathers CPU tensors with the list form).
ALL_GATHERS = ("c10d::_allgather_base_", "c10d::allgather_")
REDUCE_SCATTERS = ("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_")


def count_collectives(policy, call) -> dict[str, int]:
    """{"all_gather": n, "reduce_scatter": n}: the c10d ops rank 0 issued during ``call()``,
    from the workers' own profiler traces (``start_gpu_profiling`` / ``stop_gpu_profiling``)."""
    policy.start_gpu_profiling()
    try:
        call()
    finally:
        paths = policy.stop_gpu_profiling()
    with open(paths[0]) as f:
        names = collections.Counter(e.get("name") for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op")
    for path in paths:
        os.remove(path)
    return {"all_gather": sum(names[n] for n in ALL_GATHERS), "reduce_scatter": sum(names[n] for n in REDUCE_SCATTERS)}
