"""A Harbor task's ``environment/Dockerfile`` made buildable here, unmodified on disk.

Each ``FROM`` image is used as it is when the daemon has it (or can pull it). Otherwise ``sandbox.base_map`` (added to
the defaults) may map it to the locally bootstrapped Debian base: by default Debian bookworm and trixie, Ubuntu, and the python-on-Debian images
(which also get Debian's python3, pip and venv, with pip allowed to install system-wide as in those images). Each
mapping is said in one line; an image that is neither here nor mapped fails in one line naming the task and the image.
``FROM ${BASE}`` (sandforge's own task images) takes the base directly.

A build here cannot reach a package index, so when a base was mapped, the pinned packages its ``RUN pip install`` lines
name (``pip_requirements``) are downloaded on the host as wheels for the base's Python, said in one line, and the build
installs them from there (``PIP_FIND_LINKS``, ``PIP_NO_INDEX``; the sandbox has no network either).

Modes (``harbor.mode`` in the job's environment entry):

- ``root`` (Harbor's contract): the agent runs as the task's user, root unless ``[agent] user`` says otherwise, in the
  image's WORKDIR. It can rewrite what test.sh later runs; an audit found 16% of terminal tasks gameable that way.
- ``hardened`` (for RL): a non-root ``sandbox`` user is added (uid 1000, with useradd's full path, so an ``ENV PATH``
  without /usr/sbin does not matter) and given the WORKDIR but not the Python environments in it (``GIVE_WORKDIR``);
  the agent runs as it. Tasks that need root break: the
  check command reports them.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

# image pattern (registry and digest stripped, "library/" dropped) -> "base" or "base+python"
DEFAULT_BASE_MAP = {
    "debian:bookworm*": "base",
    "debian:12*": "base",
    "debian:trixie*": "base",
    "debian:13*": "base",
    "debian:stable*": "base",
    "ubuntu:*": "base",
    "python:*": "base+python",
    "laude-institute/t-bench/ubuntu-*": "base",  # terminal-bench's own base images (ghcr.io)
    "laude-institute/t-bench/python-*": "base+python",
}
MODES = ("root", "hardened")
WHEELS_DIR = "sandforge-wheels"  # images.EXTRA_WHEELS: where the build context holds the downloaded wheels
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


BASE_PYTHON = "3.11"  # the python3 Debian bookworm gives a base+python mapping


def what_differs(ref: str, target: str) -> str:
    """The clause a mapping's note ends with: what the task gets that differs from the image it named (a minimal
    Debian userland; Debian's Python where another version was named)."""
    name = short_name(ref)
    said = "; Debian bookworm's minimal userland (no procps, curl or ca-certificates unless the Dockerfile installs them)"
    version = re.match(r"(?:.*/)?python:(3\.\d+)", name)
    if target == "base+python" and version and version.group(1) != BASE_PYTHON:
        said += f", and Python {BASE_PYTHON}, not the {version.group(1)} the image names"
    return said


def with_defaults(base_map: dict[str, str] | None) -> dict[str, str]:
    """The job's ``sandbox.base_map`` added to ``DEFAULT_BASE_MAP``: its own patterns first (the first that matches
    wins), so mapping one more image keeps every default mapping."""
    return {**(base_map or {}), **{k: v for k, v in DEFAULT_BASE_MAP.items() if k not in (base_map or {})}}


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


# Hardened mode gives the agent the image's WORKDIR (run from it: RUN starts there), except the Python environments in it
# (a folder with a pyvenv.cfg: test.sh runs their interpreters as root). Those stay root's, and so does every folder
# from one up to the WORKDIR, made sticky and world-writable: the agent can still add files anywhere, and change or
# remove its own, but cannot rename, replace or write into a venv. An image without a WORKDIR of its own ("/") gives
# the agent nothing: it would otherwise own /usr and /etc.
GIVE_WORKDIR = (
    f'w=$(pwd -P); [ "$w" = / ] && exit 0; chown -R {AGENT_USER}: "$w" && '
    'find "$w" -xdev -type f -name pyvenv.cfg | while IFS= read -r f; do v=${f%/pyvenv.cfg}; chown -R root: "$v"; '
    'd=$v; while [ "$d" != "$w" ]; do d=${d%/*}; chown root: "$d" && chmod 1777 "$d"; done; done')


