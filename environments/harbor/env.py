"""The environment Harbor tasks run in: the terminal's tools, in the task's own image."""

from __future__ import annotations

from typing import Any, ClassVar

from sandforge.environments.terminal.env import TerminalEnv


class HarborEnv(TerminalEnv):
    """A terminal in the image the task's ``environment/Dockerfile`` builds (the rollout worker picks the pool by
    ``task.setup["image"]``). The policy runs as the task's user (``task.setup["sandbox"]["user"]``: root unless
    ``[agent] user``, or the non-root ``sandbox`` user in hardened mode) in the image's WORKDIR
    (``workdir_from_image``; task.toml's ``[environment] workdir`` wins).

    The root filesystem stays writable: Harbor's grader writes its reward to ``/logs/verifier`` and copies the tests
    to ``/tests``, and a root agent installs packages. The WORKDIR is a volume rather than a tmpfs, so it starts with
    whatever the task's image put there.
    """

    sandbox_defaults: ClassVar[dict[str, Any]] = {"read_only": False, "workspace_size": None}
    workdir_from_image: ClassVar[bool] = True
