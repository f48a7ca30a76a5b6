"""policy.lora through Ray on each backend: the same adapter init gives the same logprobs, loss
and gradient norm as a single-process torch LoRA model; the refit stream carries merged
weights under the HF names; the HF export loads in transformers and matches the adapted
policy, and its PEFT adapter directory loads with ``peft`` (skipped when peft is missing).

Tensor parallel layouts shard the adapters with their base (torch: ``LoRAColwiseParallel`` /
``LoRARowwiseParallel``; JAX: the adapters' logical axes)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from benchmarks.lib.layouts import parse_layout
from core.losses import ClippedPGLossFn
from core.policy.worker_base import LORA_ADAPTER_DIR
from tests.backends.conftest import layout_config, ragged, read_refit_stream, started_policy
from tests.hf_reference import PG_CFG, hf_forward_loss
from tests.torch_backends.conftest import hf_logprobs, pg_batch

pytestmark = pytest.mark.slow

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": "all-linear", "init_seed": 5}


def _reference(model_dir, data, loss_fn):
    """Single-process torch with the same adapters: (model, loss, adapter grad norm)."""
    from transformers import AutoModelForCausalLM

    from backends.torch_common.lora import apply_lora
    from core.policy.config import LoRAConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_lora(model, LoRAConfig(**LORA))
    loss = hf_forward_loss(model, data, loss_fn)
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return model, float(loss.detach()), float(norm)


def _one_step_from_b0(policy, probe, batch, loss_fn, base, ref_loss, ref_norm):
    """B = 0 gives the base model's logprobs; one train step equals the single-process LoRA
    reference (loss, grad norm); the adapters move.  Returns the logprobs before and after."""
    ids, lens = probe["input_ids"], probe["input_lengths"]
    before = policy.get_logprobs(probe)["logprobs"]
    torch.testing.assert_close(before, hf_logprobs(base, ids, lens), rtol=0, atol=1e-5)
    result = policy.train(batch, loss_fn)
    assert math.isclose(result.loss[0], ref_loss, rel_tol=1e-5), (result.loss, ref_loss)
    assert math.isclose(result.grad_norm[0], ref_norm, rel_tol=1e-5), (result.grad_norm, ref_norm)
    after = policy.get_logprobs(probe)["logprobs"]
    assert (after - before).abs().max() > 1e-4  # the adapters moved
    return before, after


@pytest.mark.parametrize(
    "layout", ["fsdp1-dp2", "dtensor-dp2", "dtensor-tp2", "dtensor-tp2-sp", "jax-fsdp8", "jax-fsdp4-tp2"]
)
def test_lora_same_init_same_step_merged_refit_and_export(layout, model_dirs, tokenizer, ray_session, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["llama"]
    cfg = layout_config(layout, model_dir, lora=LORA)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    probe = ragged(4, seed=20)
    batch = pg_batch(4, seed=10)
    loss_fn = ClippedPGLossFn(PG_CFG)
    _, ref_loss, ref_norm = _reference(model_dir, batch, loss_fn)
    with started_policy(parse_layout(layout), cfg, tokenizer, f"lora_{layout.replace('-', '_')}") as policy:
        _, after = _one_step_from_b0(policy, probe, batch, loss_fn, base, ref_loss, ref_norm)
        ids, lens = probe["input_ids"], probe["input_lengths"]

        stream = dict(read_refit_stream(policy))
        assert set(stream) == set(base.state_dict())  # HF names only, no adapter
        merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        merged.load_state_dict({k: torch.as_tensor(v).float() for k, v in stream.items()}, strict=False)
        torch.testing.assert_close(hf_logprobs(merged, ids, lens), after, rtol=0, atol=1e-5)
        # Frozen base weights: every weight LoRA does not adapt leaves the step unchanged.
        for name, value in stream.items():
            if not any(t in name for t in ("_proj.",)):
                torch.testing.assert_close(torch.as_tensor(value).float(), base.state_dict()[name], rtol=0, atol=0)

        export = tmp_path / "hf"
        policy.save_hf_checkpoint(str(export))
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logprobs(exported, ids, lens), after, rtol=0, atol=1e-5)
    adapter_dir = export / LORA_ADAPTER_DIR
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()
    peft = pytest.importorskip("peft")
    peft_model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir
    ).eval()
    torch.testing.assert_close(hf_logprobs(peft_model, ids, lens), after, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["fsdp1-dp2", "dtensor-tp2", "jax-fsdp4-tp2"])
def test_a_run_starts_from_its_exported_adapter_and_resumes_from_its_checkpoint(
    layout, model_dirs, tokenizer, ray_session, tmp_path
):
    """policy.lora.adapter_path: the HF export's ``lora_adapter/`` starts a new run exactly
    where the exporting run ended (TP layouts shard the loaded A / B like the seeded ones);
    a resumed run takes its adapters from its checkpoint and does not read adapter_path."""
    model_dir = model_dirs["llama"]
    lay, name = parse_layout(layout), f"lora_from_{layout.replace('-', '_')}"
    probe, loss_fn = ragged(4, seed=21), ClippedPGLossFn(PG_CFG)
    with started_policy(lay, layout_config(layout, model_dir, lora=LORA), tokenizer, name) as policy:
        policy.train(pg_batch(4, seed=11), loss_fn)
        trained = policy.get_logprobs(probe)["logprobs"]
        policy.save_hf_checkpoint(str(tmp_path / "hf"))
    from_adapter = layout_config(
        layout, model_dir, lora={**LORA, "adapter_path": str(tmp_path / "hf" / LORA_ADAPTER_DIR)}
    )
    weights, optimizer = str(tmp_path / "ckpt" / "weights"), str(tmp_path / "ckpt" / "optimizer")
    with started_policy(lay, from_adapter, tokenizer, name + "_2") as policy:
        torch.testing.assert_close(policy.get_logprobs(probe)["logprobs"], trained, rtol=0, atol=1e-5)
        policy.train(pg_batch(4, seed=12), loss_fn)
        again = policy.get_logprobs(probe)["logprobs"]
        assert (again - trained).abs().max() > 1e-4  # the step moved the adapters away from the file's
        policy.save_checkpoint(weights, optimizer)
    shutil.rmtree(tmp_path / "hf" / LORA_ADAPTER_DIR)  # neither the driver nor a worker reads it on resume
    with started_policy(lay, from_adapter, tokenizer, name + "_3", weights_path=weights, optimizer_path=optimizer) as p:
        torch.testing.assert_close(p.get_logprobs(probe)["logprobs"], again, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["dtensor-dp2", "jax-fsdp8"])
def test_lora_on_a_mixture_of_experts_adapts_the_same_linears(layout, model_dirs, tokenizer, ray_session, tmp_path):
    """Tiny Qwen3-MoE (layer 0 dense, layer 1 sparse), "all-linear": attention and the dense
    MLP are adapted, the fused experts are not (the JAX weight table lists them per expert; it
    must pick the torch backends' linears): B = 0 is the base model, one step's loss and
    gradient norm equal the single-process torch LoRA model's, the merged HF export loads
    with the trained logprobs, and the experts and router did not move."""
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["qwen3_moe"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    probe, batch, loss_fn = ragged(4, seed=20), pg_batch(4, seed=10), ClippedPGLossFn(PG_CFG)
    reference, ref_loss, ref_norm = _reference(model_dir, batch, loss_fn)
    adapted = sorted(n for n, p in reference.named_parameters() if p.requires_grad)
    assert len(adapted) == 2 * (4 + 4 + 3) and not any(".experts." in n or ".mlp.gate." in n for n in adapted)
    ids, lens = probe["input_ids"], probe["input_lengths"]
    cfg = layout_config(layout, model_dir, lora=LORA)
    with started_policy(parse_layout(layout), cfg, tokenizer, f"lora_moe_{layout.replace('-', '_')}") as policy:
        _, after = _one_step_from_b0(policy, probe, batch, loss_fn, base, ref_loss, ref_norm)
        policy.save_hf_checkpoint(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logprobs(exported, ids, lens), after, rtol=0, atol=1e-5)
    for name, value in exported.state_dict().items():
        if ".experts." in name or ".mlp.gate." in name:
            torch.testing.assert_close(value, base.state_dict()[name], rtol=0, atol=0)
