"""Padded vocabulary for the DTensor backend's training copy (see ``core.policy.vocab_padding``).

Tensor parallelism shards the input embedding and the lm_head over the vocabulary, so the
training copy of both is padded with zero rows to ``padded_vocab_size(V, tp,
make_vocab_size_divisible_by)`` before the TP plan is applied.  The HF config keeps the
original ``vocab_size`` (export and the generation replica are built from it).  Three rules
keep the padding invisible:

* the padded logit columns are set to the dtype's lowest value by a forward hook on the
  lm_head (registered *before* the TP plan, so it sees the lm_head's DTensor output with
  its global layout, whatever the plan does with it afterwards): every softmax downstream
  (the vocab-parallel logprob kernel, the plain kernel) gives them probability exactly 0,
  and the hook's ``masked_fill`` gives them zero gradient, so the padded lm_head rows get
  none; the padded embedding rows are never indexed (token ids are < V), so they get none
  either -- AdamW (decoupled weight decay of 0 is 0) keeps both at exactly zero;
* a loss that reads the full logits (no ``loss_from_logprobs``) is handed ``[..., :V]``;
* ``unpad_rows`` cuts every exported tensor (refit, HF export, the HF generate replica)
  back to its HF shape.

DCP checkpoints hold the padded training copy: they load into the same layout (same padded
size), not into one with a different padded vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from core.policy.vocab_padding import padded_vocab_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from core.interfaces import LossFunction

__all__ = ["padded_vocab_size", "pad_vocab_", "mask_padded_logits", "unpad_rows", "OriginalVocabLoss"]


def _pad_rows(module: torch.nn.Module, size_attr: str, padded: int) -> None:
    """Replace ``module.weight`` [V, ...] (and a bias [V]) by a zero-padded [padded, ...] copy."""
    for name in ("weight", "bias"):
        param = getattr(module, name, None)
        if param is None:
            continue
        extra = padded - param.shape[0]
        data = torch.cat([param.data, param.data.new_zeros((extra, *param.shape[1:]))])
        setattr(module, name, torch.nn.Parameter(data, requires_grad=param.requires_grad))
    setattr(module, size_attr, padded)


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """``module.weight`` (torch types a submodule attribute as a tensor or a module)."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight


def pad_vocab_(model: PreTrainedModel, padded: int) -> torch.utils.hooks.RemovableHandle | None:
    """Pad ``model``'s input embedding and output layer to ``padded`` rows (zeros), in place,
    and mask the padded logits; returns the mask hook's handle (None: nothing to pad).

    Call before any sharding.  ``model.config.vocab_size`` is left as it is (the original
    vocabulary); tied embeddings stay one parameter.
    """
    vocab = int(model.config.vocab_size)
    if padded < vocab:
        raise ValueError(f"padded vocab size {padded} < vocab_size {vocab}")
    if padded == vocab:
        return None
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    emb_rows = _weight(emb).shape[0]
    if emb_rows != vocab or (head is not None and head.weight.shape[0] != vocab):
        raise ValueError(
            f"cannot pad the vocabulary: config vocab_size={vocab} but the input embedding has "
            f"{emb_rows} rows and the output layer "
            f"{None if head is None else head.weight.shape[0]}"
        )
    tied = head is not None and head.weight is emb.weight
    _pad_rows(emb, "num_embeddings", padded)
    if head is None:
        return None
    if tied:
        head.weight = emb.weight
    else:
        _pad_rows(head, "out_features", padded)
    return head.register_forward_hook(lambda _module, _inputs, out: mask_padded_logits(out, vocab))


def _column_offset(logits: DTensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, the global id of its first vocab column) of a DTensor
    whose vocab (last) dim is replicated or evenly sharded on one mesh dim."""
    local = logits.to_local()
    last, mesh = logits.ndim - 1, logits.device_mesh
    vocab_shards = [d for d, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim % logits.ndim == last]
    others_ok = all(isinstance(p, (Replicate, Shard)) for p in logits.placements)
    if not vocab_shards and others_ok:
        return local, 0
    if others_ok and len(vocab_shards) == 1 and local.shape[-1] * mesh.size(vocab_shards[0]) == logits.shape[-1]:
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("padded vocabulary: this rank is not in the logits' device mesh")
        return local, coordinate[vocab_shards[0]] * local.shape[-1]
    raise ValueError(
        f"padded vocabulary: cannot mask lm_head logits placed {tuple(logits.placements)} with global "
        f"shape {tuple(logits.shape)} (the vocab dim must be replicated or evenly sharded on one mesh dim)"
    )


def mask_padded_logits(logits: Any, vocab_size: int) -> Any:
    """Logits [..., V_padded] (a DTensor, or a plain full tensor) with every column >= ``vocab_size``
    set to the dtype's lowest value; out of place, only where this rank holds such columns."""
    if isinstance(logits, DTensor):
        local, start = _column_offset(logits)
        masked = _mask_local(local, start, vocab_size)
        if masked is local:
            return logits
        return DTensor.from_local(
            masked, logits.device_mesh, logits.placements, run_check=False, shape=logits.shape, stride=logits.stride()
        )
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"padded vocabulary: lm_head returned {type(logits).__name__}, expected a tensor")
    return _mask_local(logits, 0, vocab_size)


def _mask_local(local: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    width = local.shape[-1]
    if start + width <= vocab_size:
        return local  # no padded column on this rank
    padded = torch.arange(start, start + width, device=local.device) >= vocab_size
    return local.masked_fill(padded, torch.finfo(local.dtype).min)


def unpad_rows(tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A full tensor of the training copy -> its HF ``shape`` (padded vocab rows cut off)."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if tensor.ndim == len(shape) and tensor.shape[0] > shape[0] and tuple(tensor.shape[1:]) == tuple(shape[1:]):
        return tensor[: shape[0]]
    raise ValueError(f"full tensor of shape {tuple(tensor.shape)} does not fit its HF shape {tuple(shape)}")


class OriginalVocabLoss:
    """A loss that reads the full logits, called with the original vocabulary ``[..., :V]``
    (the padded columns carry no probability, but a loss must see the model's real V)."""

    def __init__(self, loss_fn: LossFunction, vocab_size: int) -> None:
        self._loss_fn = loss_fn
        self._vocab_size = vocab_size

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        return self._loss_fn(logits[..., : self._vocab_size], data, global_valid_seqs, global_valid_toks)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loss_fn, name)
