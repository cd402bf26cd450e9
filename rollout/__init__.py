"""Rollout: the inference engine, the multi-turn agent loop and rollout workers (Ray actors)."""
