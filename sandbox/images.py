"""Sandbox images built locally, without a registry.

Two layers: a Debian base (pulled when a registry answers, otherwise bootstrapped with ``debootstrap`` and ``docker
import``-ed as ``sandforge/base:bookworm``), and the environments' images built from ``environments/<name>/Dockerfile``
on top of it: one per env, except the mock apps (slack, notion), which share ``apps``. An env image is tagged with a
hash of what it is built from (its Dockerfile, the files its COPY/ADD lines name, and the base image id), so unchanged
sources never rebuild and a changed source can never reuse a stale image.

Python packages inside an image come from a wheelhouse, because pip inside ``docker build`` cannot verify TLS on these
machines (apt over http works). An env folder that holds ``requirements.txt`` gets one: the host runs ``pip download
--only-binary=:all:`` for the image's Python (Debian bookworm: CPython 3.11, manylinux x86_64; pure-Python wheels fit
any) into a cache keyed by the requirements, and the build context carries the wheels as ``wheels/``. The image hash
covers ``requirements.txt``, not the downloaded files, so a re-download never rebuilds an image. The env's Dockerfile
installs from the wheelhouse without an index::

    RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip
    COPY wheels/ /wheels/
    COPY requirements.txt /wheels/requirements.txt
    RUN pip install --no-index --find-links /wheels --break-system-packages -r /wheels/requirements.txt

(``--break-system-packages``: bookworm marks its Python as externally managed; a venv in the image works as well.)
A folder that holds ``npm-packages.txt`` (package specs, one a line, pinned) gets the npm registry's packages the same
way: the host runs ``npm install --ignore-scripts`` into a cache keyed by the list, and the context carries them as
``npm/node_modules/`` (an agent harness's native CLI binary, copied into its image from there).
Env folders live under ``environments/`` by default; ``envs_dir`` points the pipeline at another folder (a plugin's).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shlex
import shutil
import sys
import tarfile
import tempfile
import time
from collections import deque
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator

import docker
import docker.errors

from sandforge.sandbox.base_image import (  # noqa: F401 - ImageError, BASE_TAG, ...: public here too
    BASE_TAG,
    DEFAULT_MIRROR,
    ImageError,
    Progress,
    image_id,
    _noop,
    _run_streaming,
    ensure_base_image,
)
from sandforge.sandbox.daemon import docker_client
from sandforge.registry import SHARED_IMAGES

ENVIRONMENTS_DIR = Path(__file__).resolve().parents[1] / "environments"  # the built-in envs' folder, beside this one
_LOCK_PATH = Path(tempfile.gettempdir()) / "sandforge-images.lock"
REQUIREMENTS = "requirements.txt"
WHEELS = "wheels"  # the wheelhouse's folder in the build context
EXTRA_WHEELS = "sandforge-wheels"  # a BuildContext's own wheelhouse (a Harbor task's pinned pip installs)
NPM_PACKAGES = "npm-packages.txt"
NPM = "npm"  # the npm packages' folder in the build context (``npm/node_modules/...``)
# The interpreter wheels are fetched for: the python3 of the Debian release the base is bootstrapped from (bookworm:
# CPython 3.11, glibc 2.36). pip does not widen manylinux_2_X to older glibcs itself, so every one is named; it does
# widen manylinux2014 to manylinux2010 and manylinux1. Pure-Python wheels fit any platform.
WHEEL_PYTHON = "3.11"
WHEEL_PLATFORMS = tuple(f"manylinux_2_{v}_x86_64" for v in range(36, 16, -1)) + ("manylinux2014_x86_64",)

@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    # Several test workers or drivers may ask for the same image at once: build it once.
    with open(_LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- environment images -----------------------------------------------------------------------------------------


def env_build_context(env_name: str, envs_dir: Path | None = None) -> Path:
    """The folder ``<envs_dir>/<env_name>/`` (default: ``environments/<env_name>/``) that holds the env's Dockerfile."""
    ctx = Path(envs_dir or ENVIRONMENTS_DIR) / env_name
    if not (ctx / "Dockerfile").is_file():
        known = ", ".join(available_envs(envs_dir)) or "none"
        raise ImageError(f"no Dockerfile for env '{env_name}' at {ctx / 'Dockerfile'} (envs with images: {known})")
    return ctx


