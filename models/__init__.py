"""Policies: the K3-shaped model, Hugging Face adapters, tokenizers, chat formats and batched generation."""
