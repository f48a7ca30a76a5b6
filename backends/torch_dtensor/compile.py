"""``policy.compile``: ``torch.compile`` on each transformer block.

Per block, not the whole model: the blocks share one code object, so one compiled graph
serves them all (dynamo treats module parameters as inputs), and embedding / lm_head /
loss code stays eager.  Applied in torchtitan's order -- tensor parallel, then activation
checkpointing, then compile, then FSDP -- so FSDP's hooks (which dynamo skips) gather
parameters around the compiled region.  Every layout compiles to the eager numbers: data,
context, tensor and sequence parallelism, with or without activation checkpointing (with
context parallelism dynamo breaks the graph around the eager all-gathers of the attention).

``nn.Module.compile`` compiles in place, so the module tree, the parameter names (refit,
checkpoints, the reference swap) and FSDP's wrapping are those of the eager model.
Activation checkpointing is HF's per-block flag: its wrapper calls the block's compiled
forward (and again for the recomputation in backward).

**Pending collectives at the block boundary** (torch 2.13).  The embedding's
``RowwiseParallel`` finishes its all-reduce (reduce-scatter with sequence parallelism)
asynchronously, so the first block's input carries an ``AsyncCollectiveTensor`` (ACT): the
input itself without sequence parallelism (``use_local_output=True``), the local tensor of
the input DTensor with it.  AOT autograd mishandles both:

* a top-level ACT input is unwrapped with ``trigger_wait()`` (``process_inputs`` at compile
  time, the generated runtime wrapper at every call), which returns the inner tensor
  without autograd history: the compiled block is traced as if its input needed no
  gradient, and the blocks' gradient never reaches the embedding.  Every other gradient is
  right; the embedding's misses the blocks' share (tiny Llama, tp=2: grad norm 0.285 instead
  of 0.339; without FSDP's root wrapper the eager embedding's backward then fails with
  ``'Tensor' object has no attribute '_local_tensor'``).  Dynamo alone (backend ``eager``)
  is right; ``aot_eager`` shows it.  Minimal reproduction on 2 gloo ranks:
  ``x = DTensor.from_local(w, mesh, [Partial()]).redistribute(mesh, [Replicate()],
  async_op=True).to_local()``; ``torch.compile(f, backend="aot_eager")(x)`` does not
  require grad.  Upstream: pytorch PR #191113 ("Preserve requires_grad when unwrapping ACT
  inputs in process_inputs").
* a DTensor input whose local tensor is an ACT compiles to a graph that unwraps
  ``_local_tensor.elem``; with inductor, AOT autograd's cache hands that graph to the next
  block, whose input DTensor holds a plain tensor: ``'Tensor' object has no attribute
  'elem'`` (sequence parallelism, first ``get_logprobs``).

So each compiled block first waits for such inputs itself, eagerly, through an identity
autograd function (:class:`_WaitForCollective`): the graphs only ever see plain tensors
and DTensors of plain tensors, and gradients flow back to the embedding as in eager mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from backends.torch_common.layers import decoder_layers
from backends.torch_common.torch_private import AsyncCollectiveTensor, compiled_call, local_tensor_of, set_compiled_call


class _WaitForCollective(torch.autograd.Function):
    """ACT -> the plain tensor it wraps, waited for; identity in backward.  Unlike
    ``trigger_wait()`` it keeps the autograd edge to whatever produced the collective."""

    @staticmethod
    def forward(ctx, act: AsyncCollectiveTensor) -> torch.Tensor:
        waited = act.trigger_wait()
        return waited.view_as(waited)  # a fresh tensor for autograd's metadata; no copy

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _waited(x):
    """``x`` with its pending collective resolved: an ACT itself, or a DTensor whose local
    tensor is one (rebuilt around the waited tensor, same placements); else ``x`` as is."""
    if isinstance(x, AsyncCollectiveTensor):
        return _WaitForCollective.apply(x)
    if isinstance(x, DTensor) and isinstance(local_tensor_of(x), AsyncCollectiveTensor):
        return DTensor.from_local(
            _WaitForCollective.apply(x.to_local()),
            x.device_mesh,
            x.placements,
            run_check=False,
            shape=x.shape,
            stride=x.stride(),
        )
    return x


def _waiting_for_collectives(compiled: Callable) -> Callable:
    """``compiled``, called with its arguments' pending collectives resolved first (the
    arguments themselves, not tensors inside containers: HF passes the hidden states as an
    argument of their own)."""

    def call(*args, **kwargs):
        args = tuple(_waited(a) for a in args)
        kwargs = {k: _waited(v) for k, v in kwargs.items()}
        return compiled(*args, **kwargs)

    return call


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile every transformer block of ``model`` in place; returns how many.  ``backend``
    is torch.compile's (the worker uses inductor; tests may use a cheaper one).  Each
    block's compiled call resolves pending collectives in its arguments first (see the
    module docstring)."""
    blocks = decoder_layers(model)
    for block in blocks:
        block.compile(backend=backend)
        # nn.Module.__call__ runs the compiled call (torch.compile of block._call_impl).
        compiled = compiled_call(block)
        if compiled is None:
            raise RuntimeError(f"{type(block).__name__}.compile() left no compiled call to wrap")
        set_compiled_call(block, _waiting_for_collectives(compiled))
    return len(blocks)