def available_envs(envs_dir: Path | None = None) -> list[str]:
    """Every folder under ``envs_dir`` (default: environments/) that holds a Dockerfile: the images there are."""
    return sorted(p.parent.name for p in Path(envs_dir or ENVIRONMENTS_DIR).glob("*/Dockerfile"))


def image_name(env_name: str, envs_dir: Path | None = None) -> str:
    """The image ``env_name`` runs in: its own folder's, or for slack and notion the shared ``apps``."""
    return env_name if envs_dir is not None else SHARED_IMAGES.get(env_name, env_name)


def _copy_sources(dockerfile: str) -> Iterator[str]:
    """Source patterns of the Dockerfile's COPY/ADD instructions (those reading the build context)."""
    logical, buf = [], ""
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    for line in logical:
        instr, _, rest = line.partition(" ")
        if instr.upper() not in ("COPY", "ADD"):
            continue
        rest = rest.strip()
        flags = []
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        if any(f.startswith("--from") for f in flags):
            continue  # copies from another stage or image, not from the context
        args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
        yield from args[:-1]


def _context_files(ctx: Path) -> list[Path]:
    """What an env image is built from: its Dockerfile plus the files COPY/ADD take from the folder.

    The folder also holds the env's Python code, which runs on the driver, not in the image; leaving it out keeps an
    edit to env.py from rebuilding the image. With a requirements.txt, it counts whether COPY names it or not (it
    decides the wheelhouse), and ``wheels/`` is the generated wheelhouse, never a source.
    """
    if not (ctx / "Dockerfile").is_file():
        return []  # a Dockerfile given as text, with nothing to copy (a Harbor task that names only its image)
    files = {ctx / "Dockerfile"}
    has_wheelhouse = (ctx / REQUIREMENTS).is_file()
    has_npm = (ctx / NPM_PACKAGES).is_file()
    files.update(f for f, has in ((ctx / REQUIREMENTS, has_wheelhouse), (ctx / NPM_PACKAGES, has_npm)) if has)
    for pattern in _copy_sources((ctx / "Dockerfile").read_text()):
        if "://" in pattern:
            continue  # ADD <url>: not part of the context
        top = Path(pattern.lstrip("/")).parts[:1]
        if (has_wheelhouse and top == (WHEELS,)) or (has_npm and top == (NPM,)):
            continue
        matches = [ctx] if pattern.strip("/") in ("", ".") else sorted(ctx.glob(pattern.lstrip("/")))
        if not matches:
            raise ImageError(f"{ctx / 'Dockerfile'}: COPY/ADD source '{pattern}' matches nothing in {ctx}")
        for m in matches:
            files.update([m] if m.is_file() else (p for p in m.rglob("*") if p.is_file()))
    generated = [ctx / folder for folder, has in ((WHEELS, has_wheelhouse), (NPM, has_npm)) if has]
    return sorted(
        f
        for f in files
        if "__pycache__" not in f.parts and f.suffix != ".pyc" and not any(f.is_relative_to(g) for g in generated)
    )


def wheelhouse(ctx: Path, progress: Progress | None = None) -> Path | None:
    """The wheels ``ctx/requirements.txt`` needs, downloaded once into a cache; None without a requirements.txt."""
    req = ctx / REQUIREMENTS
    return download_wheels(req.read_text(), str(req), progress) if req.is_file() else None


