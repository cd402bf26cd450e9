"""Agent harnesses that run unmodified inside the sandbox, their model calls going through the recording proxy.

A harness is plain data (``Harness``): the files it needs copied into the sandbox, and the bash command that starts
it with the task's instruction. The command runs as the policy's user in the task's working directory, with

- ``OPENAI_BASE_URL`` (``http://127.0.0.1:PORT/v1``, the sandbox's own loopback, relayed to the proxy's socket) and
  ``OPENAI_API_KEY`` (the episode's token), the variables OpenAI clients read; ``SANDFORGE_PROXY_SOCKET`` for a
  client that speaks HTTP over a Unix socket itself;
- ``SANDFORGE_INSTRUCTION``: a file holding the task's instruction; ``SANDFORGE_HARNESS_DIR``: where its files are.

Harnesses are found by name (sandforge/registry.py): the built-ins below, then plugins under the
``sandforge.harnesses`` entry-point group, each a callable ``(options: dict) -> Harness`` (``agent.options`` in the
job YAML).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from sandforge.environments.sandbox.spec import PROXY_MOUNT  # noqa: F401 - in the sandbox: the proxy socket's folder
from sandforge.registry import harness_factory

HARNESS_DIR = "/tmp/.sandforge-harness"  # in the sandbox: the policy's to read (and to break: it is the policy)
SOCKET_NAME = "proxy.sock"
PROXY_PORT = 8391  # the forwarder's port on the sandbox's own loopback


@dataclass(frozen=True)
class Harness:
    """``files``: path under HARNESS_DIR -> content. ``command``: bash, run as described in the module docstring.
    ``needs``: what the sandbox's image must have (``python3`` for the forwarder), checked before the episode."""

    name: str
    command: str
    files: dict[str, bytes] = field(default_factory=dict)
    needs: tuple[str, ...] = ("python3",)


def _file(name: str) -> bytes:
    return resources.files("sandforge.rollout").joinpath("harness_files", name).read_bytes()


def bash_loop(options: dict[str, Any]) -> Harness:
    """The minimal harness written here (rollout/harness_files/bash_loop.py): one ``bash`` tool and ``submit``."""
    unknown = sorted(set(options) - {"max_steps"})
    if unknown:
        raise ValueError(f"agent.options: bash-loop takes max_steps, got {unknown}")
    steps = int(options.get("max_steps", 30))
    return Harness(name="bash-loop", files={"bash_loop.py": _file("bash_loop.py")},
                   command=f'python3 "$SANDFORGE_HARNESS_DIR/bash_loop.py" "$SANDFORGE_INSTRUCTION" --max-steps {steps}')


def runtime_files() -> dict[str, bytes]:
    """What every harness gets beside its own files: the start script and the loopback forwarder."""
    return {"start.sh": _file("start.sh"), "forward.py": _file("forward.py")}


def find_harness(name: str, options: dict[str, Any] | None = None) -> Harness:
    """The harness ``name`` made with ``options``; ValueError if there is none or its options are wrong."""
    try:
        make = harness_factory(name)
    except KeyError as e:
        raise ValueError(str(e).strip("'\"")) from None
    harness = make(dict(options or {}))
    if not isinstance(harness, Harness):
        raise ValueError(f"harness {name!r} made a {type(harness).__name__}, not a sandforge Harness")
    return harness
