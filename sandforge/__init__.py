"""sandforge: agentic RL post-training on real sandboxes."""

__version__ = "0.1.0"
