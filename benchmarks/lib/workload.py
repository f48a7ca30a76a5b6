"""What every benchmark feeds a Policy (and its HF baseline): the batches, the policy section on a
layout, and the default AdamW.

* :func:`make_batch`: right-padded random ids with ragged lengths (seed 0), NLL on every real
  token -- ``dualrl bench``, ``dualrl parity``; the driver and an HF child build identical ones.
* :func:`full_batch`: every row full length -- ``dualrl bench --gpu``.
* :func:`policy_config`: ``core/configs/default.yaml``'s policy section on a model, a layout
  (torch or JAX), a batch and a micro batch.
"""

from __future__ import annotations

import copy

from benchmarks.lib.layouts import Layout, LayoutError, apply_settings

#: RNG seed of the batches: every process that builds one builds the same.
SEED = 0


def default_policy_section() -> dict:
    from core.config.loader import DEFAULT_CONFIG_PATH, load_raw_config

    return copy.deepcopy(load_raw_config(DEFAULT_CONFIG_PATH)["policy"])


def make_batch(batch: int, seq: int, vocab: int):
    """NLL training batch (also fine for logprobs): ragged right padding, loss on every real token."""
    import torch

    from core.data import BatchedDataDict
    from core.testing.tiny_models import random_batch

    ids, lengths = random_batch(batch, seq, vocab, seed=SEED)
    valid = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    return BatchedDataDict(input_ids=ids, input_lengths=lengths, token_mask=valid, sample_mask=torch.ones(batch))


def full_batch(batch: int, seq: int, vocab: int):
    """Full-length rows of seeded random ids (specials excluded), NLL on every token."""
    import torch

    from core.data import BatchedDataDict

    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=torch.full((batch,), seq),
        token_mask=torch.ones(batch, seq),
        sample_mask=torch.ones(batch),
    )


def optimizer_kwargs(lr: float | None = None, fused: bool = False) -> dict:
    """The default policy section's AdamW kwargs (what the workers build), optionally changed."""
    kwargs = dict(default_policy_section()["optimizer"]["kwargs"])
    kwargs["betas"] = tuple(kwargs["betas"])  # YAML gives a list
    if lr is not None:
        kwargs["lr"] = lr
    if fused:
        kwargs["fused"] = True
    return kwargs


def policy_config(
    model_path: str,
    tokenizer_path: str,
    layout: Layout,
    batch: int,
    seq: int,
    precision: str,
    micro: int | None = None,
    packing: dict | None = None,
    lora: dict | None = None,
) -> dict:
    """The default policy section on this model and layout, width ``seq``; micro batches of
    ``micro`` rows per data-parallel rank (default: one micro batch of all the rank's rows);
    ``packing`` updates ``sequence_packing`` (``benchmarks.packing``); a ``-dynamic`` layout
    plans token-budget micro batches of a rank's ``local x seq`` padded tokens; ``lora``: the
    ``policy.lora`` settings of a ``-lora`` layout (one without them is refused by name).
    A rank is a device of the data axis on every backend (a JAX worker owning several runs
    ``micro`` rows on each)."""
    cfg = apply_settings(default_policy_section(), layout.policy_settings())
    local = min(micro or batch, batch // layout.dp)
    cfg.update(
        model_name=model_path,
        train_global_batch_size=batch,
        train_micro_batch_size=local,
        logprob_batch_size=local,
        max_total_sequence_length=seq,
        precision=precision,
    )
    cfg["tokenizer"]["name"] = tokenizer_path
    if layout.packed:  # packed rows of at most one padded micro batch's tokens
        cfg["sequence_packing"].update(enabled=True, train_mb_tokens=local * seq, logprob_mb_tokens=local * seq)
    if packing:
        cfg["sequence_packing"].update(packing)
    if layout.dynamic:  # token budgets of one rank's padded micro batch: more rows where they are short
        cfg["dynamic_batching"].update(layout.dynamic_batching(local * seq))
    if layout.lora:
        if lora is None:  # a benchmark with no LoRA settings of its own would run the base model
            raise LayoutError(f"layout {layout.name!r}: -lora (policy.lora) is measured by dualrl parity only")
        cfg["lora"].update(enabled=True, **lora)
    return cfg
