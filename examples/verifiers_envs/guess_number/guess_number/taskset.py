"""guess-number: find a hidden number from 1 to ``high`` in at most ``turns`` guesses.

A multi-turn episode: the model answers ``<guess>N</guess>``; the env's scripted user (``GuessNumberEnv.run``) says
"higher", "lower" or "correct" and asks again, until the number is found or the turns run out. The reward is 1.0 when
a guess was right, else 0.0; the ``guesses`` metric counts the replies.
"""

import random
import re

import verifiers.v1 as vf

_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


def guess_of(reply: str | None) -> int | None:
    found = _GUESS.findall(reply or "")
    return int(found[-1]) if found else None


class GuessNumberData(vf.TaskData):
    secret: int
    high: int
    turns: int


class GuessNumberTask(vf.Task[GuessNumberData]):
    @vf.reward(weight=1.0)
    async def found(self, trace: vf.Trace) -> float:
        return float(any(guess_of(m.content) == self.data.secret for m in trace.assistant_messages))

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessNumberConfig(vf.TasksetConfig):
    num_tasks: int = 100
    seed: int = 0
    high: int = 8
    turns: int = 3


class GuessNumberTaskset(vf.Taskset[GuessNumberTask, GuessNumberConfig]):
    def load(self) -> list[GuessNumberTask]:
        rng = random.Random(self.config.seed)
        c = self.config
        return [GuessNumberTask(GuessNumberData(idx=i, name=f"guess-{i}", prompt=None, secret=rng.randint(1, c.high),
                                                high=c.high, turns=c.turns), c.task)
                for i in range(c.num_tasks)]


class GuessNumberEnv(vf.SingleAgentEnv):
    """The user: opens with the rules, then answers each guess until it is right or the turns are spent."""

    async def run(self, task, agents):
        d = task.data
        message = (f"I am thinking of a number from 1 to {d.high}. You have {d.turns} guesses. "
                   "Answer with your guess as <guess>N</guess>.")
        async with agents.agent.interaction(task) as interaction:
            for _ in range(d.turns):
                segment = await interaction.turn(message)
                if segment.terminated:
                    break
                guess = guess_of(interaction.trace.last_reply)
                if guess == d.secret:
                    break
                if guess is None:
                    message = "Answer with <guess>N</guess>, N a whole number."
                else:
                    message = f"{'Higher' if guess < d.secret else 'Lower'}. Guess again as <guess>N</guess>."
