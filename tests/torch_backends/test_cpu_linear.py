"""The torch backends' fp32 CPU linears on oneDNN (``backends.torch_common.cpu_linear``): the same
products as ``F.linear`` to fp32 rounding, forward and both gradients, and an HF model routed
through it keeps HF's logits and gradients at the parity bar (1e-5).  The workers' own routing
is checked where a torch Policy runs (``test_micro_batch_collectives.py``: ``cpu_linear_path``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backends.torch_common import cpu_linear
from backends.torch_common.lora import LoRALinear

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_linear_available(), reason="this torch has no oneDNN")


def _grads(fn, x, w, b):
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in (x, w, b)]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 33)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_equal_f_linear_to_fp32_rounding(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(19, 33, generator=g, requires_grad=True)
    b = torch.randn(19, generator=g, requires_grad=True) if bias else None
    ours, our_grads = _grads(cpu_linear.linear, x, w, b)
    ref, ref_grads = _grads(F.linear, x, w, b)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    for got, want in zip(our_grads, ref_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_other_calls_take_f_linear():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8)  # frozen, as LoRA's base weight
    _, (gx, gw, _) = _grads(cpu_linear.linear, x, w, None)
    assert gx is not None and gw is None
    assert cpu_linear.onednn_eligible(x, w)
    assert not cpu_linear.onednn_eligible(x.bfloat16(), w.bfloat16())  # bf16: aten already runs oneDNN
    assert not cpu_linear.onednn_eligible(x.double(), w.double())


def test_route_converts_plain_linears_only_and_keeps_the_state_dict():
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    lora = LoRALinear(torch.nn.Linear(8, 6), torch.zeros(2, 8), torch.zeros(6, 2), scale=2.0)
    model = torch.nn.Sequential(base, torch.nn.ReLU(), lora, torch.nn.LayerNorm(6))
    keys = list(model.state_dict())
    assert cpu_linear.route_cpu_linears(model, torch.device("cuda")) == cpu_linear.ATEN  # a GPU: untouched
    assert type(model[0]) is torch.nn.Linear
    assert cpu_linear.route_cpu_linears(model, torch.device("cpu")) == cpu_linear.ONEDNN
    assert type(model[0]) is cpu_linear.OneDNNLinear and type(model[2]) is LoRALinear
    assert type(lora.lora_A) is cpu_linear.OneDNNLinear and type(lora.lora_B) is cpu_linear.OneDNNLinear
    assert list(model.state_dict()) == keys
    assert cpu_linear.linear_path() == {"cpu_linear_path": "onednn", "cpu_linear_modules": 3}


def test_an_hf_model_routed_keeps_its_logits_and_gradients(model_dirs):
    from transformers import AutoModelForCausalLM

    def run(routed: bool):
        model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
        if routed:
            assert cpu_linear.route_cpu_linears(model, torch.device("cpu")) == cpu_linear.ONEDNN
        ids = torch.randint(4, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
        logits = model(input_ids=ids).logits
        logits.log_softmax(-1)[..., 5].sum().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    logits, grads = run(True)
    ref_logits, ref_grads = run(False)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for name, grad in ref_grads.items():  # within 1e-5 of each gradient's scale (fp32 summation order)
        assert (grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
