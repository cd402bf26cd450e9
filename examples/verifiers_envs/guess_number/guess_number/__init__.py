from guess_number.taskset import GuessNumberEnv, GuessNumberTaskset

__all__ = ["GuessNumberEnv", "GuessNumberTaskset"]
