"""verifiers episodes: the chat loop in the rollout worker against verifiers' own process per episode.

    python bench/vf_episodes.py [--episodes 32] [--concurrency 8] [--env reverse_words] [--repeats 2]

Runs the same ``--episodes`` episodes of an installed verifiers environment (examples/verifiers_envs/reverse_words
by default: ``pip install ./examples/verifiers_envs/reverse_words``) through sandforge's recording proxy under both
harnesses, alternating, ``--repeats`` times each: ``in_process`` (environments/vf/chat_harness.py, sandforge's) and
``null`` (verifiers' harness: its chat program as a ``uv run`` process per episode). The policy is a scripted engine
that answers at once (the exact reversal), so what is timed is everything around the model: the harness, the
interception server, the proxy, the rubric. Reports wall seconds and CPU seconds (this process and its children)
per episode, checks that both harnesses scored every episode alike, and prints one JSON line (the last line) with
``speedup_wall`` and ``speedup_cpu`` (null / in_process) and the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import resource
import time
from pathlib import Path

from sandforge.environments.vf.tasks import HARNESS, REFERENCE_HARNESS, load_tasks
from sandforge.models.chat import ChatFormat
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.proxy import ProxyBudget
from sandforge.rollout.vf_episode import VerifiersEnvs, agent_limits, run_vf_episode
from sandforge.types import GenerateRequest, Message, Sample

CHAT = ChatFormat(ByteTokenizer())
USER = re.compile(r"<\|user\|>(.*?)<\|end\|>", re.DOTALL)


class ReversingEngine:
    """Answers each request at once with the reversal of the last user message, in reverse_words' tags."""

    async def generate(self, request: GenerateRequest) -> Sample:
        said = USER.findall(CHAT.tokenizer.decode(request.prompt_ids))
        ids = CHAT.render_assistant(Message("assistant", f"<reversed_text>{said[-1].strip()[::-1]}</reversed_text>"))
        return Sample(token_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", version=0)

    async def close_session(self, session_id: str) -> None:
        pass


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def run(harness: str, module: str, args: dict, episodes: int, concurrency: int) -> dict:
    limits = EpisodeLimits(max_turns=4, max_context=4096, max_new_tokens=256, stop_ids=CHAT.stop_ids)
    budget = ProxyBudget(4, 4096)
    envs = VerifiersEnvs(agent_limits(limits, budget), harness=harness)
    tasks = load_tasks(module, args)[:episodes]
    engine, gate = ReversingEngine(), asyncio.Semaphore(concurrency)
    await envs.get(module, args)  # loading the environment is not what is timed

    async def one(i, task):
        async with gate:
            return await run_vf_episode(task, envs, engine, CHAT, limits, budget, f"bench{i}")

    wall, cpu = time.perf_counter(), cpu_seconds()
    trajectories = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    await envs.close()
    failed = [t.failure for t in trajectories if t.failed]
    return {"harness": harness, "episodes": len(tasks), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "wall_per_episode_s": round(wall / len(tasks), 3), "cpu_per_episode_s": round(cpu / len(tasks), 3),
            "failed": len(failed), "first_failure": failed[0][:300] if failed else None,
            "rewards": [None if t.reward is None else round(t.reward.value, 6) for t in trajectories]}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="reverse_words", help="an installed verifiers environment (taskset module)")
    p.add_argument("--args", default='{"num_tasks": 64, "seed": 0}', help="its taskset arguments, as JSON")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="episodes at once (a rollout worker's)")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    args = json.loads(a.args)
    runs: dict[str, list[dict]] = {HARNESS: [], REFERENCE_HARNESS: []}
    for _ in range(a.repeats):
        for harness in runs:
            result = asyncio.run(run(harness, a.env, args, a.episodes, a.concurrency))
            print(json.dumps({k: v for k, v in result.items() if k != "rewards"}), flush=True)
            runs[harness].append(result)
    best = {h: min(rs, key=lambda r: r["wall_s"]) for h, rs in runs.items()}
    fast, reference = best[HARNESS], best[REFERENCE_HARNESS]
    same = all(r["rewards"] == runs[HARNESS][0]["rewards"] for rs in runs.values() for r in rs)
    print(f"{a.episodes} episodes, {a.concurrency} at once: in the worker {fast['wall_s']} s wall, "
          f"{fast['cpu_s']} CPU-s; a process each {reference['wall_s']} s wall, {reference['cpu_s']} CPU-s; "
          f"same rewards: {same}")
    print(json.dumps({"speedup_wall": round(reference["wall_s"] / fast["wall_s"], 2),
                      "speedup_cpu": round(reference["cpu_s"] / max(fast["cpu_s"], 1e-3), 2),
                      "same_rewards": same, "in_process": {k: v for k, v in fast.items() if k != "rewards"},
                      "null": {k: v for k, v in reference.items() if k != "rewards"}, "cpu": cpu_model()}))


if __name__ == "__main__":
    main()
