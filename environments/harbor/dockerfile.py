"""A Harbor task's ``environment/Dockerfile`` made buildable here, unmodified on disk.

Each ``FROM`` image is used as it is when the daemon has it (or can pull it). Otherwise ``sandbox.base_map`` may map it
to the locally bootstrapped Debian base: by default Debian bookworm and trixie, Ubuntu, and the python-on-Debian images
(which also get Debian's python3, pip and venv, with pip allowed to install system-wide as in those images). Each
mapping is said in one line; an image that is neither here nor mapped fails in one line naming the task and the image.
``FROM ${BASE}`` (sandforge's own task images) takes the base directly.

Modes (``harbor.mode`` in the job's environment entry):

- ``root`` (Harbor's contract): the agent runs as the task's user, root unless ``[agent] user`` says otherwise, in the
  image's WORKDIR. It can rewrite what test.sh later runs; an audit found 16% of terminal tasks gameable that way.
- ``hardened`` (for RL): a non-root ``sandbox`` user is added (uid 1000, with useradd's full path, so an ``ENV PATH``
  without /usr/sbin does not matter) and given the WORKDIR; the agent runs as it. Tasks that need root break: the
  check command reports them.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

# image pattern (registry and digest stripped, "library/" dropped) -> "base" or "base+python"
DEFAULT_BASE_MAP = {
    "debian:bookworm*": "base",
    "debian:12*": "base",
    "debian:trixie*": "base",
    "debian:13*": "base",
    "debian:stable*": "base",
    "ubuntu:*": "base",
    "python:*": "base+python",
}
MODES = ("root", "hardened")
AGENT_USER = "sandbox"  # hardened mode's agent

_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.I)


class BaseImageError(ValueError):
    """A task's FROM image is neither on this host nor mapped: one line naming the task and the image."""


def short_name(ref: str) -> str:
    """``public.ecr.aws/docker/library/debian:bookworm-slim@sha256:..`` -> ``debian:bookworm-slim``."""
    ref = ref.split("@", 1)[0]
    parts = ref.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]  # a registry host
    while len(parts) > 1 and parts[0] in ("docker", "library"):
        parts = parts[1:]
    name = "/".join(parts)
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def mapped(ref: str, base_map: dict[str, str]) -> str | None:
    name = short_name(ref)
    return next((target for pattern, target in base_map.items() if fnmatch.fnmatchcase(name, pattern)), None)


@dataclass
class Rewrite:
    dockerfile: str
    notes: list[str] = field(default_factory=list)  # one line per FROM mapped to the local base
    workdir: str = "/"  # the final stage's WORKDIR as the Dockerfile sets it (the built image's config is the truth)


def final_workdir(lines: list[str]) -> str:
    """The WORKDIR the final stage ends in (Docker's default "/"; a stage built FROM an earlier one starts in that
    one's)."""
    workdir, stages, current = "/", {}, None
    for line in lines:
        m = _FROM.match(line)
        if m:
            workdir = stages.get(m.group(3).lower(), "/")
            alias = re.search(r"\bAS\s+(\S+)", m.group(4), re.I)
            current = alias.group(1).lower() if alias else None
            continue
        w = re.match(r"^\s*WORKDIR\s+(\S+)", line, re.I)
        if w:
            path = w.group(1).strip("\"'")
            workdir = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
        if current:
            stages[current] = workdir
    return workdir


def rewrite(text: str, task: str, base_tag: str, present, base_map: dict[str, str] | None = None,
            mode: str = "root") -> Rewrite:
    """``text`` with every FROM image that is not ``present(ref)`` mapped to ``base_tag``, and in ``hardened`` mode the
    agent user added. Raises BaseImageError for an image neither present nor mapped."""
    if mode not in MODES:
        raise ValueError(f"harbor mode {mode!r}: expected one of {', '.join(MODES)}")
    base_map = DEFAULT_BASE_MAP if base_map is None else base_map
    out, notes, stages, continuing = [], [], set(), False
    for line in text.splitlines():
        m = None if continuing else _FROM.match(line)  # a continued RUN line is never a FROM
        continuing = line.rstrip().endswith("\\")
        if not m:
            out.append(line)
            continue
        head, flags, ref, rest = m.groups()
        alias = re.search(r"\bAS\s+(\S+)", rest, re.I)
        if ref.lower() in stages or "$" in ref or ref == "scratch":
            out.append(line)  # an earlier stage, a build arg (sandforge's ${BASE}), or nothing at all
        elif present(ref):
            out.append(line)
        else:
            target = mapped(ref, base_map)
            if target is None:
                raise BaseImageError(f"{task}: base image {ref} is not on this host, cannot be pulled, and "
                                     "sandbox.base_map maps nothing to it")
            notes.append(f"{task}: FROM {ref} is not here; built on {base_tag} instead (sandbox.base_map: "
                         f"{short_name(ref)} -> {target})")
            out.append(f"{head}{base_tag}{rest}")
            if target == "base+python":
                out.append("ENV PIP_BREAK_SYSTEM_PACKAGES=1")
                out.append("RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip "
                           "python3-venv python-is-python3 && rm -rf /var/lib/apt/lists/*")
        if alias:
            stages.add(alias.group(1).lower())
    if mode == "hardened":  # RUN starts in the image's WORKDIR, whatever set it: $PWD is the agent's workdir
        out += ["USER root",
                f"RUN (id -u {AGENT_USER} >/dev/null 2>&1 || /usr/sbin/useradd --uid 1000 --create-home --shell "
                f"/bin/bash {AGENT_USER} || /usr/sbin/useradd --create-home --shell /bin/bash {AGENT_USER}) && "
                f'chown -R {AGENT_USER}: "$PWD"']
    return Rewrite("\n".join(out) + "\n", notes, final_workdir(out))



@dataclass
class HarborBuild:
    """How a Harbor task's image is built here (images.py ``BuildContext.prepare``): its Dockerfile rewritten against
    what the daemon has or can pull, and the job's ``sandbox.base_map`` (None: ``DEFAULT_BASE_MAP``)."""

    task: str
    dockerfile: str  # path of the task's environment/Dockerfile
    mode: str = "root"
    base_map: dict[str, str] | None = None
    notes: list[str] = field(default_factory=list)  # the last build's lines about mapped bases

    def __call__(self, client, base_tag: str) -> tuple[str, list[str]]:
        text = open(self.dockerfile).read()
        done = rewrite(text, self.task, base_tag, lambda ref: image_present(client, ref), self.base_map, self.mode)
        self.notes = done.notes
        return done.dockerfile, done.notes


def image_present(client, ref: str) -> bool:
    """The daemon has ``ref``, or pulls it now (no registry answering is the usual case here, and fails fast)."""
    import docker.errors

    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        pass
    except docker.errors.DockerException:
        return False
    try:
        client.images.pull(ref)
        return True
    except Exception:  # noqa: BLE001 - unreachable registry, unknown image, no credentials: not here
        return False
