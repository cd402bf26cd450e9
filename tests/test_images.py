"""The image pipeline's wheelhouse: an env's requirements.txt becomes wheels fetched on the host, installed in the image
without an index; the image hash follows requirements.txt, never the downloaded files. A harness image's
npm-packages.txt is fetched the same way."""

from __future__ import annotations

import shutil
import tarfile
import uuid
from pathlib import Path

import pytest

from sandforge.sandbox import images
from sandforge.sandbox.labels import LABEL_RUN
from containers import image_for

DOCKERFILE = """\
ARG BASE=sandforge/base:bookworm
FROM ${BASE}
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-pip \\
 && rm -rf /var/lib/apt/lists/*
COPY wheels/ /wheels/
COPY requirements.txt /wheels/requirements.txt
RUN pip install --no-index --find-links /wheels --break-system-packages -r /wheels/requirements.txt
"""


def make_env(envs_dir: Path, name: str = "wheeltest", requirements: str = "six==1.16.0\n") -> Path:
    ctx = envs_dir / name
    ctx.mkdir(parents=True)
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (ctx / "requirements.txt").write_text(requirements)
    (ctx / "env.py").write_text("# driver-side code: not part of the image\n")
    return ctx


# --- no Docker ----------------------------------------------------------------------------------------------------


def test_context_holds_requirements_but_never_a_wheels_folder(tmp_path):
    ctx = make_env(tmp_path)
    (ctx / "wheels").mkdir()
    (ctx / "wheels" / "stale-1.0-py3-none-any.whl").write_bytes(b"old download")
    assert [p.relative_to(ctx).as_posix() for p in images._context_files(ctx)] == ["Dockerfile", "requirements.txt"]

    # requirements.txt decides the wheels, so it counts even when no COPY names it
    (ctx / "Dockerfile").write_text(DOCKERFILE.replace("COPY requirements.txt /wheels/requirements.txt\n", ""))
    assert [p.relative_to(ctx).as_posix() for p in images._context_files(ctx)] == ["Dockerfile", "requirements.txt"]

    # without requirements.txt there is no wheelhouse, and COPY wheels/ must find a real folder
    (ctx / "requirements.txt").unlink()
    assert images.wheelhouse(ctx) is None
    assert [p.relative_to(ctx).as_posix() for p in images._context_files(ctx)] == [
        "Dockerfile",
        "wheels/stale-1.0-py3-none-any.whl",
    ]


def test_build_context_carries_the_wheelhouse_as_wheels(tmp_path):
    ctx = make_env(tmp_path / "envs")
    wheels = tmp_path / "cache"
    wheels.mkdir()
    (wheels / "six-1.16.0-py2.py3-none-any.whl").write_bytes(b"a wheel")
    with tarfile.open(fileobj=images._context_tar(ctx, wheels)) as tar:
        names = tar.getnames()
        assert tar.extractfile("wheels/six-1.16.0-py2.py3-none-any.whl").read() == b"a wheel"
    assert names == ["Dockerfile", "requirements.txt", "wheels", "wheels/six-1.16.0-py2.py3-none-any.whl"]


