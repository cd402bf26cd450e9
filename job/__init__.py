"""The job: the one place that wires processes together (command line, fleet, RL loops, evaluation, checkpoints)."""
