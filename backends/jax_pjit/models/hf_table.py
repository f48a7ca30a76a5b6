"""The row type of a family's HF name table (``HF_TABLES`` in each family module).

Each row is ``(HF name pattern, JAX state path pattern, transform)``; ``{i}`` stands for the
layer index, ``{j}`` for the expert index of a mixture of experts: the HF checkpoint holds one
tensor per expert, the JAX parameter stacks them along its first dim (row ``j`` of it).
``backends.jax_pjit.hf_mapping`` reads a family's rows for checkpoint import, export and
refit; its ``TRANSFORMS`` define the transform names.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Row"]


class Row(NamedTuple):
    hf: str  # HF state-dict name, ``{i}`` = layer index
    jax: str  # "/"-separated path in ``nnx.state(model, nnx.Param)``
    transform: str  # a key of hf_mapping.TRANSFORMS
    untied_only: bool = False  # dropped for models with tied word embeddings
    vocab_dim: int | None = None  # the JAX dim over the vocabulary (padded to cfg.padded_vocab_size)
    #: Only the layers of this kind (the family module's ``layer_kind(cfg, i)``, e.g. "moe" /
    #: "dense"); None: every layer.
    layers: str | None = None
