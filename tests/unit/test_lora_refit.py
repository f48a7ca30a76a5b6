"""Adapter-only LoRA refit in process (no Ray, no vLLM engine): ``policy.lora.refit``'s
refusals and resolution, the engine arguments, the adapter manifest against the torch
wrapper's weights, and which streams the driver sends.  The real engine is
``tests/generation/test_refit_lora.py`` (slow)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core.config import ConfigError
from core.generation.vllm_worker import engine_kwargs
from core.models.lora import peft_name
from core.policy.config import PolicyConfig, vllm_max_lora_rank
from core.refit.adapter import adapter_manifest
from core.refit.driver import _parts
from core.refit.manifest import RefitError
from tests.torch_backends.conftest import policy_config

LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": "all-linear"}


def _cfg(refit: str = "auto", **lora) -> dict:
    cfg = policy_config(Path("unused-model"), "torch_fsdp")
    cfg["generation"]["backend"] = "vllm"
    cfg["lora"] = {**LORA, "refit": refit, **lora}
    return cfg


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["lora"].update(enabled=False), "'adapter' needs policy.lora.enabled"),
        (lambda c: c["generation"].update(backend="hf", vllm_cfg=None), "generation.backend is 'hf'"),
        (lambda c: c.update(generation=None), "generation.backend is None"),
        (lambda c: c["generation"]["vllm_cfg"].update(tensor_parallel_size=2), "one-worker engines only"),
        (lambda c: c["lora"].update(rank=600), "above vLLM's largest max_lora_rank"),
    ],
)
def test_adapter_refit_that_cannot_work_is_refused_by_name(edit, message):
    cfg = _cfg("adapter")
    edit(cfg)
    with pytest.raises(ConfigError, match=r"policy.lora.refit: .*" + message):
        PolicyConfig.checked(cfg)


def test_auto_resolves_to_adapter_where_the_config_allows_else_merged():
    assert PolicyConfig.checked(_cfg("auto")).lora_refit_mode()[0] == "adapter"
    assert PolicyConfig.checked(_cfg("adapter")).lora_refit_mode()[0] == "adapter"
    assert PolicyConfig.checked(_cfg("merged")).lora_refit_mode() == ("merged", "policy.lora.refit is 'merged'")
    hf = _cfg("auto")
    hf["generation"].update(backend="hf", vllm_cfg=None)
    mode, why = PolicyConfig.checked(hf).lora_refit_mode()
    assert mode == "merged" and "generation.backend is 'hf'" in why
    assert PolicyConfig.checked(_cfg("auto", enabled=False)).lora_refit_mode()[0] == "merged"


def test_engine_gets_lora_with_the_smallest_rank_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 9, 320, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match="policy.lora.rank=513"):
        vllm_max_lora_rank(513)
    cfg = PolicyConfig.checked(_cfg("adapter"))
    kwargs = engine_kwargs(cfg, 0, on_gpu=False, adapter_refit=True)
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"]) == (True, 1, 8)
    assert "enable_lora" not in engine_kwargs(cfg, 0, on_gpu=False)


def test_adapter_manifest_names_the_torch_wrappers_weights(model_dirs):
    """The engine's expected adapter stream = the torch backend's adapter weights under
    PEFT's names, shapes A [r, in] / B [out, r] (the JAX worker is held to it by the slow test)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from backends.torch_common.lora import apply_lora
    from core.policy.config import LoRAConfig

    model = AutoModelForCausalLM.from_pretrained(model_dirs["qwen2"], dtype=torch.float32)
    apply_lora(model, LoRAConfig(**LORA))
    adapters = {peft_name(n): (tuple(t.shape), "float32") for n, t in model.state_dict().items() if ".lora_" in n}
    manifest = adapter_manifest(AutoConfig.from_pretrained(model_dirs["qwen2"]), 4, LoRAConfig(**LORA).targets, "fp32")
    assert manifest.to_info() == adapters and manifest.names == list(adapters)
    bf16 = adapter_manifest(AutoConfig.from_pretrained(model_dirs["qwen2"]), 4, ["q_proj"], "bfloat16")
    assert all(n.endswith(("q_proj.lora_A.weight", "q_proj.lora_B.weight")) for n in bf16.names)
    assert {s.dtype for s in bf16.specs.values()} == {"bfloat16"}


def _fakes(policy_lora: bool, mode: str, holds: bool, valid: bool = True):
    policy = SimpleNamespace(cfg=SimpleNamespace(lora=SimpleNamespace(enabled=policy_lora)), refit_token="p1")
    generation = SimpleNamespace(
        refit_mode=mode,
        refit_mode_reason="policy.lora.refit is 'auto'",
        base_weights_of="p1" if holds else "other",
        weights_valid=lambda: valid,
    )
    return policy, generation


def test_driver_sends_the_base_once_then_adapters_only():
    assert _parts(*_fakes(True, "merged", False), "merged") == ("full",)
    assert _parts(*_fakes(True, "adapter", holds=False), "adapter") == ("base", "adapter")
    assert _parts(*_fakes(True, "adapter", holds=True), "adapter") == ("adapter",)
    # An engine whose weights went stale (a failed refit) gets the base again.
    assert _parts(*_fakes(True, "adapter", holds=True, valid=False), "adapter") == ("base", "adapter")
    with pytest.raises(RefitError, match="refits LoRA adapters only .* no policy.lora"):
        _parts(*_fakes(False, "adapter", holds=False), "adapter")


def test_bench_refit_rows_of_lora_layouts():
    """``dualrl bench``: -lora only with the refit section; adapter rows use their own memcpy."""
    from benchmarks.lib.compare.report import refit_lines
    from benchmarks.lib.compare.run import policy_sections
    from benchmarks.lib.layouts import parse_layout

    row: dict = {}
    bench = SimpleNamespace(args=SimpleNamespace(sections=["throughput", "refit"]))
    policy_sections(bench, parse_layout("fsdp1-dp2-lora"), row, progress=None)
    assert "-lora is measured by --sections refit" in row["error"]
    transports = {
        "ipc merged": {"seconds": [1.0], "bytes": 4e9},
        "ipc adapter": {"seconds": [0.5], "bytes": 1e9, "memcpy_s": 0.1},
    }
    lines = refit_lines(
        {"layouts": [{"case": "x-lora", "refit": {"transports": transports, "memcpy": {"warm_s": 2.0}}}]}
    )
    merged, adapter = (next(line for line in lines if f"| {t} |" in line) for t in transports)
    assert "| 2.00 |" in merged and "| 10.00 |" in adapter  # memcpy GB/s: 4 GB / 2 s, 1 GB / 0.1 s
