"""An environment whose episode lives in its own Docker sandbox: the lifecycle every built-in env shares.

The sandbox comes from a ``SandboxPool`` when one is given (``reset`` acquires a warm one, ``close`` releases it), or is
created by the env itself otherwise. Either way it belongs to one episode only. ``reset`` prepares it from the task's
``setup``: ``files`` (path -> text, relative to the workdir) are written, then ``commands`` run in the policy's shell
session (a service they start keeps running). Subclasses add tools; none are declared here.

``sandbox_defaults``: SandboxSpec fields this env needs beyond the job's ``sandbox`` config (e.g. a browser's memory);
the rollout worker applies them over the config when it builds the env's pool.

``score``: the grader ``(sandbox, task) -> Reward`` that the step ending the episode reports as its reward (what
``gymnasium.make`` gives, see ``rollout/gym_envs.py``: the same ``score_task`` the agent loop grades with). Without it,
as in the rollout worker, ``step``'s reward stays 0.0 and the agent loop grades the episode itself afterwards.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any, Callable, ClassVar

from sandforge.grading import shadows
from sandforge.environments.base import ObservationText, ToolEnv
from sandforge.sandbox.daemon import DockerClient, docker_client
from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.labels import driver_labels
from sandforge.sandbox.pool import SandboxPool
from sandforge.sandbox.stats import SandboxStats
from sandforge.types import ExecResult, Reward, SandboxError, Task

RUN_IN_WORKDIR = ("command", "harbor_tests")  # checks that run commands in the workdir: shadow modules set aside


class SandboxEnv(ToolEnv):
    """One task, one container per episode (``reset`` never reuses a sandbox). Close it to remove the container.

    With ``pool``, sandboxes come from it (its spec wins; ``spec`` should match it) and ``client`` and ``labels`` are
    unused. Without one, the env creates its own, labelled with ``labels`` (default: this process's ``driver_labels``).
    The spec in use is ``sandbox_spec``; ``spec`` is gymnasium's (the ``EnvSpec`` that ``gymnasium.make`` sets).
    Exec latency and exec failures go to ``stats`` (default: the pool's stats, if any). ``score``, ``max_steps`` and
    ``max_observation``: see the module's and ``ToolEnv``'s docstrings.
    """

    sandbox_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        task: Task,
        spec: SandboxSpec,
        run_id: str,
        exec_timeout: float = 10.0,
        client: DockerClient | None = None,
        pool: SandboxPool | None = None,
        stats: SandboxStats | None = None,
        labels: dict[str, str] | None = None,
        *,
        score: Callable[[DockerSandbox, Task], Reward] | None = None,
        max_steps: int | None = None,
        max_observation: int | None = None,
    ) -> None:
        super().__init__(max_steps=max_steps, max_observation=max_observation)
        if max_observation is not None:  # the instruction is the first observation, and it is never cut
            self.observation_space = ObservationText(max(max_observation, len(task.instruction)))
        self.score = score
        self.task = task
        self.sandbox_spec = pool.spec if pool is not None else spec
        self.run_id = run_id
        self.exec_timeout = exec_timeout
        self.pool = pool
        self.stats = stats if stats is not None else (pool.stats if pool is not None else None)
        self._client = client
        self._labels = labels
        self._sandbox: DockerSandbox | None = None

    @property
    def sandbox(self) -> DockerSandbox:
        """The live sandbox of the current episode (verifiers read it after the episode)."""
        if self._sandbox is None:
            raise RuntimeError("the env has no sandbox: call reset() first")
        return self._sandbox

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed, options=options)
        self.close()
        if self.pool is not None:
            self._sandbox = self.pool.acquire()
        else:
            self._client = self._client or docker_client()  # one client for all of this env's episodes
            labels = self._labels or driver_labels(self.run_id)
            self._sandbox = DockerSandbox.create(self.sandbox_spec, self.run_id, client=self._client, labels=labels)
        try:
            for path, content in self.task.setup.get("files", {}).items():
                self._sandbox.write_file(posixpath.join(self.sandbox_spec.workdir, path), content)
        except (OSError, ValueError) as e:
            self.close()
            raise SandboxError(f"task {self.task.id}: setup could not write its files: {e}") from e
        for command in self.task.setup.get("commands", []):  # e.g. start a service (the session keeps it running)
            result = self._sandbox.exec(command, timeout=self.exec_timeout)
            if result.exit_code != 0:
                self.close()
                raise SandboxError(f"task {self.task.id}: setup command {command!r} exited {result.exit_code}: "
                                   f"{result.output[-200:]}")
        if any(isinstance(c, dict) and c.get("verifier") in RUN_IN_WORKDIR for c in self.task.checks):
            try:  # what the task put in the workdir, before the policy acts: sandforge/grading/shadows.py
                shadows.mark_start(self._sandbox)
            except OSError as e:
                self.close()
                raise SandboxError(f"task {self.task.id}: {e}") from e
        return self.task.instruction, {"task_id": self.task.id, "sandbox": self._sandbox.name}

    def episode_reward(self, info: dict) -> float:
        """The verifiers' grade of the sandbox as the episode left it, by ``score`` (0.0 without one). A grader that
        fails (a broken sandbox, a check that cannot run) gives 0.0 and says why in ``info["failure"]``, as the agent
        loop marks such an episode failed; the reward itself goes to ``info["reward"]``."""
        if self.score is None:
            return 0.0
        try:
            reward = self.score(self.sandbox, self.task)
        except Exception as e:  # noqa: BLE001 - a broken verifier or sandbox fails the episode, not the caller
            info["failure"] = f"{type(e).__name__}: {e}"
            return 0.0
        info["reward"] = dataclasses.asdict(reward)
        return float(reward.value)

    def close(self) -> None:
        """Remove the episode's container (back to the pool, which removes it, when there is one). Never raises."""
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            if self.pool is not None:
                self.pool.release(sandbox)
            else:
                sandbox.close()

    def run_command(self, command: str, timeout: float | None = None, **kwargs) -> ExecResult:
        """``sandbox.exec`` for a tool (``timeout`` default: ``exec_timeout``), counted in ``stats``: its latency, a
        timeout, or a broken sandbox (whose SandboxError still propagates: the episode fails)."""
        try:
            result = self.sandbox.exec(command, timeout=self.exec_timeout if timeout is None else timeout, **kwargs)
        except SandboxError:
            if self.stats is not None:
                self.stats.failure("exec")
            raise
        if self.stats is not None:
            self.stats.record_exec(result.seconds)
            if result.timed_out:
                self.stats.failure("timeout")
        return result

    def _truncate(self, text: str) -> str:
        limit = self.sandbox_spec.max_output_bytes
        return text if len(text) <= limit else text[:limit] + f"\n[... truncated {len(text) - limit} chars]"
