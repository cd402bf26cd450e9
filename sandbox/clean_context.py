"""The context a root one-off command runs in: nothing the policy could write decides what it executes.

Graders run as root in one-off shells (``DockerSandbox.exec(user="root", session=False)``). The container's environment
gives every command the policy's HOME (the workspace, unless the spec names another), and a program started with that
HOME reads files the policy wrote: Python's user site (``.pth`` files run code at start-up), ``~/.gitconfig``
(``core.fsmonitor`` and friends run commands), and every other dotfile a tool consults. So root's one-off commands get
root's own HOME, no Python user site, and git with neither a global nor a system configuration. PATH stays the
image's (the task author's), as declared in the image: the policy's session never reaches a one-off shell.

What this cannot cover: a command that deliberately runs the policy's code as root (a task author's choice), and
Python putting its working directory first on ``sys.path`` for ``python3 -c`` and ``-m``; for a check's command,
sandforge/grading/startup.py makes root's modules win anyway. sandforge's own in-sandbox code runs with ``python3 -I`` from
``/`` (verifiers/state.py).
"""

from __future__ import annotations

ROOT_HOME = "/root"
CLEAN_ROOT_ENVIRONMENT = {
    "HOME": ROOT_HOME,
    "PYTHONNOUSERSITE": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def is_root(user: str) -> bool:
    return user in ("root", "0") or user.startswith("0:") or user.startswith("root:")


def one_off_environment(user: str) -> dict[str, str]:
    """What a one-off command run as ``user`` gets on top of the container's environment."""
    return dict(CLEAN_ROOT_ENVIRONMENT) if is_root(user) else {}
