"""Verifiers: score an episode from outside the policy's reach."""
