"""The torch backends' fp32 linear layers on oneDNN when they run on a CPU.

torch sends a CPU fp32 matmul (``F.linear``, ``@``) to its BLAS, MKL in the official wheels.
MKL chooses its kernels by CPU vendor: on AMD parts it runs its generic AVX2 kernels
(``mkl_blas_def_sgemm_kernel_*_zen``: 256-bit FMAs only), so a CPU whose AVX-512 units are full
width gets at most half of its FMA rate from it.  oneDNN ships in the same wheel
(``torch.ops.mkldnn``, the op inductor emits for CPU linears) and chooses by instruction set
alone (``brg_matmul:avx512_core`` there); its fp32 matmul is a plain fp32 product (no
reduced-precision math mode is set here), so results differ from MKL's only in summation order,
within fp32 rounding.

:func:`route_cpu_linears` turns every plain ``torch.nn.Linear`` of a model into
:class:`OneDNNLinear` (same parameters, same state-dict names), whose forward and both
backward products (input and weight gradients) run on oneDNN whenever the call is fp32 on
plain CPU tensors; anything else -- a DTensor weight (tensor parallelism), another dtype, a
GPU, a graph being compiled -- takes ``F.linear`` as before.  The worker calls it once, before
sharding and after LoRA wraps its targets (whose frozen base product calls :func:`linear`), so
the switch needs no setting and no environment variable.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from backends.torch_common.torch_private import has_onednn_linear_op, onednn_linear

#: What ``route_cpu_linears`` reports for a model on each path.
ONEDNN, ATEN = "onednn", "aten"
#: The path this process's model was given (``linear_path``: reported by ``get_gpu_info``).
_routed: dict[str, Any] = {"path": None, "modules": 0}


def linear_path() -> dict[str, Any]:
    """``{"cpu_linear_path": "onednn" | "aten" | None, "cpu_linear_modules": n}``: what
    :func:`route_cpu_linears` did in this process (None: not called)."""
    return {"cpu_linear_path": _routed["path"], "cpu_linear_modules": _routed["modules"]}


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN and its linear op (CPU builds of torch >= 2.0)."""
    return torch.backends.mkldnn.is_available() and has_onednn_linear_op()


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` on oneDNN for 2-D ``x`` [M, K] and ``weight`` [N, K]; either may
    be a transposed view (oneDNN reads the strides), so the backward needs no copies."""
    return onednn_linear(x, weight, bias)


class _OneDNNLinearFunction(torch.autograd.Function):
    """``F.linear`` with all three products on oneDNN: forward ``y = x W^T + b``, backward
    ``dx = dy W`` and ``dW = dy^T x`` (``db = sum dy``), each computed only when needed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.input_shape, ctx.has_bias = x.shape, bias is not None
        return onednn_product(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = onednn_product(grad_rows, weight.t(), None).reshape(ctx.input_shape) if need_x else None
        grad_w = onednn_product(grad_rows.t(), rows.t(), None) if need_w else None
        grad_b = grad_rows.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def onednn_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """An fp32 call on plain (not DTensor) CPU tensors, outside a graph being compiled."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and type(x) in (torch.Tensor, torch.nn.Parameter)
        and x.shape[-1] > 0
        and not torch.compiler.is_compiling()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on oneDNN where :func:`onednn_eligible` (else ``F.linear`` itself)."""
    if onednn_eligible(x, weight) and (bias is None or type(bias) in (torch.Tensor, torch.nn.Parameter)):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose fp32 CPU calls run on oneDNN (:func:`linear`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def route_cpu_linears(model: torch.nn.Module, device: torch.device) -> str:
    """On a CPU with oneDNN: every module whose type is exactly ``torch.nn.Linear`` becomes an
    :class:`OneDNNLinear` in place (subclasses such as LoRA's keep their own forward; their inner
    linears are converted).  Returns the path the model's linears take: ``"onednn"`` or
    ``"aten"`` (a GPU, or a torch without oneDNN)."""
    if device.type != "cpu" or not onednn_linear_available():
        _routed.update(path=ATEN, modules=0)
        return ATEN
    converted = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = OneDNNLinear
            converted += 1
    _routed.update(path=ONEDNN, modules=converted)
    return ONEDNN