def test_npm_packages_are_a_listed_input_and_the_context_carries_them_as_npm(tmp_path, monkeypatch):
    """A harness image's npm-packages.txt: the list counts toward the image's hash, an ``npm/`` folder beside it never
    does, and the build context carries the cached install's node_modules as ``npm/node_modules``."""
    ctx = tmp_path / "harness"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("ARG BASE\nFROM ${BASE}\nCOPY npm/node_modules/cli/bin/cli /opt/cli\n")
    (ctx / "npm-packages.txt").write_text("# pinned\ncli@1.2.3\n")
    (ctx / "npm").mkdir()
    (ctx / "npm" / "stale").write_text("an old install")
    assert [p.relative_to(ctx).as_posix() for p in images._context_files(ctx)] == ["Dockerfile", "npm-packages.txt"]

    installs: list[list[str]] = []

    def fake_npm(cmd, progress):  # npm install --prefix DIR SPECS, as the registry would answer it
        installs.append(cmd)
        binary = Path(cmd[cmd.index("--prefix") + 1]) / "node_modules" / "cli" / "bin" / "cli"
        binary.parent.mkdir(parents=True)
        binary.write_bytes(b"\x7fELF a binary")

    monkeypatch.setenv("SANDFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(images, "_run_streaming", fake_npm)
    monkeypatch.setattr(images.shutil, "which", lambda name: f"/usr/bin/{name}")
    folder = images.npm_packages(ctx)
    assert images.npm_packages(ctx) == folder and len(installs) == 1  # cached by the list
    assert installs[0][-1] == "cli@1.2.3" and "--ignore-scripts" in installs[0]  # nothing of theirs runs here
    with tarfile.open(fileobj=images._context_tar(ctx, npm=folder)) as tar:
        assert tar.extractfile("npm/node_modules/cli/bin/cli").read() == b"\x7fELF a binary"
        assert "npm/stale" not in tar.getnames()
    monkeypatch.setattr(images.shutil, "which", lambda name: None)
    (ctx / "npm-packages.txt").write_text("cli@2.0.0\n")
    with pytest.raises(images.ImageError, match="npm is not installed"):
        images.npm_packages(ctx)


def test_env_folders_outside_the_package_are_found(tmp_path):
    make_env(tmp_path, "alpha")
    make_env(tmp_path, "beta")
    assert images.available_envs(tmp_path) == ["alpha", "beta"]
    assert images.env_build_context("beta", tmp_path) == tmp_path / "beta"
    with pytest.raises(images.ImageError, match="envs with images: alpha, beta"):
        images.env_build_context("gamma", tmp_path)


# --- Docker -------------------------------------------------------------------------------------------------------


@pytest.mark.docker
def test_image_tag_follows_requirements_not_downloaded_wheels(tmp_path, terminal_image, docker_client):
    ctx = make_env(tmp_path)

    def tag() -> str:
        return images.env_image_tag("wheeltest", images.BASE_TAG, docker_client, envs_dir=tmp_path)

    before = tag()
    (ctx / "wheels").mkdir()
    (ctx / "wheels" / "six-1.16.0-py2.py3-none-any.whl").write_bytes(b"downloaded again, different bytes")
    (ctx / "env.py").write_text("# edited\n")
    assert tag() == before
    (ctx / "requirements.txt").write_text("six==1.15.0\n")
    assert tag() != before
    with pytest.raises(images.ImageError, match="not built"):
        image_for("wheeltest", docker_client, envs_dir=tmp_path)


@pytest.mark.docker
@pytest.mark.slow
def test_requirements_install_from_the_wheelhouse_without_an_index(
    tmp_path, monkeypatch, terminal_image, docker_client, run_id
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SANDFORGE_CACHE", str(cache))
    name = f"wheeltest{uuid.uuid4().hex[:8]}"  # a tag of its own, removed at the end
    make_env(tmp_path / "envs", name)
    tag = None
    try:
        tag = images.build_images([name], client=docker_client, show_progress=False, envs_dir=tmp_path / "envs")[name]
        (house,) = (cache / "wheelhouse").iterdir()
        assert [p.name for p in house.iterdir()] == ["six-1.16.0-py2.py3-none-any.whl"]
        out = docker_client.containers.run(
            tag,
            ["python3", "-c", "import six; print(six.__version__, six.__file__)"],
            remove=True,
            network_mode="none",
            labels={LABEL_RUN: run_id},
        )
        version, path = out.decode().split()
        assert version == "1.16.0" and path.startswith("/usr/local/lib/python3.11/")
        assert image_for(name, docker_client, envs_dir=tmp_path / "envs") == tag

        # Unchanged sources: the image is up to date, so nothing is downloaded again
        shutil.rmtree(cache)
        assert images.build_images([name], client=docker_client, show_progress=False, envs_dir=tmp_path / "envs") == {
            name: tag
        }
        assert not cache.exists()
    finally:
        if tag is not None:
            docker_client.images.remove(tag, force=True)