def npm_packages(ctx: Path, progress: Progress | None = None) -> Path | None:
    """The npm packages ``ctx/npm-packages.txt`` names, installed once into a cache (``npm install --ignore-scripts``:
    nothing of theirs runs on the host); the folder holding their ``node_modules``, or None without the file."""
    listed = ctx / NPM_PACKAGES
    if not listed.is_file():
        return None
    progress = progress or _noop
    specs = [line.strip() for line in listed.read_text().splitlines() if line.strip() and not line.startswith("#")]
    key = hashlib.sha256("\n".join(specs).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SANDFORGE_CACHE") or Path.home() / ".cache" / "sandforge") / "npm"
    dest = cache / key
    if dest.is_dir():
        return dest
    npm = shutil.which("npm")
    if npm is None:
        raise ImageError(f"{listed}: the image needs npm packages ({', '.join(specs)}), and npm is not installed on "
                         "this machine to fetch them (apt-get install -y npm)")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))
    tmp.chmod(0o755)
    try:
        progress(f"installing npm packages for {listed}")
        _run_streaming([npm, "install", "--ignore-scripts", "--no-audit", "--no-fund", "--no-save", "--prefix",
                        str(tmp), *specs], progress)
    except ImageError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImageError(f"could not fetch the npm packages {listed} names\n{e}") from e
    try:
        tmp.rename(dest)
    except OSError:  # another process finished the same packages first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def download_wheels(requirements: str, source: str, progress: Progress | None = None) -> Path:
    """The wheels ``requirements`` (a requirements file's text) need for the images' Python, downloaded on the host
    once into a cache (images cannot reach a package index here). The cache key is the requirements' text plus the
    target Python and platform, so a second build (or an unchanged image) never touches the network."""
    progress = progress or _noop
    key = hashlib.sha256(f"{WHEEL_PYTHON}\0{WHEEL_PLATFORMS}\0".encode() + requirements.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SANDFORGE_CACHE") or Path.home() / ".cache" / "sandforge") / "wheelhouse"
    dest = cache / key
    if dest.is_dir():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=cache))  # renamed into place only when complete
    tmp.chmod(0o755)  # mkdtemp's 0700 would follow the wheels into the image
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:"]
    cmd += ["--python-version", WHEEL_PYTHON, "--implementation", "cp"]
    cmd += [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
    req = tmp / "requirements.txt"
    req.write_text(requirements)
    cmd += ["--dest", str(tmp), "-r", str(req)]
    try:
        progress(f"downloading wheels for {source}")
        _run_streaming(cmd, progress)
        req.unlink()
    except ImageError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImageError(
            f"could not build the wheelhouse for {source}: every requirement needs a wheel for CPython {WHEEL_PYTHON} "
            f"on manylinux x86_64 (glibc <= 2.36) or a pure-Python one (sdists are not built for images)\n{e}"
        ) from e
    try:
        tmp.rename(dest)
    except OSError:  # another process finished the same wheelhouse first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def env_image_tag(env_name: str, base_tag: str, client: docker.DockerClient, envs_dir: Path | None = None) -> str:
    """``sandforge/<env>:<12 hex>``, the hash of the build inputs and the base image id."""
    return context_image_tag(env_build_context(env_name, envs_dir), env_name, base_tag, client)


@dataclass(frozen=True)
class BuildContext:
    """A folder to build an image from. ``prepare(client, base_tag)``, when given, returns the Dockerfile to build
    instead of the folder's own, the lines to say about it and a wheelhouse to add to the context (a Harbor task's:
    its base image mapped, its pinned pip installs downloaded); ``user`` is the user the image must have (None: any, as
    for a task whose agent is root)."""

    folder: Path
    prepare: Callable[[docker.DockerClient, str], tuple[str, list[str], Path | None]] | None = None
    user: str | None = "sandbox"


def context_image_tag(ctx: Path, name: str, base_tag: str, client: docker.DockerClient,
                      dockerfile: str | None = None) -> str:
    """``sandforge/<name>:<12 hex>`` for the Dockerfile in any folder ``ctx`` (an env's, a Harbor task's
    ``environment/``), or ``dockerfile`` built in that folder instead: the hash of its build inputs and the base image
    id."""
    if dockerfile is None and not (ctx / "Dockerfile").is_file():
        raise ImageError(f"no Dockerfile at {ctx / 'Dockerfile'}")
    base_id = image_id(client, base_tag)
    if base_id is None:
        raise ImageError(f"base image {base_tag} is not present: run `sandforge images build`")
    h = hashlib.sha256(base_id.encode())
    if dockerfile is not None:
        h.update(b"\0dockerfile\0" + dockerfile.encode())
    for f in _context_files(ctx):
        h.update(b"\0" + f.relative_to(ctx).as_posix().encode() + b"\0" + str(f.stat().st_mode & 0o111).encode())
        h.update(b"\0" + f.read_bytes())
    return f"sandforge/{name}:{h.hexdigest()[:12]}"


def _context_tar(ctx: Path, wheels: Path | None = None, dockerfile: str | None = None,
                 extra_wheels: Path | None = None, npm: Path | None = None) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in _context_files(ctx):
            if dockerfile is not None and f == ctx / "Dockerfile":
                continue
            tar.add(f, arcname=f.relative_to(ctx).as_posix(), recursive=False)
        if dockerfile is not None:
            data = dockerfile.encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for folder, arcname in ((wheels, WHEELS), (extra_wheels, EXTRA_WHEELS)):
            if folder is not None:
                tar.add(folder, arcname=arcname, recursive=False)
                for f in sorted(folder.iterdir()):
                    tar.add(f, arcname=f"{arcname}/{f.name}", recursive=False)
        if npm is not None:
            tar.add(npm / "node_modules", arcname=f"{NPM}/node_modules")
    buf.seek(0)
    return buf


def build_env_image(
    client: docker.DockerClient,
    env_name: str,
    base_tag: str,
    progress: Progress | None = None,
    envs_dir: Path | None = None,
) -> str:
    """Build ``<envs_dir>/<env_name>/Dockerfile`` on ``base_tag`` (build arg BASE); a no-op if the tag exists."""
    return build_context_image(client, env_build_context(env_name, envs_dir), env_name, base_tag, progress)


def build_context_image(
    client: docker.DockerClient,
    ctx: Path,
    name: str,
    base_tag: str,
    progress: Progress | None = None,
    dockerfile: str | None = None,
    extra_wheels: Path | None = None,
) -> str:
    """Build ``ctx/Dockerfile`` (or ``dockerfile`` in ``ctx``) on ``base_tag`` (build arg BASE) as
    ``sandforge/<name>:<hash>``; a no-op if the tag exists. ``name`` must be a valid image repository name (lowercase
    letters, digits, ``.-_/``). ``extra_wheels``: a wheelhouse the build context gets as ``EXTRA_WHEELS/`` (a Harbor
    task's pinned pip installs)."""
    progress = progress or _noop
    key = dockerfile if extra_wheels is None else f"{dockerfile}\0{extra_wheels.name}"
    tag = context_image_tag(ctx, name, base_tag, client, key)
    if image_id(client, tag):
        return tag
    tail: deque[str] = deque(maxlen=30)
    stream = client.api.build(
        fileobj=_context_tar(ctx, wheelhouse(ctx, progress), dockerfile, extra_wheels, npm_packages(ctx, progress)),
        custom_context=True,
        tag=tag,
        buildargs={"BASE": base_tag},
        labels={"sandforge.env": name},
        rm=True,
        forcerm=True,
        pull=False,
        decode=True,
        timeout=1800,
    )
    for chunk in stream:
        if "error" in chunk:
            raise ImageError(
                f"building the '{name}' image from {ctx / 'Dockerfile'} failed: {chunk['error'].strip()}\n"
                + "".join(tail)
            )
        text = chunk.get("stream", "")
        if text.strip():
            tail.append(text if text.endswith("\n") else text + "\n")
            progress(text.strip())
    if not image_id(client, tag):
        raise ImageError(f"docker build of '{name}' ended without producing {tag}:\n" + "".join(tail))
    return tag


def layered_images(client: docker.DockerClient, images: dict[str, str], folder: Path, layer: str,
                   skip: tuple[str, ...] = ("base",), progress: Progress | None = None) -> dict[str, str]:
    """``images`` (name -> tag) with ``folder``'s Dockerfile built on each (build arg BASE: the image's tag), as
    ``sandforge/<name>-<layer>``: an agent harness installed in every image a job's tasks run in. ``skip``: names kept
    as they are."""
    return {name: tag if name in skip else build_context_image(client, folder, f"{name}-{layer}", tag, progress)
            for name, tag in images.items()}


def require_sandbox_user(client: docker.DockerClient, tag: str, dockerfile: Path, user: str = "sandbox") -> None:
    """Fail the build, not every episode, when an image lacks the non-root user the policy runs as."""
    from sandforge.sandbox.spec import _ids_of
    from sandforge.types import SandboxError

    try:
        _ids_of(client, tag, user)
    except SandboxError:
        raise ImageError(
            f"{dockerfile}: the image has no '{user}' user. sandforge runs the policy as a non-root '{user}' user in "
            f"/workspace; add: RUN useradd --uid 1000 --create-home --shell /bin/bash {user} && install -d -o {user} "
            f"-g {user} /workspace"
        ) from None


def build_images(
    envs: list[str] | None = None,
    base_image: str | None = None,
    client: docker.DockerClient | None = None,
    show_progress: bool = True,
    envs_dir: Path | None = None,
    mirror: str = DEFAULT_MIRROR,
    contexts: dict[str, Path | BuildContext] | None = None,
) -> dict[str, str]:
    """Ensure the base image and build the images of the requested envs (default: all); returns image name -> tag
    (slack's and notion's come back as ``apps``).

    ``envs_dir`` is the folder holding the env folders (default: the installed ``environments/``). ``contexts`` adds
    images built from other folders (image name -> folder with a Dockerfile: a plugin's, a Harbor task's
    ``environment/``); their tags come back under those names.
    """
    from rich.console import Console

    client = client or docker_client()
    envs = available_envs(envs_dir) if envs is None else list(dict.fromkeys(image_name(e, envs_dir) for e in envs))
    for env in envs:
        env_build_context(env, envs_dir)  # fail on a typo before bootstrapping anything
    console = Console(stderr=True, quiet=not show_progress)
    tags: dict[str, str] = {}
    with _build_lock(), console.status("images") as status:

        def stage(name: str) -> Progress:
            return lambda msg: status.update(f"[bold]{name}[/bold] {msg[-120:]}")

        t0 = time.perf_counter()
        fresh: list[str] = []  # images found up to date: one line for all of them at the end

        def report(name: str, existed: bool, took: float) -> None:
            if existed:
                fresh.append(name)
            else:
                console.print(f"image {name} {tags.get(name, base)}: built ({took:.1f}s)", highlight=False)

        had_base = image_id(client, base_image or BASE_TAG) is not None
        base = ensure_base_image(client, base_image, mirror=mirror, progress=stage("base"))
        report("base", had_base, time.perf_counter() - t0)
        for env in envs:
            t0 = time.perf_counter()
            existed = image_id(client, env_image_tag(env, base, client, envs_dir)) is not None
            tags[env] = build_env_image(client, env, base, progress=stage(env), envs_dir=envs_dir)
            report(env, existed, time.perf_counter() - t0)
        for name, ctx in (contexts or {}).items():
            t0 = time.perf_counter()
            ctx = ctx if isinstance(ctx, BuildContext) else BuildContext(Path(ctx))
            dockerfile, notes, wheels = ctx.prepare(client, base) if ctx.prepare else (None, [], None)
            for note in notes:
                console.print(note, highlight=False, markup=False, soft_wrap=True)
            key = dockerfile if wheels is None else f"{dockerfile}\0{wheels.name}"
            existed = image_id(client, context_image_tag(ctx.folder, name, base, client, key)) is not None
            tags[name] = build_context_image(client, ctx.folder, name, base, progress=stage(name), dockerfile=dockerfile,
                                             extra_wheels=wheels)
            if ctx.user:
                require_sandbox_user(client, tags[name], ctx.folder / "Dockerfile", ctx.user)
            report(name, existed, time.perf_counter() - t0)
        if fresh:
            console.print(f"images up to date: {', '.join(fresh)}", highlight=False)
    return tags


def context_image(name: str, context: Path | BuildContext, base_image: str | None = None, mirror: str | None = None,
                  client: docker.DockerClient | None = None) -> str:
    """The tag of image ``name`` built from ``context``: found if up to date, else built (with progress on stderr).
    A ``BuildContext`` (a Harbor task's: its Dockerfile rewritten for this host) is always passed to the builder, which
    finds it up to date itself."""
    client = client or docker_client()
    if isinstance(context, BuildContext):
        return build_images([], base_image=base_image, client=client, mirror=mirror, contexts={name: context},
                            show_progress=False)[name]
    try:
        tag = context_image_tag(context, name, base_image or BASE_TAG, client)
        client.images.get(tag)
        return tag
    except (ImageError, docker.errors.ImageNotFound):
        pass
    return build_images([], base_image=base_image, client=client, mirror=mirror, contexts={name: context})[name]


def image_present(client: docker.DockerClient, ref: str) -> bool:
    """The daemon has ``ref``, or pulls it now (no registry answering is the usual case here, and fails fast)."""
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
