"""``dualrl serve``'s config: the policy it trains (``policy``, ``cluster``) and the server
(``serve``).  Everything the Tinker API cannot change per request is fixed here, and what
the API does set per request (the learning rate and Adam's other settings, LoRA's rank and
targets) must be left to it: the rules below refuse a config that would silently override it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from core.algorithms.config import MasterConfig
from core.config import ConfigModel, Problem, load_config
from core.policy.optimizer_params import ADAMW

#: The config ``dualrl serve`` reads when given no ``--config``.
SERVE_DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[1] / "configs" / "serve_arithmetic.yaml"
#: Hosts a server may listen on without an API key: the machine itself.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: Tinker SDK API keys start with this (the SDK refuses others before sending a request).
API_KEY_PREFIX = "tml-"


class ServeConfig(ConfigModel):
    """The HTTP service and its limits."""

    host: str = "127.0.0.1"
    """Interface to bind; any other than the loopback needs an API key (``api_key_env``)."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port; 0 picks a free one (printed at start-up)."""
    api_key_env: str = "DUALRL_SERVE_API_KEY"
    """Environment variable holding the API key every request must carry (the SDK's
    ``api_key`` / ``TINKER_API_KEY``; starts with "tml-").  Unset on the loopback: no key."""
    max_request_mb: float = Field(64.0, gt=0)
    """A request body larger than this is refused (HTTP 413) before it is read."""
    max_datums_per_request: int = Field(4096, gt=0)
    """Datums one forward / forward_backward request may carry."""
    max_samples_per_request: int = Field(256, gt=0)
    """``num_samples`` one sample request may ask for."""
    checkpoint_dir: str = "runs/serve/checkpoints"
    """Where save_state / save_weights_for_sampler write (``tinker://`` paths map below it)."""
    session_timeout_s: float = Field(300.0, gt=0)
    """A session with no heartbeat for this long is closed and its model released."""
    poll_s: float = Field(20.0, gt=0, le=40)
    """How long a retrieve_future call waits for its result before answering "try again"
    (the SDK's own timeout per call is 45 s)."""

    def check(self) -> Iterable[Problem]:
        if not self.host.strip():
            yield "host", "empty: give an interface, e.g. 127.0.0.1"
        if not self.api_key_env.strip():
            yield "api_key_env", "empty: name the environment variable that holds the API key"

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)


class ServeRunConfig(MasterConfig):
    """What ``dualrl serve`` reads: ``policy``, ``cluster``, ``serve`` (and ``env`` for a
    built-in model's arithmetic task); an algorithm section is refused by name."""

    sections: ClassVar[tuple[str, ...]] = ("policy", "cluster", "serve", "env")

    serve: ServeConfig = Field(default_factory=ServeConfig)

    @classmethod
    def refusals(cls, raw: Mapping[str, Any]) -> Iterable[Problem]:
        for name, value in raw.items():
            if name in MasterConfig.model_fields and name not in cls.sections and value is not None:
                yield name, f"not used by dualrl serve; remove the section (it reads {', '.join(cls.sections)})"

    def check(self) -> Iterable[Problem]:
        yield from super().check()
        policy = self.policy
        if policy.optimizer is None or policy.optimizer.name != ADAMW:
            name = None if policy.optimizer is None else policy.optimizer.name
            yield "policy.optimizer.name", f"{name!r}: the Tinker API trains with Adam; set {ADAMW!r}"
        if policy.scheduler is not None:
            yield "policy.scheduler", "must be null: every optim_step request carries its own learning rate"
        gen = policy.generation
        if gen is None:
            yield "policy.generation", "required: sampling clients generate with it (backend hf)"
        else:
            yield from _generation_problems(gen)
        if gen is not None and gen.temperature != 1.0:
            yield (
                "policy.generation.temperature",
                f"{gen.temperature}: must be 1.0 -- the workers score every logprob at this temperature, and the "
                "Tinker API's forward_backward logprobs are the model's own (temperature 1)",
            )
        if policy.lora.enabled:
            yield (
                "policy.lora.enabled",
                "must be false: each training client's create request chooses LoRA (rank, targets, seed); "
                "the other policy.lora fields (alpha, use_rslora) apply to it",
            )


def _generation_problems(gen: Any) -> Iterable[Problem]:
    """Settings the policy's generate would apply to every sample request, unasked."""
    if gen.backend != "hf":
        yield (
            "policy.generation.backend",
            f"{gen.backend!r}: dualrl serve samples with the policy's own generate; set 'hf'",
        )
    fixed = {"top_p": gen.top_p != 1.0, "top_k": gen.top_k not in (None, -1), "min_new_tokens": gen.min_new_tokens > 0,
             "stop_token_ids": bool(gen.stop_token_ids), "stop_strings": bool(gen.stop_strings)}  # fmt: skip
    for key, set_ in fixed.items():
        if set_:
            yield (
                f"policy.generation.{key}",
                f"{getattr(gen, key)!r}: would apply to every sample request; leave it at its default (a "
                "request sets its own stop strings, and top-p / top-k other than off are refused per request)",
            )


def load_serve_config(path: str | Path | None, overrides: list[str], backend: str | None) -> ServeRunConfig:
    """The validated config (``ConfigError`` naming the field and the file or override)."""
    from core.policy.preflight import preflight_errors

    return load_config(
        path or SERVE_DEFAULT_CONFIG_PATH,
        overrides,
        backend=backend,
        schema=ServeRunConfig,
        checks=[lambda cfg: preflight_errors(cfg.policy)],
    )
