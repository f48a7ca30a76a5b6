"""Generation engines: ``VllmGeneration`` (vLLM in Ray actors, refit from the policy)."""

from core.generation.engine_health import EngineDeadError
from core.generation.vllm_generation import VllmGeneration

__all__ = ["VllmGeneration", "EngineDeadError"]
