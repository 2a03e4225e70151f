"""Fast forward passes over static per-slot KV caches: the target (Llama/Qwen2/Qwen3) and the DSpark drafter."""

from optimized.models.drafter import OptimizedDrafter
from optimized.models.target import OptimizedTarget

__all__ = ["OptimizedDrafter", "OptimizedTarget"]
