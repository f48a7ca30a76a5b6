"""The ``policy.generation`` section: how rollouts are sampled, by vLLM or the policy's own
``generate`` (NeMo RL keeps it inside the policy section; so does dualrl).

Every rule here is one an engine (HF, JAX or vLLM) would otherwise enforce at its first
``generate`` call, after the workers started: refused on the driver instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field

from core.config import ConfigModel, Problem

#: The values ``policy.generation.backend`` may take.
GENERATION_BACKENDS = ("vllm", "hf")
GenerationBackend = Literal["vllm", "hf"]


class VllmConfig(ConfigModel):
    """vLLM engine settings for generation."""

    tensor_parallel_size: int = Field(1, gt=0)
    """Devices one engine's tensor parallelism spans."""
    pipeline_parallel_size: int = Field(1, gt=0)
    """Pipeline stages of one engine."""
    gpu_memory_utilization: float = 0.6
    """Fraction of device memory vLLM may take, in (0, 1]."""
    max_model_len: int = Field(gt=0)
    """Longest prompt + response the engine accepts; >= policy.max_total_sequence_length."""
    precision: str | None = None
    """dtype of the engine's weights, e.g. "bfloat16"; null = policy.precision."""
    enforce_eager: bool = False
    """No CUDA graphs (always eager on CPU)."""
    async_engine: bool = False
    """Must be false: every engine is a synchronous vllm.LLM (true is refused)."""
    load_format: str = "dummy"
    """"dummy" when weights are refit from the policy (the usual case)."""
    skip_tokenizer_init: bool = True
    """The engine gets token ids, never text: no tokenizer of its own."""
    call_timeout_s: float = Field(3600.0, gt=0)
    """Seconds the driver waits for one call of a running engine (a generate call, a refit,
    sleep / wake) before it declares the engine hung: the engine is killed and the run fails
    with ``EngineDeadError``.  A generate call lasts as long as its longest row's decode
    (every row advances one token per engine step), so a rollout of tens of thousands of new
    tokens at tens of tokens per second per sequence -- long-reasoning GRPO on a GPU -- runs
    for tens of minutes while healthy.  An hour stays above such a call, where killing a
    healthy engine would lose the step, and still ends a hung one within the hour; lower it
    for short rollouts to hear of a hang sooner."""
    startup_timeout_s: float = Field(3600.0, gt=0)
    """Seconds the engines may take to start (load the model, compile, capture CUDA graphs)
    before the start-up counts as failed.  Apart from ``call_timeout_s``: a large model's
    start-up outlasts a short rollout's calls, and lowering one must not cut the other."""

    def check(self) -> Iterable[Problem]:
        if not 0 < self.gpu_memory_utilization <= 1:
            yield "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}"
        if self.async_engine:
            # NeMo RL has the switch and policy.yaml lists it; on, it would be silently ignored.
            yield (
                "async_engine",
                "True: dualrl has no async vLLM engine (every engine is a synchronous vllm.LLM); "
                "set it to false or remove it",
            )

    @property
    def world_size(self) -> int:
        """Devices one engine spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class ColocationResources(ConfigModel):
    """Devices for a generation engine that is *not* colocated with training (null = 1)."""

    gpus_per_node: int | None = Field(None, gt=0)
    """Devices (CPU: slots) per node for the engines."""
    num_nodes: int | None = Field(None, gt=0)
    """Nodes for the engines."""


class ColocationConfig(ConfigModel):
    """Whether generation shares the training workers' devices."""

    enabled: bool = True
    """Share the training bundles (ipc refit); false: the engines' own cluster (collective refit)."""
    resources: ColocationResources = Field(default_factory=ColocationResources)
    """Used only when enabled is false."""


class GenerationConfig(ConfigModel):
    """How rollouts are generated."""

    backend: GenerationBackend
    """vllm: vLLM engines fed by refit; hf: the policy's own generate on its workers."""
    max_new_tokens: int = Field(gt=0)
    """Longest completion, in tokens (cut to fit max_total_sequence_length)."""
    min_new_tokens: int = Field(0, ge=0)
    """Shortest completion, in tokens (HF's min_new_tokens, vLLM's min_tokens); 0 = off.  Until a
    row has this many, eos and stop_token_ids are never sampled and stop strings do not end it.
    Logprobs stay those of the unmasked distribution (what get_logprobs computes), except vLLM's
    at temperature != 1 (its processed logprobs: stop tokens masked).  <= max_new_tokens; cut like
    it to the room max_total_sequence_length leaves."""
    temperature: float = 1.0
    """> 0; greedy decoding is a per-call switch (greedy=True), not temperature 0."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int | None = None
    """null or -1 = no top-k filtering; else >= 1 (0 is refused as a likely typo)."""
    model_name: str | None = None
    """vllm only (the engine's architecture); null = policy.model_name."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a completion besides the tokenizer's eos (kept in the completion)."""
    stop_strings: list[str] | None = None
    """Strings that end a completion (the token completing one is kept)."""
    pad_token_id: int | None = None
    """null = the tokenizer's."""
    colocated: ColocationConfig = Field(default_factory=ColocationConfig)
    vllm_cfg: VllmConfig | None = None
    """Required by backend "vllm"."""

    def check(self) -> Iterable[Problem]:
        yield from self._sampling_problems()
        if self.min_new_tokens > self.max_new_tokens:
            yield (
                "min_new_tokens",
                f"{self.min_new_tokens} > max_new_tokens ({self.max_new_tokens}): a completion cannot be longer "
                "than max_new_tokens (min_new_tokens = max_new_tokens makes every completion full length)",
            )
        for key in ("stop_token_ids", "pad_token_id"):
            value = getattr(self, key)
            for i, token in enumerate(value if isinstance(value, list) else [value]):
                if token is not None and token < 0:
                    yield key + (f"[{i}]" if isinstance(value, list) else ""), f"{token}: token ids are >= 0"
        if self.backend == "hf" and self.model_name is not None:
            yield (
                "model_name",
                f"{self.model_name!r}: not used by generation.backend 'hf' (the policy's workers generate "
                "with their own weights); remove it",
            )
        if self.backend == "vllm" and self.vllm_cfg is None:
            yield "vllm_cfg", "required when generation.backend is 'vllm'"

    def _sampling_problems(self) -> Iterable[Problem]:
        if self.temperature <= 0:
            # Logprobs divide the logits by it; greedy decoding is a per-call switch (greedy=True).
            yield (
                "temperature",
                f"must be > 0, got {self.temperature!r}: logprobs are computed at this temperature; greedy "
                "decoding is asked for per call (greedy=True, e.g. validation), not with temperature 0",
            )
        if not 0 < self.top_p <= 1:
            yield "top_p", f"must be in (0, 1], got {self.top_p!r}"
        if self.top_k == 0:
            yield (
                "top_k",
                "0: use -1 or null for no top-k filtering (-1 means off; 0 is probably a typo), "
                "or a positive number of tokens",
            )
        elif self.top_k is not None and self.top_k < -1:
            yield "top_k", f"{self.top_k}: must be a positive number of tokens, or -1 / null for no top-k filtering"
