"""Policies: the built-in MoE decoder, its tokenizer and chat format, and batched generation."""
