"""Rollout: the episode. The multi-turn agent loop, the policy client, tool calls, the rollout worker (a Ray actor),
the recording proxy and the episodes of agent harnesses and verifiers environments behind it. The inference engine is
its own package (engine/)."""
