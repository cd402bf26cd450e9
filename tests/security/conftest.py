"""Fixtures of the attack tests: the repo image (python3 and git) for attacks on graders that run them."""

from __future__ import annotations

import pytest

from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.sandbox.images import build_images


@pytest.fixture(scope="session")
def repo_spec(docker_client) -> SandboxSpec:
    return SandboxSpec(image=build_images(["repo"], client=docker_client, show_progress=False)["repo"])
