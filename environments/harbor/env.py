"""The environment Harbor tasks run in: the terminal's tools, in the task's own image."""

from __future__ import annotations

from typing import Any, ClassVar

from sandforge.environments.terminal.env import TerminalEnv


class HarborEnv(TerminalEnv):
    """A terminal in the image the task's ``environment/Dockerfile`` builds (the rollout worker picks the pool by
    ``task.setup["image"]``). The policy still runs as the image's non-root ``sandbox`` user in /workspace.

    The root filesystem stays writable because Harbor's grader writes its reward to ``/logs/verifier`` and copies the
    tests to ``/tests``, paths outside the sandbox's tmpfs mounts; only root can create them (``/`` is root's), so
    the policy gains nothing from it. /workspace is a volume rather than a tmpfs, so it starts with whatever the
    task's image put there (its input files).
    """

    sandbox_defaults: ClassVar[dict[str, Any]] = {"read_only": False, "workspace_size": None}
