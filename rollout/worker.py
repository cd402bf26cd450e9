"""A rollout worker: a Ray actor that runs many episodes at once (asyncio), each in its own fresh sandbox.

Sandboxes come from one warm ``SandboxPool`` per environment image, on this worker's node (its local Docker daemon, or
``DOCKER_HOST``). Containers carry the driver's labels, so a dead driver's sandboxes are found by the reaper.
"""

from __future__ import annotations

import asyncio

from sandforge.config import JobConfig
from sandforge.environments.sandbox.docker_sandbox import SandboxSpec, docker_client
from sandforge.environments.sandbox.pool import SandboxPool
from sandforge.environments.sandbox.stats import SandboxStats
from sandforge.models.generate import Generation, SamplingParams
from sandforge.models.policy import load_chat
from sandforge.registry import environment
from sandforge.rollout.agent import EpisodeLimits, run_episode, scripted_policy
from sandforge.types import Reward, Task, Trajectory


class RolloutWorker:
    def __init__(self, worker_id: int, job: dict, run_id: str, engine, images: dict[str, str],
                 sandbox_labels: dict[str, str]):
        self.worker_id = worker_id
        self.cfg = JobConfig.model_validate(job)
        self.run_id = run_id
        self.engine = engine
        self.images = images
        self.chat = load_chat(self.cfg.model.model_dump(mode="json"))
        r = self.cfg.rollout
        self.limits = EpisodeLimits(
            max_turns=r.max_turns,
            max_context=r.max_context,
            sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                    top_k=r.top_k, stop_ids=tuple(self.chat.stop_ids)),
        )
        self.env_classes = {name: environment(name).env_class() for name in images}
        s = self.cfg.sandbox
        self.stats = SandboxStats()
        client = docker_client(max_pool_size=max(32, 2 * s.max_live))
        self.pools = {
            name: SandboxPool(self._spec(image), run_id, size=s.warm_pool, client=client, max_live=s.max_live,
                              max_creates_per_second=s.creates_per_second, labels=sandbox_labels,
                              stats=self.stats)
            for name, image in images.items()
        }

    def _spec(self, image: str) -> SandboxSpec:
        s = self.cfg.sandbox
        return SandboxSpec(image=image, memory=s.memory, cpus=s.cpus, pids_limit=s.pids_limit, network=s.network,
                           runtime=s.runtime, read_only=s.read_only, workspace_size=s.workspace_size,
                           tmp_size=s.tmp_size, nofile=s.nofile, max_file_size=s.max_file_size)

    def _make_env(self, task: Task):
        pool = self.pools[task.env]
        return self.env_classes[task.env](task, pool.spec, self.run_id, exec_timeout=self.cfg.sandbox.exec_timeout,
                                          pool=pool)

    async def _engine_policy(self, token_ids: list[int], params: SamplingParams) -> Generation:
        out = await self.engine.generate.remote(token_ids, {**params.__dict__, "stop_ids": list(params.stop_ids)})
        out.pop("version")
        return Generation(**out)

    async def run_episodes(self, tasks: list[dict], groups: list[str], version: int, scripted: bool = False) -> list[dict]:
        """Run one episode per (task, group) pair, ``rollout.concurrency`` at a time; failures come back as data."""
        gate = asyncio.Semaphore(self.cfg.rollout.concurrency)

        async def one(task_dict: dict, group: str) -> dict:
            task = Task.from_dict(task_dict)
            policy = scripted_policy(task, self.chat) if scripted else self._engine_policy
            async with gate:
                try:
                    env = self._make_env(task)
                except Exception as e:  # e.g. a plugin env that cannot be built: this episode fails, not the run
                    return Trajectory(task=task, group=group, failed=True, failure=f"env: {e}",
                                      reward=Reward(0.0, False, reason=str(e))).to_dict()
                traj = await run_episode(task, env, policy, self.chat, self.limits, group, version)
            traj.metadata["worker"] = self.worker_id
            return traj.to_dict()

        return await asyncio.gather(*(one(t, g) for t, g in zip(tasks, groups)))

    def sandbox_stats(self) -> dict:
        """This worker's sandbox samples and counters since the last call (the driver merges all workers')."""
        return self.stats.export(reset=True)

    def close(self) -> None:
        """Remove the warm sandboxes; episodes are over by now."""
        for pool in self.pools.values():
            pool.close()
