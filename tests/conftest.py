"""Shared fixtures. Tests that start containers take ``docker_client`` (skipped when no daemon answers) and are
marked ``@pytest.mark.docker``; the terminal image is built once per session (a no-op when it is up to date)."""

from __future__ import annotations

import os
import uuid

import pytest

from sandforge.sandbox import daemon
from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.images import build_images
from sandforge.sandbox.lifecycle import remove_run_containers
from sandforge.types import SandboxError

# task folders' own tests (a Harbor task's tests/test_outputs.py) run inside their sandboxes, never here
collect_ignore_glob = ["data/*"]

# Auto precision (trainer.bf16 null, engine.dtype auto) is fp32 on every host the suite runs on: bf16 is picked on a CPU
# with AMX, and the suite's equivalence checks (expert parallelism, packing, LoRA merges) hold fp32 tolerances. It is
# inherited by every process a test starts (Ray workers, DeepSpeed ranks, `sandforge train`). Tests that check the
# choice itself fake the CPU's flags and clear it (tests/test_placement.py); tests of bf16 ask for it by name.
os.environ.setdefault("SANDFORGE_CPU_BF16", "0")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is fastest, and on a shared 2-core machine far faster than two.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def docker_client():
    try:
        return daemon.docker_client()
    except SandboxError as e:
        if os.environ.get("SANDFORGE_REQUIRE_DOCKER") == "1":  # scripts/test.sh: a missing daemon is a failure there
            pytest.fail(f"container tests need Docker: {e}")
        pytest.skip(f"container tests need Docker: {e}")


@pytest.fixture(scope="session")
def terminal_image(docker_client) -> str:
    """Tag of the terminal env image; bootstraps the base (~30 s) and builds the image (~5 s) the first time."""
    return build_images(["terminal"], client=docker_client, show_progress=False)["terminal"]


@pytest.fixture
def terminal_spec(terminal_image) -> SandboxSpec:
    return SandboxSpec(image=terminal_image)


@pytest.fixture
def run_id(docker_client):
    """A run id unique to the test; every container labelled with it is removed afterwards."""
    rid = f"test-{uuid.uuid4().hex[:12]}"
    yield rid
    remove_run_containers(rid, docker_client)


@pytest.fixture
def sandbox(terminal_spec, run_id, docker_client):
    with DockerSandbox.create(terminal_spec, run_id, client=docker_client) as sb:
        yield sb


ALONE = "alone"  # tests that need the host to themselves: never beside another test


def pytest_addoption(parser):
    parser.addoption("--alone", choices=("with", "skip", "only"), default="with",
                     help=f"tests marked {ALONE} (they restart the Docker daemon, or check what the host-wide reaper "
                          "did): run with the rest (default), skip them, or run only them; scripts/test.sh runs the "
                          "rest on two workers, then these alone")


def pytest_collection_modifyitems(config, items):
    how = config.getoption("alone")
    if how == "with":
        return
    keep = [item for item in items if (item.get_closest_marker(ALONE) is not None) == (how == "only")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


LEFT_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "sandforge-test-leftovers")


def pytest_sessionfinish(session, exitstatus):
    """No test may leave a sandforge container behind: fail the session if one is left (and remove it).

    Containers whose driver is another live process (a training run beside the tests) are none of our business.
    With pytest-xdist each worker removes the containers its own process left and writes their names down; the
    controller, once every worker is done, fails the session on them and on containers of drivers that died (a
    chaos test's killed run that nothing reaped).
    """
    from sandforge.sandbox.labels import LABEL_PID, LABEL_RUN, driver_alive

    try:
        client = daemon.docker_client()
    except SandboxError:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # xdist's workers are children of the controller's process
    own = str(os.getpid())
    left = [
        c for c in client.containers.list(all=True, filters={"label": LABEL_RUN}, ignore_removed=True)
        if c.labels.get(LABEL_PID) == own or worker is None and driver_alive(c.labels) is False
    ]
    names = [f"{c.name} ({c.labels.get(LABEL_RUN)})" for c in left]
    for c in left:
        c.remove(force=True, v=True)
    if worker is not None:  # the controller reports them
        if names:
            os.makedirs(LEFT_DIR, exist_ok=True)
            with open(os.path.join(LEFT_DIR, f"{os.getppid()}-{worker}"), "w") as f:
                f.write("\n".join(names))
        return
    if os.path.isdir(LEFT_DIR):
        for name in sorted(os.listdir(LEFT_DIR)):
            if name.startswith(f"{own}-"):
                path = os.path.join(LEFT_DIR, name)
                names += open(path).read().splitlines()
                os.remove(path)
    if names:
        print(f"\nsandforge containers left behind by the tests: {', '.join(names)}")
        session.exitstatus = 1
