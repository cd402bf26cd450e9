"""A rollout worker: a Ray actor that runs many episodes at once (asyncio tasks), each in its own fresh sandbox.

``rollout.workers`` actors each run up to ``rollout.concurrency`` episodes at once. Sandboxes come from one warm
``SandboxPool`` per image (an environment's, made at start; or a Harbor task's own, made when a task first needs it),
on this worker's node (its local Docker daemon, or ``DOCKER_HOST``); containers carry the driver's labels, so a dead
driver's sandboxes are found by the reaper.

Backpressure: an episode takes one of ``sandbox.max_live`` slots (per image) before it asks the pool for a
sandbox and gives it back after the sandbox is removed, so when the pool is full episodes wait in the event loop for a
sandbox instead of failing, and no thread of the worker ever blocks in ``acquire`` while the episodes that would free a
sandbox need threads for their tool calls. A failed episode comes back as data (``failed=True``), never as an error.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from sandforge.config import (AgentConfig, EnvironmentConfig, ModelConfig, RemoteEngineConfig, RolloutConfig,
                              SandboxConfig)
from sandforge.sandbox.daemon import docker_client
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.job_spec import grading_spec, sandbox_spec
from sandforge.sandbox.pool import SandboxPool
from sandforge.sandbox.stats import SandboxStats
from sandforge.models.build import load_chat
from sandforge.registry import environment
from sandforge.rollout.agent import run_episode
from sandforge.rollout.episode import EpisodeLimits
from sandforge.rollout.harness_episode import run_harness_episode
from sandforge.rollout.harnesses import find_harness
from sandforge.rollout.proxy import ProxyBudget
from sandforge.rollout.vf_episode import VerifiersEnvs, agent_limits, run_vf_episode
from sandforge.rollout.policy_client import EnginePolicy, scripted_policy
from sandforge.types import Reward, Task, TaskSandbox, Trajectory

TOOL_GRACE_S = 30.0  # beyond sandbox.exec_timeout: how long a tool call may outlive the episode's deadline


@dataclass(frozen=True)
class WorkerSetup:
    """What a rollout worker is given: its part of the job's config, typed, and where things are."""

    run_id: str
    engine: str  # the engine actor's name (a handle among an actor's arguments may break its restarts, ray#53727)
    images: dict[str, str]  # image name -> tag, every image the job's tasks use (built by the driver)
    labels: dict[str, str]  # the driver's labels for every container (lifecycle.driver_labels)
    environments: tuple[EnvironmentConfig, ...]
    rollout: RolloutConfig
    sandbox: SandboxConfig
    model: ModelConfig  # for the chat format: how episodes become tokens
    remote: RemoteEngineConfig | None = None  # engine.remote: generate through that server, not the engine actor
    agent: AgentConfig = field(default_factory=AgentConfig)  # agent.harness: an unmodified harness drives episodes, behind the proxy


def at_threshold(traj: Trajectory) -> None:
    """A graded episode of a task with ``success_at`` succeeds when its reward reaches it (a continuous reward)."""
    if traj.task.success_at is not None and not traj.failed and traj.reward is not None:
        traj.reward.success = traj.reward.value >= traj.task.success_at - 1e-9


