"""``dualrl serve``'s config: what the Tinker API sets per request is not fixed in the config,
and a server reachable from other hosts needs an API key (refused before anything starts)."""

from __future__ import annotations

import pytest

from core.config import ConfigError
from core.tinker_api.config import ServeRunConfig, load_serve_config
from core.tinker_api.serve import api_key_of
from dualrl.cli import main as dualrl_main


def test_the_default_loads():
    cfg = load_serve_config(None, [], None)
    assert isinstance(cfg, ServeRunConfig) and cfg.serve.is_loopback and cfg.policy.generation.backend == "hf"


@pytest.mark.parametrize(
    "override, words",
    [
        ("policy.scheduler=[{name: torch.optim.lr_scheduler.ConstantLR}]", "policy.scheduler: must be null"),
        ("policy.optimizer.name=torch.optim.SGD", "the Tinker API trains with Adam"),
        ("policy.generation.temperature=0.7", "must be 1.0"),
        ("policy.generation.top_p=0.9", "would apply to every sample request"),
        ("policy.generation.backend=vllm", "samples with the policy's own generate"),
        ("policy.lora.enabled=true", "each training client's create request chooses LoRA"),
        ("sft={max_num_steps: 1}", "sft: not used by dualrl serve"),
    ],
)
def test_refused_settings(override, words):
    with pytest.raises(ConfigError, match=words):
        load_serve_config(None, [override], None)


def test_api_key(monkeypatch):
    monkeypatch.delenv("DUALRL_SERVE_API_KEY", raising=False)
    assert api_key_of(load_serve_config(None, [], None)) is None  # the loopback: no key needed
    public = load_serve_config(None, ["serve.host=0.0.0.0"], None)
    with pytest.raises(ConfigError, match="reachable from other machines: set an API key"):
        api_key_of(public)
    monkeypatch.setenv("DUALRL_SERVE_API_KEY", "secret")
    with pytest.raises(ConfigError, match="must start with 'tml-'"):
        api_key_of(public)
    monkeypatch.setenv("DUALRL_SERVE_API_KEY", "tml-secret")
    assert api_key_of(public) == "tml-secret"


def test_the_command_refuses_before_starting_anything(monkeypatch, capsys):
    monkeypatch.delenv("DUALRL_SERVE_API_KEY", raising=False)
    assert dualrl_main(["serve", "serve.host=0.0.0.0"]) == 2
    assert "set an API key in $DUALRL_SERVE_API_KEY" in capsys.readouterr().err
