"""``RolloutEngine``: one handle on whatever generates rollouts for the loop.

* ``generation.backend: vllm`` -- vLLM engines (``VllmGeneration``) that serve the policy's
  weights after a refit; colocated engines sleep between rollouts and the policy offloads
  around the refit, separate engines get the weights by ``collective`` broadcast.
* ``generation.backend: hf`` -- the policy's own HF ``generate`` on its training workers
  (machines without vLLM); there is nothing to refit.

The loop calls ``sync_weights`` after every training step and ``generate`` for rollouts and
validation; both report what they cost.
"""

from __future__ import annotations

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
    ) -> None:
        self.policy = policy
        self.colocated = is_colocated(cfg)
        self.transport = refit_transport(cfg)
        self.generation: VllmGeneration | None = None
        self._own_cluster: RayVirtualCluster | None = None
        self._stale = True  # engines start with dummy weights: the first rollout needs a refit
        if uses_vllm(cfg):
            from core.generation import VllmGeneration

            if not self.colocated:
                self._own_cluster = generation_cluster(cfg)
            self.generation = VllmGeneration(self._own_cluster or cluster, cfg.policy, tokenizer, seed=seed)

    @property
    def kind(self) -> str:
        return "vllm" if self.generation is not None else "hf"

    def mark_stale(self) -> None:
        """The policy's weights changed (a training step): refit before the next rollout."""
        self._stale = True

    def sync_weights(self) -> dict[str, float]:
        """Refit the engines from the policy if they are stale; refit metrics (empty for hf)."""
        if self.generation is None or not self._stale:
            return {}
        from core.refit import refit_policy_generation

        stats = refit_policy_generation(self.policy, self.generation, self.transport, offload=self.colocated)
        self._stale = False
        return stats.as_metrics()

    def generate(self, batch: BatchedDataDict, greedy: bool) -> BatchedDataDict:
        if self.generation is None:
            return self.policy.generate(batch, greedy=greedy)
        if self._stale:
            raise RuntimeError("RolloutEngine.generate: the engines hold stale weights; call sync_weights() first")
        self.generation.prepare_for_generation()
        try:
            return self.generation.generate(batch, greedy=greedy)
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
