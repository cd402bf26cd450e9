"""How the driver spreads a batch of episodes over rollout workers (real Ray actors standing in for RolloutWorker):
each worker keeps its own concurrency bound across calls, and the bar moves as each episode ends."""

from __future__ import annotations

import asyncio

import pytest

ray = pytest.importorskip("ray")

from sandforge.job.fleet.rollout_workers import collect_episodes, episode_seed  # noqa: E402
from sandforge.types import Task, Trajectory  # noqa: E402


@ray.remote
class SlowWorker:
    """RolloutWorker's contract: ``ready``, and ``run_episodes`` gated by one semaphore per worker across calls."""

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.gate: asyncio.Semaphore | None = None
        self.running = self.most = 0
        self.seeds: list[int] = []
        self.temperatures: dict[str, float | None] = {}  # group -> the temperature its call asked for

    def ready(self) -> bool:
        return True

    async def run_episodes(self, tasks, groups, version, scripted=False, seeds=None, temperature=None):
        self.gate = self.gate or asyncio.Semaphore(self.concurrency)
        self.temperatures.update((g, temperature) for g in groups)
        return await asyncio.gather(*(self._one(t, g, s) for t, g, s in zip(tasks, groups, seeds)))

    async def _one(self, task, group, seed):
        async with self.gate:
            self.running += 1
            self.most = max(self.most, self.running)
            self.seeds.append(seed)
            await asyncio.sleep(0.05 + 0.05 * (seed % 3))
            self.running -= 1
        return Trajectory(task=Task.from_dict(task), group=group).to_dict()

    def stats(self) -> tuple[int, list[int]]:
        return self.most, self.seeds

    def asked(self) -> dict[str, float | None]:
        return self.temperatures


class RecordingBar:
    def __init__(self) -> None:
        self.advances: list[int] = []

    def add_task(self, label, total):
        self.total = total
        return 0

    def advance(self, task, n):
        self.advances.append(n)

    def remove_task(self, task):
        pass


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 1024**2)
    yield
    ray.shutdown()


def test_episodes_come_back_one_by_one_within_each_workers_bound(local_ray):
    workers = [SlowWorker.remote(2), SlowWorker.remote(2)]
    tasks = [Task(id=f"t{i // 4}", env="terminal", family="f", seed=i, instruction="p") for i in range(12)]
    groups = [f"g{i // 4}" for i in range(12)]
    bar = RecordingBar()
    trajs = collect_episodes(workers, tasks, groups, run_seed=7, version=3, scripted=False, bar=bar, label="x")

    assert bar.advances == [1] * 12 and bar.total == 12  # the bar moves per episode, not per worker
    assert sorted((t.task.id, t.group) for t in trajs) == sorted((t.id, g) for t, g in zip(tasks, groups))
    stats = ray.get([w.stats.remote() for w in workers])
    assert [most for most, _ in stats] == [2, 2]  # 6 calls each, never more than the worker's 2 at once
    expected = {episode_seed(7, f"g{g}", k) for g in range(3) for k in range(4)}
    assert {s for _, seeds in stats for s in seeds} == expected and sum(len(s) for _, s in stats) == 12


def test_episodes_of_the_longest_references_start_first_with_their_own_seeds(local_ray):
    """Longest-processing-time order (``longest_first``): a task whose reference takes more calls is sent earlier, so
    a batch does not end on a few long episodes; each episode keeps the seed of its index within its group."""
    from sandforge.job.fleet.rollout_workers import longest_first
    from sandforge.types import ToolCall

    def task(i: int, calls: int) -> Task:
        return Task(id=f"t{i}", env="terminal", family="f", seed=i, instruction="p",
                    solution=[ToolCall(name="submit", arguments={})] * calls)

    tasks = [task(0, 2), task(1, 7), task(2, 2), task(3, 3), task(4, 0), task(5, 7)]
    assert longest_first(tasks) == [1, 5, 3, 0, 2, 4]  # ties keep their order
    worker = SlowWorker.remote(1)
    groups = ["a", "b", "a", "c", "d", "b"]
    collect_episodes([worker], tasks, groups, run_seed=7, version=0, scripted=False, bar=RecordingBar(), label="x")
    _, started = ray.get(worker.stats.remote())
    within = {0: 0, 1: 0, 2: 1, 3: 0, 4: 0, 5: 1}  # each episode's index within its group, in the given order
    # the calls go out longest first; an async actor may start them in another order, so the seeds are compared as a
    # set: reordering the calls changed no episode's seed
    assert sorted(started) == sorted(episode_seed(7, groups[k], within[k]) for k in range(6))


def test_each_episode_can_have_its_own_temperature(local_ray):
    """A sampled and a greedy evaluation in one pass (job/evaluation.py ``heldout_episodes``): each episode's call
    carries its own temperature, whatever order longest-first sends them in; one temperature serves all."""
    tasks = [Task(id=f"t{i}", env="terminal", family="f", seed=i, instruction="p") for i in range(4)]
    worker = SlowWorker.remote(4)
    collect_episodes([worker], tasks, ["s0", "s1", "g0", "g1"], run_seed=7, version=0, scripted=False,
                     bar=RecordingBar(), label="x", temperature=[0.7, 0.7, 0.0, 0.0])
    assert ray.get(worker.asked.remote()) == {"s0": 0.7, "s1": 0.7, "g0": 0.0, "g1": 0.0}
    collect_episodes([worker], tasks[:2], ["a", "b"], run_seed=7, version=0, scripted=False, bar=RecordingBar(),
                     label="x", temperature=1.0)
    assert {g: t for g, t in ray.get(worker.asked.remote()).items() if g in "ab"} == {"a": 1.0, "b": 1.0}
    with pytest.raises(ValueError, match="3 temperatures for 4 episodes"):
        collect_episodes([worker], tasks, list("abcd"), run_seed=7, version=0, scripted=False, bar=RecordingBar(),
                         label="x", temperature=[0.7, 0.7, 0.0])
