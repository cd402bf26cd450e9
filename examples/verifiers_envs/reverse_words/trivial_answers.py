"""What answers that ignore the task score on reverse_words' held-out tasks: the bar RL and SFT must clear.

    python examples/verifiers_envs/reverse_words/trivial_answers.py [--num-tasks 200 --syllables 2 --heldout 0.2]

Each strategy answers every held-out task (split as a sandforge job splits it) through the real environment, its
rubric scoring the reply as in training (sandforge's recording proxy, a scripted engine in place of the policy):
- ``empty``: the tags with nothing in them;
- ``echo``: the word as given (what a policy that learned the format but not the skill writes);
- ``best_constant``: the one string that scores best on the training words' reversals (chosen without the held-out
  tasks), written for every task;
- ``exact``: the true reversal (the ceiling, 1.0).
Prints a line per strategy and a JSON line with the mean reward of each and ``best_trivial``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
from difflib import SequenceMatcher

from sandforge.environments.vf.tasks import load_tasks
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.proxy import ProxyBudget
from sandforge.rollout.vf_episode import VerifiersEnvs, agent_limits, run_vf_episode
from sandforge.types import GenerateRequest, Message, Sample

CHAT = ChatFormat(ByteTokenizer())
USER = re.compile(r"<\|user\|>(.*?)<\|end\|>", re.DOTALL)


class Answering:
    """The scripted engine: answers the word of the request's last user message by ``answer(word)``."""

    def __init__(self, answer):
        self.answer = answer

    async def generate(self, request: GenerateRequest) -> Sample:
        word = USER.findall(CHAT.tokenizer.decode(request.prompt_ids))[-1].strip()
        ids = CHAT.render_assistant(Message("assistant", f"<reversed_text>{self.answer(word)}</reversed_text>"))
        return Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", version=0)

    async def close_session(self, session_id: str) -> None:
        pass


async def score(tasks, answer) -> list[float]:
    limits = EpisodeLimits(max_turns=4, max_context=4096, max_new_tokens=256, stop_ids=CHAT.stop_ids)
    budget = ProxyBudget(4, 4096)
    envs = VerifiersEnvs(agent_limits(limits, budget))
    try:
        out = [await run_vf_episode(t, envs, Answering(answer), CHAT, limits, budget, f"trivial{i}")
               for i, t in enumerate(tasks)]
    finally:
        await envs.close()
    failed = [t.failure for t in out if t.failed]
    if failed:
        raise SystemExit(f"{len(failed)} episodes failed: {failed[0]}")
    return [t.reward.value for t in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-tasks", type=int, default=200)
    p.add_argument("--syllables", type=int, default=3)
    p.add_argument("--task-seed", type=int, default=0)
    p.add_argument("--heldout", type=float, default=0.2)
    a = p.parse_args()
    tasks = load_tasks("reverse_words", {"num_tasks": a.num_tasks, "syllables": a.syllables, "seed": a.task_seed},
                       heldout=a.heldout)
    heldout = [t for t in tasks if t.split == "heldout"]
    answers = sorted({t.instruction[::-1] for t in tasks if t.split == "train"})
    constant = max(answers, key=lambda c: sum(SequenceMatcher(None, c, x).ratio() for x in answers))
    strategies = {"empty": lambda w: "", "echo": lambda w: w, "best_constant": lambda w: constant,
                  "exact": lambda w: w[::-1]}
    means = {}
    for name, answer in strategies.items():
        rewards = asyncio.run(score(heldout, answer))
        means[name] = round(statistics.fmean(rewards), 4)
        se = statistics.stdev(rewards) / len(rewards) ** 0.5
        print(f"{name:>14}: mean reward {means[name]:.3f} ± {se:.3f} over {len(rewards)} held-out tasks"
              + (f" (the string {constant!r})" if name == "best_constant" else ""))
    print(json.dumps({"heldout_tasks": len(heldout), **means,
                      "best_trivial": max(v for k, v in means.items() if k != "exact")}))


if __name__ == "__main__":
    main()