class RolloutWorker:
    """``engine``: the engine actor's name as in ``setup`` (the driver's way), or any object with ``async
    generate(request)`` (tests, benchmarks). With ``setup.remote`` the worker talks to that server itself."""

    def __init__(self, worker_id: int, setup: WorkerSetup, engine=None):
        self.worker_id = worker_id
        self.run_id = setup.run_id
        self.remote = None
        if engine is None and setup.remote is not None:
            from sandforge.engine.remote import RemoteEngine

            r = setup.remote
            engine = self.remote = RemoteEngine(r.url, model=r.model, api_key=r.api_key, timeout=r.timeout,
                                                retries=r.retries)
        elif engine is None:
            import ray

            engine = ray.get_actor(setup.engine)
        self.policy = EnginePolicy(engine)  # a Ray handle, or an object with async generate(request)
        self.images = setup.images
        self.rollout, self.sandbox = setup.rollout, setup.sandbox
        self.chat = load_chat(setup.model)
        r, s = setup.rollout, setup.sandbox
        self.limits = EpisodeLimits.from_config(r, self.chat.stop_ids, tool_grace=s.exec_timeout + TOOL_GRACE_S)
        self.env_turns = {e.name: e.max_turns for e in setup.environments if e.max_turns is not None}
        self.env_temperatures = {e.name: e.temperature for e in setup.environments if e.temperature is not None}
        entries = {e.name: environment(e.name) for e in setup.environments}
        sandboxed = {name: entry for name, entry in entries.items() if entry.library_loader is None}
        self.env_classes = {name: entry.env_class() for name, entry in sandboxed.items()}
        self.env_images = {name: entry.image_name for name, entry in sandboxed.items()}
        a = setup.agent
        self.harness = find_harness(a.harness, a.options) if a.harness else None
        self.budget = ProxyBudget(max_requests=a.max_requests, max_tokens=a.max_tokens)
        # verifiers environments: loaded on first use; their episodes need no sandbox
        self.vf_envs = VerifiersEnvs(agent_limits(self.limits, self.budget))
        self.gate = asyncio.Semaphore(r.concurrency)  # episodes at once
        self.slots: dict[str, asyncio.Semaphore] = {}  # sandboxes at once, per pool
        self.episodes = 0  # numbers the engine sessions of this worker
        self.executor: ThreadPoolExecutor | None = None
        self.stats = SandboxStats()
        self.labels = setup.labels
        self.client = docker_client(max_pool_size=max(32, 2 * s.max_live))
        self.pools: dict[str, SandboxPool] = {}
        for name, image in self.env_images.items():  # environment images warm up now; a task's own when first used
            if image is not None:
                self._pool(image, self.env_classes[name], s.warm_pool)

    def _spec(self, image: str, env_class: type, task_sandbox: TaskSandbox | None = None) -> SandboxSpec:
        spec = sandbox_spec(self.sandbox, image, env_class, task_sandbox, self.client)
        return replace(spec, proxy=True) if self.harness is not None else spec

    def _pool(self, image: str, env_class: type, warm: int, task_sandbox: TaskSandbox | None = None,
              grading: str | None = None) -> SandboxPool:
        key = pool_key_of(image, grading)
        if key not in self.pools:
            for name in (image, grading):
                if name is not None and name not in self.images:
                    raise ValueError(f"image {name!r} was not built by the driver (built: {', '.join(self.images)})")
            s = self.sandbox
            spec = self._spec(self.images[image], env_class, task_sandbox)
            if grading is not None:  # a separate grader's sandbox (sandbox.grading_sandbox), from its own image
                spec = replace(spec, grading=grading_spec(s, self.images[grading], env_class, task_sandbox,
                                                          self.client))
            self.pools[key] = SandboxPool(spec, self.run_id, size=warm, client=self.client, max_live=s.max_live,
                                          max_creates_per_second=s.creates_per_second, labels=self.labels,
                                          stats=self.stats)
            self.slots[key] = asyncio.Semaphore(s.max_live)
        return self.pools[key]

    def _make_env(self, task: Task):
        # a task's own image (Harbor) keeps no warm sandboxes: that task may not come again for many steps
        pool = self._pool(image_key(task, self.env_images), self.env_classes[task.env], 0, task.sandbox,
                          task.grading_image)  # keyed by pool_key
        return self.env_classes[task.env](task, pool.spec, self.run_id, exec_timeout=self.sandbox.exec_timeout,
                                          pool=pool)

    def _threads(self) -> None:
        """Env calls run in threads: enough for every episode's tool calls at once, so none waits for a thread."""
        if self.executor is None:
            r = self.rollout
            self.executor = ThreadPoolExecutor(r.concurrency * r.max_tool_calls + 4, thread_name_prefix="episode")
            asyncio.get_running_loop().set_default_executor(self.executor)

    async def run_episodes(self, tasks: list[dict], groups: list[str], version: int, scripted: bool = False,
                           seeds: list[int] | None = None, temperature: float | None = None) -> list[dict]:
        """Run one episode per (task, group) pair, ``rollout.concurrency`` at a time; failures come back as data.
        ``seeds`` (one per episode) make their sampling reproducible (see ``run_episode``); ``temperature``: sample at
        it instead of ``rollout.temperature`` (held-out evaluation: ``eval.temperature``, or 0 to decode greedily)."""
        self._threads()
        if self.remote is not None:  # the version pushed last: what a server that reports none (vLLM) serves now
            self.remote.version = version
        return await asyncio.gather(*(self._episode(Task.from_dict(t), g, version, scripted, s, temperature)
                                      for t, g, s in zip(tasks, groups, seeds or [None] * len(tasks))))

    def episode_limits(self, env: str, temperature: float | None = None) -> EpisodeLimits:
        """An episode's limits in environment ``env``: ``rollout``'s, with the environment's own ``max_turns`` and
        ``temperature`` where set, for every kind of episode (vf, harness, sandbox); ``temperature`` given (held-out
        evaluation) wins over both temperatures."""
        limits = self.limits
        if env in self.env_turns:
            limits = replace(limits, max_turns=self.env_turns[env])
        if temperature is None:
            temperature = self.env_temperatures.get(env)
        return limits if temperature is None else replace(limits, temperature=float(temperature))

    async def _episode(self, task: Task, group: str, version: int, scripted: bool, seed: int | None = None,
                       temperature: float | None = None) -> dict:
        self.episodes += 1
        session = f"{self.run_id}/{self.worker_id}/{group}/{self.episodes}"
        limits = self.episode_limits(task.env, temperature)
        policy = scripted_policy(task, self.chat, version) if scripted else self.policy
        if task.env not in self.env_classes:  # a library's environment (verifiers): no sandbox to wait for
            async with self.gate:
                traj = await run_vf_episode(task, self.vf_envs, policy, self.chat, limits,
                                            self.budget, group, version, session, seed=seed)
            return self._finished(traj, limits, scripted)
        async with self.gate:
            waited = time.monotonic()
            try:
                env = self._make_env(task)
                slot = self.slots[pool_key(task, self.env_images)]
            except Exception as e:  # e.g. a plugin env that cannot be built: this episode fails, not the run
                traj = Trajectory(task=task, group=group, failed=True, failure=f"env: {e}", finish_reason="error",
                                  policy_version=version, reward=Reward(0.0, False, reason=str(e)))
            else:
                timeout = task.agent_timeout  # a Harbor task's [agent] timeout_sec, unless the job's
                if timeout and "episode_timeout" not in self.rollout.model_fields_set:
                    limits = replace(limits, episode_timeout=float(timeout))
                async with slot:  # backpressure: wait here for a sandbox while sandbox.max_live are in use
                    waited = time.monotonic() - waited
                    if self.harness is not None and not scripted:
                        traj = await run_harness_episode(task, env, policy, self.chat, limits, self.harness,
                                                         self.budget, group, version, session, seed=seed)
                    else:
                        traj = await run_episode(task, env, policy, self.chat, limits, group, version, session,
                                                 seed=seed)
                traj.metadata["seconds_sandbox_wait"] = waited
        return self._finished(traj, limits, scripted)

    def _finished(self, traj: Trajectory, limits: EpisodeLimits, scripted: bool) -> dict:
        """The episode as it travels to the driver: which worker ran it, the temperature its policy sampled at, and
        its success at the task's ``success_at`` where the environment sets one."""
        traj.metadata["worker"] = self.worker_id
        at_threshold(traj)
        if not scripted:
            traj.temperature = limits.temperature
        return traj.to_dict()

    def ready(self) -> int:
        """Answers once the worker is up (the driver waits on it after Ray restarts a worker)."""
        return self.worker_id

    def sandbox_stats(self) -> dict:
        """This worker's sandbox samples and counters since the last call (the driver merges all workers')."""
        return self.stats.export(reset=True)

    def close(self) -> None:
        """Remove the warm sandboxes; episodes are over by now."""
        for pool in self.pools.values():
            pool.close()
        if self.executor is not None:
            self.executor.shutdown(wait=False)


def pool_key_of(image: str, grading: str | None) -> str:
    """The sandbox pool of tasks run in ``image`` and graded in ``grading`` (a separate grader's image, or None)."""
    return image if grading is None else f"{image} graded in {grading}"


def pool_key(task: Task, env_images: dict[str, str | None]) -> str:
    """The sandbox pool ``task`` runs in (``pool_key_of`` its image and grading image)."""
    return pool_key_of(image_key(task, env_images), task.grading_image)


def image_key(task: Task, env_images: dict[str, str | None]) -> str:
    """Which image (and so which sandbox pool) runs ``task``: the task's own (Harbor), else its environment's."""
    key = task.image or env_images.get(task.env)
    if not key:
        raise ValueError(f"task {task.id}: environment {task.env!r} has no image and the task names none "
                         "(setup.image)")
    return key
