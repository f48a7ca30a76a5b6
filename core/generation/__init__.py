"""Generation engines: ``VllmGeneration`` (vLLM in Ray actors, refit from the policy).

Its names are imported on first use (:mod:`core.lazy_exports`): the engine-independent parts
(:mod:`core.generation.sampling`, which the JAX decoder and HF generate share) import without
Ray or vLLM.
"""

from typing import TYPE_CHECKING

from core.lazy_exports import lazy_exports

__all__ = ["VllmGeneration", "EngineDeadError"]
__getattr__, __dir__ = lazy_exports(__name__, {"EngineDeadError": "engine_health", "VllmGeneration": "vllm_generation"})

if TYPE_CHECKING:
    from core.generation.engine_health import EngineDeadError
    from core.generation.vllm_generation import VllmGeneration
