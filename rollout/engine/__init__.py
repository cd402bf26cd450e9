"""The embedded inference engine: ``EngineCore`` (continuous batching, a cache per episode kept between turns, group
sampling, weight versions; no Ray) and ``InferenceEngine``, the Ray actor around it."""

from .inference_engine import InferenceEngine
from .core import EngineCore

__all__ = ["EngineCore", "InferenceEngine"]
