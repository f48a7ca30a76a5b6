"""``RolloutEngine``: one handle on whatever generates rollouts for the loop.

* ``generation.backend: vllm`` -- vLLM engines (``VllmGeneration``) that serve the policy's
  weights after a refit; colocated engines sleep between rollouts and the policy offloads
  around the refit, separate engines get the weights by ``collective`` broadcast.
* ``generation.backend: hf`` -- the policy's own HF ``generate`` on its training workers
  (machines without vLLM); there is nothing to refit.

The loop calls ``mark_stale`` after every training step, ``sync_weights`` before the next
rollout, and ``generate`` for rollouts and validation.  The engine knows which weights it holds:
``version``, the training step they come from (``start_version`` at the first refit, one more
per training step), and ``generate_tagged`` returns it with the rollouts.  Generation and
refits hold one lock, so a version tag is exact when two threads share the engine (the async
loop's generation thread and its trainer), and a refit lands between requests, never inside one.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from core.algorithms.placement import generation_cluster, is_colocated, refit_transport, uses_vllm
from core.data import BatchedDataDict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from core.algorithms.config import MasterConfig
    from core.distributed import RayVirtualCluster
    from core.generation import VllmGeneration
    from core.policy import Policy


class RolloutEngine:
    def __init__(
        self,
        cfg: MasterConfig,
        policy: Policy,
        tokenizer: PreTrainedTokenizerBase,
        cluster: RayVirtualCluster,
        seed: int,
        start_version: int = 0,
    ) -> None:
        self.policy = policy
        self.colocated = is_colocated(cfg)
        self.transport = refit_transport(cfg)
        self.generation: VllmGeneration | None = None
        self._own_cluster: RayVirtualCluster | None = None
        self._stale = True  # engines start with dummy weights: the first rollout needs a refit
        #: The training step whose weights the engines hold (the policy's, for hf generation).
        self.version = start_version
        self._policy_version = start_version
        #: Whether rollouts may come from weights older than the policy's (the async loop's
        #: bounded off-policy generation); the synchronous loop refits before every rollout.
        self.allow_stale = False
        self._loaded = False  # engines start with dummy weights: never generate before a refit
        self.lock = threading.Lock()
        if uses_vllm(cfg):
            from core.generation import VllmGeneration

            if not self.colocated:
                self._own_cluster = generation_cluster(cfg)
            self.generation = VllmGeneration(self._own_cluster or cluster, cfg.policy, tokenizer, seed=seed)

    @property
    def loaded(self) -> bool:
        """Whether the engines hold real weights (a refit happened; always true for hf)."""
        return self._loaded or self.generation is None

    @property
    def policy_version(self) -> int:
        """The training step of the policy's current weights."""
        return self._policy_version

    @property
    def kind(self) -> str:
        return "vllm" if self.generation is not None else "hf"

    def mark_stale(self) -> None:
        """The policy's weights changed (a training step): refit before the next rollout."""
        self._stale = True
        self._policy_version += 1
        if self.generation is None:  # the policy generates itself: always current
            self.version = self._policy_version

    def sync_weights(self) -> dict[str, float]:
        """Refit the engines from the policy if they are stale; refit metrics (empty for hf)."""
        if self.generation is None or not self._stale:
            return {}
        from core.refit import refit_policy_generation

        with self.lock:
            stats = refit_policy_generation(self.policy, self.generation, self.transport, offload=self.colocated)
            self._stale = False
            self._loaded = True
            self.version = self._policy_version
        return stats.as_metrics()

    def generate(self, batch: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        return self.generate_tagged(batch, greedy)[0]

    def generate_tagged(self, batch: BatchedDataDict, greedy: bool) -> tuple[BatchedDataDict, int]:
        """The rollouts and the version of the weights that generated them."""
        if self.generation is None:
            return self.policy.generate(batch, greedy=greedy), self.version
        with self.lock:
            if not self._loaded or (self._stale and not self.allow_stale):
                raise RuntimeError("RolloutEngine.generate: the engines hold stale weights; call sync_weights() first")
            self.generation.prepare_for_generation()
            try:
                return self.generation.generate(batch, greedy=greedy), self.version
            finally:
                if self.colocated:
                    self.generation.finish_generation()  # give the devices back to training

    def shutdown(self) -> None:
        try:
            if self.generation is not None:
                self.generation.shutdown()
        finally:
            if self._own_cluster is not None:
                self._own_cluster.shutdown()
