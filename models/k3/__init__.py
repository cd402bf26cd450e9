"""Kimi K3-shaped policy at small scale: KDA, NoPE gated MLA, Block Attention Residuals, Stable LatentMoE."""
