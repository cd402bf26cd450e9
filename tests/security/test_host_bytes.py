"""Every byte from a sandbox is bounded on the host (issue #23, item 5): what the policy writes into the session
dispatcher's own stdout and stderr, to Harbor's disk, and the containers grading takes. Attacks through run_episode,
the real verifiers and real sandboxes; each asserts what the host pays, never how long it took."""

from __future__ import annotations

import asyncio
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
from agent_fakes import CHAT, limits
from seeded import terminal_task as make_task

from sandforge.sandbox.docker_sandbox import DockerSandbox
from sandforge.sandbox.pool import SandboxPool
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.rollout.agent import run_episode
from sandforge.rollout.policy_client import scripted_policy
from sandforge.types import ToolCall

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]

HOST_CAP = 8 << 20  # what one episode may make the rollout process hold, at most, whatever the policy writes
# writes N bytes into file descriptor FD of this user's session dispatcher (its exec stream to the host)
INTO_DISPATCHER = "for p in $(pgrep -u sandbox -f sandforge-shell); do head -c {n} /dev/zero > /proc/$p/fd/{fd}; done"


def episode(command: str, spec, run_id, client, **env_kw):
    task = replace(make_task("write_file", 3), solution=[ToolCall("bash", {"command": command}), ToolCall("submit")])
    env = TerminalEnv(task, spec, run_id, exec_timeout=60, client=client, **env_kw)
    return asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=4), "g"))


