"""``policy.dtensor_cfg.compile``: ``torch.compile`` on each transformer block.

Per block, not the whole model: the blocks share one code object, so one compiled graph
serves them all (dynamo treats module parameters as inputs), and embedding / lm_head /
loss code stays eager.  Applied in torchtitan's order -- tensor parallel, then activation
checkpointing, then compile, then FSDP -- so FSDP's hooks (which dynamo skips) gather
parameters around the compiled region.  (TP + compile is refused for now, see
:func:`check_compile_supported`.)

``nn.Module.compile`` compiles in place, so the module tree, the parameter names (refit,
checkpoints, the reference swap) and FSDP's wrapping are those of the eager model.
Activation checkpointing is HF's per-block flag: its wrapper calls the block's compiled
forward (and again for the recomputation in backward).
"""

from __future__ import annotations

import torch

from core.parallel_dims import ParallelDims

from backends.torch_common.layers import decoder_layers

FIELD = "policy.dtensor_cfg.compile"


def check_compile_supported(dims: ParallelDims) -> None:
    """Refuse, naming the fields, a layout whose compiled blocks are known to be wrong.

    Tensor parallelism: with torch 2.13 (CPU, gloo) the compiled TP blocks give the eager
    logprobs and loss but wrong gradients (tiny Llama, tp=2: grad norm 0.285 vs 0.339
    eager, and the trained weights drift), and with sequence parallelism they fail outright
    in AOT autograd's DTensor wrapper.  Context parallelism works (dynamo breaks the graph
    around the eager all-gathers of the attention; parity as without cp).
    """
    if dims.tp > 1:
        raise ValueError(
            f"{FIELD}=true with policy.dtensor_cfg.tensor_parallel_size={dims.tp}: torch.compile of "
            "tensor-parallel blocks computes wrong gradients in this torch version (see "
            "backends/torch_dtensor/compile.py); turn one of them off"
        )


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer block of ``model`` in place; returns how many.  ``backend``
    is torch.compile's (the worker uses inductor; tests may use a cheaper one)."""
    blocks = decoder_layers(model)
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)