def rewrite(text: str, task: str, base_tag: str, present, base_map: dict[str, str] | None = None,
            mode: str = "root", wheels: bool = False) -> Rewrite:
    """``text`` with every FROM image that is not ``present(ref)`` mapped to ``base_tag``, and in ``hardened`` mode the
    agent user added. ``wheels``: a mapped stage installs pip packages from the context's wheelhouse. Raises
    BaseImageError for an image neither present nor mapped."""
    if mode not in MODES:
        raise ValueError(f"harbor mode {mode!r}: expected one of {', '.join(MODES)}")
    base_map = with_defaults(base_map)
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
                name = short_name(ref).split(":")[0]
                guess = "base+python" if "python" in name.lower() else "base"
                raise BaseImageError(f"{task}: base image {ref} is not on this host, cannot be pulled, and "
                                     f"sandbox.base_map maps nothing to it (map it in the job's sandbox section, "
                                     f"or `sandforge harbor check --set 'sandbox.base_map={{\"{name}:*\": {guess}}}'`; "
                                     "base+python adds Debian's python3; the map adds to the default one)")
            notes.append(f"{task}: FROM {ref} is not here; built on {base_tag} instead (sandbox.base_map: "
                         f"{short_name(ref)} -> {target}){what_differs(ref, target)}")
            out.append(f"{head}{base_tag}{rest}")
            if wheels:
                out.append(f"COPY {WHEELS_DIR}/ /opt/{WHEELS_DIR}/")
                out.append(f"ENV PIP_FIND_LINKS=/opt/{WHEELS_DIR} PIP_NO_INDEX=1")
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
                f"sh -c {shlex.quote(GIVE_WORKDIR)}"]
    return Rewrite("\n".join(out) + "\n", notes, final_workdir(out))



@dataclass
class HarborBuild:
    """How a Harbor task's image is built here (images.py ``BuildContext.prepare``): its Dockerfile rewritten against
    what the daemon has or can pull, and the job's ``sandbox.base_map`` (None: ``DEFAULT_BASE_MAP``)."""

    task: str
    dockerfile: str | None  # path of the task's environment/Dockerfile; None: a task that names only its image
    mode: str = "root"
    base_map: dict[str, str] | None = None
    notes: list[str] = field(default_factory=list)  # the last build's lines about mapped bases
    image: str | None = None  # [environment] docker_image, built FROM as it is when there is no Dockerfile

    def __call__(self, client, base_tag: str):
        from sandforge.sandbox.images import download_wheels, image_present

        text = open(self.dockerfile).read() if self.dockerfile else f"FROM {self.image}\n"
        present = {}  # ref -> bool: each FROM is looked up (or pulled) once

        def here(ref: str) -> bool:
            if ref not in present:
                present[ref] = image_present(client, ref)
            return present[ref]

        done = rewrite(text, self.task, base_tag, here, self.base_map, self.mode)
        pins = pip_requirements(text) + requirement_files(Path(self.dockerfile).parent if self.dockerfile else None)
        wheels = None
        if done.notes and pins:  # a mapped base: its pip installs come from wheels fetched here
            done = rewrite(text, self.task, base_tag, here, self.base_map, self.mode, wheels=True)
            wheels = download_wheels("\n".join(pins) + "\n", f"{self.task}'s RUN pip install lines")
            done.notes.append(f"{self.task}: {len(pins)} pinned pip package(s) of its Dockerfile downloaded here as "
                              f"wheels for the build ({', '.join(pins[:4])}{', ...' if len(pins) > 4 else ''})")
        done.notes += piped_fetches(text, self.task)
        self.notes = done.notes
        return done.dockerfile, done.notes, wheels