def peak_bytes(run) -> tuple[object, int]:
    """run()'s result and the most memory Python held during it beyond what it held before."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run()
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_the_dispatchers_stderr_is_capped_on_the_host(terminal_spec, run_id, docker_client):
    """256 MB written into the dispatcher's stderr (before: all of it buffered in the rollout process). The socket is
    still drained, the host keeps a head and a tail, the tool result says how much was dropped, the episode ends."""
    command = INTO_DISPATCHER.format(n=256 << 20, fd=2) + "; echo wrote"
    traj, peak = peak_bytes(lambda: episode(command, terminal_spec, run_id, docker_client))
    assert not traj.failed, traj.failure
    observation = traj.turns[0].observations[0]
    assert observation.startswith("wrote"), observation[:300]
    assert "bytes of shell stderr dropped]" in observation, observation[-300:]
    dropped = int(observation.split("[... ")[1].split()[0])
    assert dropped > (256 << 20) - HOST_CAP
    assert peak < HOST_CAP, f"the host held {peak >> 20} MB for one tool call"
    assert (traj.reward.value, traj.reward.success) == (0.0, False)


def test_stray_bytes_on_the_dispatchers_stdout_are_capped_on_the_host(terminal_spec, run_id, docker_client):
    """The dispatcher's stdout carries the answers; 48 MB of junk written into it before the answer was all kept
    (and searched again on every read). Now only what can be part of an answer is kept; the answer still comes."""
    command = INTO_DISPATCHER.format(n=48 << 20, fd=1) + "; echo wrote"
    traj, peak = peak_bytes(lambda: episode(command, terminal_spec, run_id, docker_client))
    assert not traj.failed, traj.failure
    observation = traj.turns[0].observations[0]
    assert observation.startswith("wrote"), observation[:300]
    assert "bytes of stray shell stdout dropped]" in observation, observation[-300:]
    assert peak < HOST_CAP, f"the host held {peak >> 20} MB for one tool call"


def test_the_repo_graders_container_counts_against_max_live(run_id, docker_client):
    """repo_tests grades in sandbox.fresh(): a second container per episode. From a pool, that one takes a max_live
    slot too (before: it was created beside the pool, uncounted), and gives it back when closed."""
    from sandforge.environments.repo.env import RepoEnv
    from sandforge.environments.repo.tasks import FAMILIES
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.spec import SandboxSpec

    image = build_images(["repo"], client=docker_client, show_progress=False)["repo"]
    seen: list[int] = []
    create = DockerSandbox.create.__func__

    def counting_create(cls, *args, **kw):
        seen.append(pool.live)  # the slot is taken before the container is made
        return create(cls, *args, **kw)

    task = FAMILIES[sorted(FAMILIES)[0]](1)
    with SandboxPool(SandboxSpec(image=image), run_id, size=0, client=docker_client, max_live=2) as pool:
        env = RepoEnv(task, pool.spec, run_id, exec_timeout=60, pool=pool)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DockerSandbox, "create", classmethod(counting_create))
            traj = asyncio.run(run_episode(task, env, scripted_policy(task, CHAT), CHAT, limits(max_turns=8), "g"))
        assert not traj.failed, traj.failure
        assert (traj.reward.value, traj.reward.success) == (1.0, True), traj.reward.reason
        assert seen == [1, 2], seen  # the episode's container, then the grader's: both counted
        assert pool.live == 0


def test_a_grader_waits_for_a_free_slot_and_never_deadlocks(terminal_spec, run_id, docker_client):
    """With max_live taken, fresh() waits for a slot; when every live container's episode is itself waiting for a
    grader, nothing would free one: it goes over by one (and says so) rather than hang or fail the episode."""
    with SandboxPool(terminal_spec, run_id, size=0, client=docker_client, max_live=1) as pool:
        sandbox = pool.acquire()
        with sandbox.fresh() as grader:  # the only live container waits for this grader: one over
            assert grader.exec("echo hi").output == "hi\n"
            assert pool.live == 2 and pool.stats.export()["failures"].get("over_max_live") == 1
        assert pool.live == 1
        pool.release(sandbox)
        assert pool.live == 0


@pytest.mark.parametrize("mode", ["root", "hardened"])
def test_a_harbor_workspace_is_capped_and_starts_with_the_images_files(mode, tmp_path, run_id, docker_client):
    """Harbor's WORKDIR was a disk volume without a cap: 2.1 GB reached the host's Docker disk in 5.6 s. It is a tmpfs
    of `[environment] storage_mb` (64 here), filled from the image as the sandbox starts: the task's files are there
    (and the agent's in hardened mode), and a write past the cap fails inside the sandbox."""
    import shutil

    from sandforge.config import SandboxConfig
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.environments.harbor.tasks import load_tasks
    from sandforge.sandbox.images import build_images
    from sandforge.sandbox.job_spec import sandbox_spec

    task_dir = tmp_path / "capped"
    shutil.copytree(ROOT / "tests" / "data" / "harbor_real" / "digest-pinned", task_dir)
    toml = task_dir / "task.toml"
    toml.write_text(toml.read_text().replace("storage_mb = 1024", "storage_mb = 64"))
    [task], images = load_tasks(task_dir, mode)
    tags = build_images([], client=docker_client, show_progress=False, contexts=images)
    spec = sandbox_spec(SandboxConfig(), tags[task.image], HarborEnv, task.sandbox, docker_client)
    env = HarborEnv(task, spec, run_id, exec_timeout=60, client=docker_client)
    fill = ("stat -c '%U %n' data/words.txt out; head -c 200m /dev/zero > /app/fill; df -k /app | tail -1; "
            "for d in /var/tmp /run/lock /home/sandbox; do head -c 200m /dev/zero > $d/fill; done; words | wc -l")
    scripted = replace(task, solution=[ToolCall("bash", {"command": fill}), ToolCall("submit")])
    traj = asyncio.run(run_episode(task, env, scripted_policy(scripted, CHAT), CHAT, limits(max_turns=3), "g"))
    assert not traj.failed, traj.failure
    out = traj.turns[0].observations[0]
    owner = "root" if mode == "root" else "sandbox"
    assert f"{owner} data/words.txt" in out and f"{owner} out" in out, out  # the image's files, its owners
    # hardened: a non-root agent's other writable places on the root filesystem are capped tmpfs too
    assert out.count("No space left on device") == (4 if mode == "hardened" else 1), out
    device, size_kb = _df(out)
    assert device == "tmpfs" and int(size_kb) <= 64 * 1024, out
    assert traj.reward.value == 0.0


def _df(out: str) -> tuple[str, str]:
    line = next(line for line in out.splitlines() if line.startswith(("tmpfs", "/dev", "overlay")))
    return line.split()[0], line.split()[1]


def test_an_image_workdir_larger_than_the_cap_is_refused_in_one_line(terminal_image, docker_client):
    """The workspace is filled from the image only up to its cap, whether the image's folder was read before or not."""
    from sandforge.sandbox.workspace import workdir_archive
    from sandforge.types import SandboxError

    with pytest.raises(SandboxError, match=r"its /usr/sbin holds more than the workspace's cap \(1k\).*storage_mb"):
        workdir_archive(docker_client, terminal_image, "/usr/sbin", "1k")  # read afresh
    assert len(workdir_archive(docker_client, terminal_image, "/usr/bin", "64m")) > 64 << 10  # now cached
    with pytest.raises(SandboxError, match=r"its /usr/bin holds more than the workspace's cap \(64k\).*storage_mb"):
        workdir_archive(docker_client, terminal_image, "/usr/bin", "64k")
