"""The environment Harbor tasks run in: the terminal's tools, in the task's own image."""

from __future__ import annotations

from typing import Any, ClassVar

from sandforge.environments.harbor.healthcheck import Healthcheck, wait_healthy
from sandforge.environments.harbor.settings import shell_exports
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.types import ExecResult, SandboxError


class HarborEnv(TerminalEnv):
    """A terminal in the image the task's ``environment/Dockerfile`` builds (the rollout worker picks the pool by
    ``task.image``). The policy runs as the task's user (``task.sandbox.user``: root unless
    ``[agent] user``, or the non-root ``sandbox`` user in hardened mode) in the image's WORKDIR
    (``workdir_from_image``; task.toml's ``[environment] workdir`` wins). Each of its commands gets the task's
    ``[environment] env`` (``task.setup["env"]``), set again before every command, as Harbor passes it to every
    exec. A task's ``[environment] healthcheck`` passes before the first observation (environments/harbor/
    healthcheck.py).
    """

    # The image's WORKDIR becomes a size-capped tmpfs filled from the image (sandbox/workspace.py): what the
    # policy writes there stays off the host's disk; [environment] storage_mb sets the cap. The root filesystem stays
    # writable: Harbor's grader writes its reward to /logs/verifier and copies the tests to /tests, a root agent
    # installs packages, and test.sh often writes outside the WORKDIR.
    sandbox_defaults: ClassVar[dict[str, Any]] = {"read_only": False, "workspace_size": "1g",
                                                  "workspace_from_image": True}
    workdir_from_image: ClassVar[bool] = True

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        observation, info = super().reset(seed=seed, options=options)
        if (check := self.task.setup.get("healthcheck")) is not None:
            try:
                wait_healthy(self.sandbox, Healthcheck.from_dict(check))
            except SandboxError as e:
                self.close()
                raise SandboxError(f"task {self.task.id}: {e}") from e
        return observation, info

    def run_command(self, command: str, timeout: float | None = None, **kwargs) -> ExecResult:
        """The terminal's exec, with the task's environment exported first (on a line of its own, so the policy's
        command is parsed as it wrote it)."""
        return super().run_command(shell_exports(self.task.setup.get("env") or {}) + command, timeout, **kwargs)