_RUN = re.compile(r"^\s*RUN\s+(.*)$", re.I | re.S)
_PIP = re.compile(r"(?:^|\s)(?:\S*/)?(?:python3?(?:\.\d+)?\s+-m\s+)?(?:uv\s+)?pip3?(?:\.\d+)?\s+install\s+(.*)$",
                  re.S)
_SPEC = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?(\s*[<>=!~]=?\s*[A-Za-z0-9.*+!_-]+"
                   r"(\s*,\s*[<>=!~]=?\s*[A-Za-z0-9.*+!_-]+)*)?$")
_VALUED = {"-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
           "-t", "--target", "--prefix", "--root", "--platform", "--python-version", "--implementation", "--abi",
           "--src", "--upgrade-strategy", "--progress-bar", "--cache-dir", "--python"}


def requirement_files(folder: Path | None) -> list[str]:
    """The requirements in the build context's requirements files (``requirements*.txt``, ``*.lock``, which RUN lines
    install with ``pip install -r`` after a COPY), once each, without their hashes: those are the build's to check."""
    if folder is None or not folder.is_dir():
        return []
    lines: list[str] = []
    for f in sorted([*folder.glob("requirements*.txt"), *folder.glob("*requirements*.lock")]):
        text = f.read_text(errors="replace").replace("\\\r\n", " ").replace("\\\n", " ").replace("\r", "")
        for line in text.splitlines():
            spec = line.split(" --", 1)[0].split("#", 1)[0].strip()  # hashes are checked by the build's own pip
            if spec and not spec.startswith("-") and spec not in lines:
                lines.append(spec)
    return lines


def run_commands(text: str) -> list[str]:
    """The Dockerfile's ``RUN`` commands, each with its continuation lines joined, in order."""
    runs, current = [], None
    for line in text.splitlines():
        if current is None:
            m = _RUN.match(line)
            if not m:
                continue
            current = m.group(1)
        else:
            current += " " + line.strip()
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1]
            continue
        runs.append(current)
        current = None
    return runs


_PIPED_FETCH = re.compile(r"\b(curl|wget)\b[^|;&]*\|\s*(?:sudo\s+(?:-\S+\s+)*)?(?:env\s+\S+=\S*\s+)*"
                          r"(?:/usr)?(?:/bin/)?(sh|bash|dash|zsh)\b")


def piped_fetches(text: str, task: str) -> list[str]:
    """A note per ``RUN`` that pipes a download into a shell (``curl -fsSL URL | sh``): builds here have no network,
    and a pipeline's status is its last command's, so such a line "succeeds" with nothing fetched and the image lacks
    what it meant to install."""
    notes = []
    for run in run_commands(text):
        m = _PIPED_FETCH.search(run)
        if m and "pipefail" not in run[: m.start()]:
            shown = run[m.start(): m.end()]
            notes.append(f"{task}: RUN pipes a download into a shell ({shown[:60]}{'...' if len(shown) > 60 else ''}"
                         f"): builds here have no network, so it installs nothing and the build goes on without it")
    return notes


def pip_requirements(text: str) -> list[str]:
    """The requirement specs (``pytest==8.4.1``, ``pandas>=2``) that the Dockerfile's ``RUN`` lines pip-install, in
    order, once each; requirement files, paths and URLs are left to the build."""
    found: list[str] = []
    for run in run_commands(text):
        for command in re.split(r"&&|\|\||;", run):
            m = _PIP.search(command)
            if not m:
                continue
            try:
                words = shlex.split(m.group(1))
            except ValueError:
                continue
            skip = False
            for word in words:
                if skip:
                    skip = False
                elif word in _VALUED:
                    skip = True
                elif not word.startswith("-") and _SPEC.match(word) and word not in found:
                    found.append(word)
    return found

