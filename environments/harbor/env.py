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

    # The image's WORKDIR becomes a size-capped tmpfs filled from the image (environments/sandbox/seed.py): what the
    # policy writes there stays off the host's disk; [environment] storage_mb sets the cap. The root filesystem stays
    # writable: a root agent installs packages, and test.sh often writes outside the WORKDIR.
    sandbox_defaults: ClassVar[dict[str, Any]] = {"read_only": False, "workspace_size": "1g",
                                                  "workspace_from_image": True}
    workdir_from_image: ClassVar[bool] = True
