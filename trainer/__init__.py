"""Trainer: DeepSpeed ranks on Ray and the policy-gradient algorithms."""
