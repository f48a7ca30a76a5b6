"""``VllmGeneration``: the driver's handle on one or more vLLM engines.

Engines are data-parallel replicas: a cluster of W bundles with ``tensor_parallel_size``
T holds W // T engines, each an actor (``VllmGenerationWorker``) running a ``vllm.LLM``
whose T workers shard the model.  On a CPU machine a bundle of C CPUs (the one bundle of a
policy whose worker owns the host, e.g. JAX's) holds C single-thread engines at T = 1: an
engine's per-request work (each seeded request's own sampler, its output row) is Python on
one core, so two 1-thread engines on half the rows each finish a call sooner than one 2-thread
engine on all of them (docs/results.md#vllm-engines-on-a-multi-cpu-bundle).  ``generate``
splits a batch into contiguous row blocks, one per engine (each row's ``sample_seeds`` entry
travels with it, so seeded rows sample the same whatever the split); a refit reaches every
engine.

Bad input is refused on the driver (``BatchError`` naming the key, row and value) and again
in the engine actor before it reaches vLLM.  Engine errors come back as themselves (a
``RefitError`` stays a ``RefitError``) once a health probe shows the engine still works; an
engine that died, hung past ``policy.generation.vllm_cfg.call_timeout_s`` or failed the probe is killed and gives
``EngineDeadError`` on this and every later call (:mod:`core.generation.engine_health`; a new
``VllmGeneration`` refit from the policy replaces it); one that died in its constructor, a
``WorkerStartupError`` (a ``RuntimeError``) naming its rank, the exception and the line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch

from core.data import BatchedDataDict
from core.distributed import RayVirtualCluster, RayWorkerGroup
from core.generation.engine_health import PROBE_TIMEOUT_S, EngineHealth
from core.generation.vllm_worker import VllmGenerationWorker, default_env
from core.interfaces import RefittableGenerationInterface
from core.policy.checks import check_model_inputs, check_prompt_room, check_sequence_lengths
from core.policy.config import PolicyConfig
from core.policy.generation_args import checked_row_limits, checked_sample_seeds
from core.policy.generation_config import VllmConfig
from core.policy.preflight import absolute_model_paths, check_model_path
from core.reporting import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = get_logger(__name__)


def default_engines_per_bundle(cluster: RayVirtualCluster, workers_per_engine: int) -> int:
    """Engines sharing a bundle: one per CPU of a CPU bundle when an engine is one worker
    (``tensor_parallel_size`` 1), else one (a GPU bundle is one device; tensor parallel
    engines span bundles)."""
    if cluster.use_gpus or workers_per_engine != 1:
        return 1
    return max(1, int(cluster.num_cpus_per_bundle))


class VllmGeneration(RefittableGenerationInterface):
    def __init__(
        self,
        cluster: RayVirtualCluster,
        config: PolicyConfig | Mapping[str, Any],
        tokenizer: PreTrainedTokenizerBase | None = None,
        name_prefix: str = "vllm_generation",
        seed: int = 0,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        engines_per_bundle: int | None = None,
    ) -> None:
        """``config`` is the policy section (its ``generation`` block configures the engine;
        ``model_name`` and ``max_total_sequence_length`` come from it).  ``engines_per_bundle``:
        None = one per CPU of a CPU bundle at ``tensor_parallel_size`` 1, else one per bundle
        (:func:`engines_per_bundle`); 1 keeps one engine per bundle (e.g. a benchmark of one engine)."""
        self.cfg = absolute_model_paths(PolicyConfig.coerce(config, path="policy"))
        vcfg = _engine_config(self.cfg)
        gen_model = self.cfg.generation.model_name if self.cfg.generation is not None else None
        if gen_model:
            check_model_path(gen_model, "policy.generation.model_name")
        else:
            check_model_path(self.cfg.model_name, "policy.model_name")
        self.workers_per_engine = vcfg.world_size
        per_bundle = engines_per_bundle or default_engines_per_bundle(cluster, self.workers_per_engine)
        per_node = [n * per_bundle // self.workers_per_engine for n in cluster.bundle_ct_per_node_list]
        if sum(per_node) == 0:
            raise ValueError(
                f"policy.generation.vllm_cfg.tensor_parallel_size={self.workers_per_engine} needs that many "
                f"bundles on one node; the cluster has {cluster.bundle_ct_per_node_list}"
            )
        #: How long one engine call may take before the engine counts as hung (the config's).
        self.call_timeout_s = vcfg.call_timeout_s
        self.worker_group = RayWorkerGroup(
            cluster,
            VllmGenerationWorker,
            self.cfg,
            tokenizer,
            seed,
            name_prefix=name_prefix,
            workers_per_node=per_node,
            actors_per_bundle=per_bundle,
            env_vars=default_env(cluster.use_gpus),
        )
        self.engines = self.worker_group.workers
        self.health = EngineHealth(self.engines, probe_timeout_s)
        # Through the group, not _get: an engine that died in its constructor is reported with
        # its rank and the exception (WorkerStartupError, a RuntimeError), not as "dead".
        group = self.worker_group
        try:
            limits = group.get_all_worker_results(
                group.run_all_workers_single_data("limits"), timeout=vcfg.startup_timeout_s
            )
        except BaseException:
            group.shutdown()  # the caller gets no handle to shut down: leave no engine behind
            raise
        #: The engine model's vocabulary and context (what generate's inputs are checked against).
        self.vocab_size, self.max_model_len = limits[0]["vocab_size"], limits[0]["max_model_len"]
        #: Pads ``output_ids`` where the engines' parts differ in width (rows' own budgets).
        self.pad_token_id: int = limits[0]["pad_token_id"]
        #: How a refit reaches the engines: "merged" weights, or "adapter" (LoRA: the base
        #: once, then A and B only; ``core.refit.adapter``), and why (``policy.lora.refit``).
        self.refit_mode: str = limits[0]["refit_mode"]
        self.refit_mode_reason: str = limits[0]["refit_mode_reason"]
        #: Each engine worker's compute threads (on CPU: its share of its bundle's CPUs).
        self.engine_threads: list[int] = [int(lim["threads"]) for lim in limits]
        #: Adapter mode: the policy (``refit_token``) whose base weights the engines hold.
        self.base_weights_of: str | None = None
        if self.cfg.lora.enabled:
            logger.info("vLLM refit mode: %s (%s)", self.refit_mode, self.refit_mode_reason)

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    # ------------------------------------------------------------------ generation
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        self.check_inputs(data)
        rows = data.size
        bounds = np.linspace(0, rows, self.num_engines + 1).astype(int)
        calls: list[ray.ObjectRef] = []
        owners: list[int] = []
        for i, (engine, start, end) in enumerate(zip(self.engines, bounds[:-1], bounds[1:], strict=True)):
            if end > start:
                calls.append(engine.generate.remote(_rows(data, start, end), greedy))
                owners.append(i)
        parts = self._get(calls, "generate", owners=owners)
        # With data['max_new_tokens'] each engine's part is as wide as its own rows need.  Copied:
        # Ray hands back read-only arrays, which torch must not wrap (a write would be undefined).
        return BatchedDataDict.from_batches(
            [{k: torch.from_numpy(np.array(v)) for k, v in part.items()} for part in parts],
            pad_value_dict={"output_ids": self.pad_token_id},
        )

    def check_inputs(self, data: BatchedDataDict) -> None:
        """Everything the engines would trip over, on the driver (``BatchError`` / ``ValueError``
        naming the key, row and value): ids (integer, in the engine's vocabulary), lengths,
        room for a new token within ``policy.max_total_sequence_length`` (which
        ``max_model_len`` covers), per-row sampling seeds and limits of new tokens."""
        check_sequence_lengths(data, self.cfg.max_total_sequence_length)
        check_model_inputs(data, self.vocab_size)
        check_prompt_room(data, self.cfg.max_total_sequence_length)
        if data.get("sample_seeds") is not None:
            checked_sample_seeds(data["sample_seeds"], data.size)
        if data.get("max_new_tokens") is not None:
            checked_row_limits(data["max_new_tokens"], data.size)

    def prepare_for_generation(self, *args: Any, tags: list[str] | None = None, **kwargs: Any) -> bool:
        """Wake the engines (GPU sleep mode; a no-op returning False on CPU)."""
        return all(self._get([e.wake_up.remote(tags) for e in self.engines], "prepare_for_generation"))

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Put the engines to sleep, freeing weights and KV cache on GPU (False on CPU)."""
        return all(self._get([e.sleep.remote() for e in self.engines], "finish_generation"))

    # ------------------------------------------------------------------ refit
    def prepare_refit_info(self, state_dict_info: Mapping[str, Any]) -> None:
        """Check the coming stream against every engine's model before anything is loaded."""
        self._get([e.prepare_refit_info.remote(dict(state_dict_info)) for e in self.engines], "prepare_refit_info")

    def prepare_adapter_refit(self, state_dict_info: Mapping[str, Any]) -> None:
        """Adapter mode: check the coming adapter stream (PEFT names) against every engine."""
        self._get(
            [e.prepare_adapter_refit.remote(dict(state_dict_info)) for e in self.engines], "prepare_adapter_refit"
        )

    def update_weights_from_ipc_handles(self, ipc_handles: Mapping[str, Any]) -> bool:
        self._get(
            [e.update_weights_from_ipc_handles.remote(dict(ipc_handles)) for e in self.engines],
            "update_weights_from_ipc_handles",
        )
        return True

    def finish_refit(self) -> list[dict[str, Any]]:
        """End an ``ipc`` refit: every engine checks it received every tensor."""
        return [
            r
            for per_engine in self._get([e.finish_refit.remote() for e in self.engines], "finish_refit")
            for r in per_engine
        ]

    def init_collective(self, ip: str, port: int, world_size: int) -> list[ray.ObjectRef]:
        """Engine workers join as ranks 1.. (rank 0 is the policy's)."""
        self.health.require_alive("init_collective")
        expected = 1 + self.num_engines * self.workers_per_engine
        if world_size != expected:
            raise ValueError(
                f"init_collective: world_size {world_size} but the group is policy rank 0 + "
                f"{self.num_engines} engine(s) x {self.workers_per_engine} worker(s) = {expected}"
            )
        return [
            e.init_collective.remote(ip, port, world_size, 1 + i * self.workers_per_engine)
            for i, e in enumerate(self.engines)
        ]

    def update_weights_from_collective(self) -> list[ray.ObjectRef]:
        self.health.require_alive("update_weights_from_collective")
        return [e.update_weights_from_collective.remote() for e in self.engines]

    def engine_failed(self, engine: int, exc: BaseException, what: str) -> None:
        """The future engine ``engine`` returned from ``init_collective`` /
        ``update_weights_from_collective`` failed: returns if a probe shows the engine healthy,
        raises :class:`EngineDeadError` if it is gone or wedged (it is then killed)."""
        self.health.after_failure(engine, exc, what)

    def engines_timed_out(self, engines: list[int], what: str) -> None:
        """Engines that did not answer a collective call in time: killed, EngineDeadError."""
        for i in engines:
            self.health.declare_dead(i, f"did not answer {what}")
        self.health.require_alive(what)

    def weights_valid(self) -> bool:
        return all(self._get([e.weights_valid.remote() for e in self.engines], "weights_valid"))

    def check_alive(self, timeout_s: float = 30.0) -> None:
        """Every engine answers within ``timeout_s`` (else it is killed: EngineDeadError)."""
        self._get([e.is_alive.remote() for e in self.engines], "is_alive", timeout_s)

    def shutdown(self) -> bool:
        """Every engine released in its actor (False when one could not be), then the actors
        killed."""
        return self.worker_group.shutdown(cleanup_method=VllmGenerationWorker.shutdown.__name__)

    # ------------------------------------------------------------------ internals
    def _get(
        self, refs: list[ray.ObjectRef], what: str, timeout_s: float | None = None, owners: list[int] | None = None
    ) -> list[Any]:
        """Results of one call per engine (``owners``: engine index per ref, default all in
        order) within the deadline; failures classified by :class:`EngineHealth`."""
        self.health.require_alive(what)
        owners = list(range(len(refs))) if owners is None else owners
        return self.health.get(refs, owners, what, self.call_timeout_s if timeout_s is None else timeout_s)


def _rows(data: BatchedDataDict, start: int, end: int) -> dict[str, Any]:
    """Rows [start, end) as plain numpy / lists (what crosses to the engine actor)."""
    out: dict[str, Any] = {}
    for key in ("input_ids", "input_lengths", "stop_strings", "sample_seeds", "max_new_tokens"):
        if key in data and data[key] is not None:
            value = data[key][start:end]
            out[key] = value.numpy() if torch.is_tensor(value) else list(value)
    return out


def _engine_config(cfg: PolicyConfig) -> VllmConfig:
    """``generation.vllm_cfg`` of a policy section that asks for vLLM (the section's own checks
    already hold ``max_model_len`` to ``max_total_sequence_length``)."""
    gen = cfg.generation
    if gen is None or gen.backend != "vllm" or gen.vllm_cfg is None:
        backend = None if gen is None else gen.backend
        raise ValueError(f"VllmGeneration needs policy.generation.backend == 'vllm' with a vllm_cfg, got {backend!r}")
    return gen.vllm_cfg
