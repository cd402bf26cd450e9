"""The embedded inference engine: ``EngineCore`` (continuous batching, a cache per episode kept between turns, group
sampling, weight versions; no Ray) and ``EngineActor``, the Ray actor around it."""

from .ray_actor import EngineActor
from .core import EngineCore

__all__ = ["EngineCore", "EngineActor"]
