"""reverse-words: reverse a word character by character, in one reply.

The model is asked to put the reversed word in ``<reversed_text>`` tags; the reward is the longest-common-subsequence
ratio between what it wrote there and the true reversal (1.0 only for the exact answer). Written against verifiers
v1 as its reverse-text example is; the words are drawn from a seeded generator, so no dataset is downloaded.
"""

import random
import re
from difflib import SequenceMatcher

import verifiers.v1 as vf

SYSTEM = ("Reverse the text character by character. Put your answer in <reversed_text> tags, "
          "for example: abcd -> <reversed_text>dcba</reversed_text>")
_TAG = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "do", "fi", "gu", "he", "ja"]


class ReverseWordsData(vf.TaskData):
    answer: str
    """The prompt's word, reversed."""


class ReverseWordsTask(vf.Task[ReverseWordsData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def lcs(self, trace: vf.Trace) -> float:
        match = _TAG.search(trace.last_reply or "")
        response = match.group(1).strip() if match else ""
        return SequenceMatcher(None, response, self.data.answer).ratio()


class ReverseWordsConfig(vf.TasksetConfig):
    num_tasks: int = 200
    seed: int = 0
    syllables: int = 2
    """Syllables per word: 2 makes four-letter words."""


class ReverseWordsTaskset(vf.Taskset[ReverseWordsTask, ReverseWordsConfig]):
    def load(self) -> list[ReverseWordsTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            word = "".join(rng.choice(SYLLABLES) for _ in range(self.config.syllables))
            tasks.append(ReverseWordsTask(ReverseWordsData(idx=i, name=word, prompt=word, system_prompt=SYSTEM,
                                                           answer=word[::-1]), self.config.task))
        return tasks
