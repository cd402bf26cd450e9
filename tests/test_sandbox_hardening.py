"""What a hostile or clumsy policy cannot do in a sandbox, against real containers: every limit fails inside the
container only, and the sandbox (or the next one) keeps working."""

from __future__ import annotations

import io
import os
import tarfile
import time
import uuid

import pytest

from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.labels import LABEL_CREATED, LABEL_RUN
from containers import list_run_containers
from sandforge.types import SandboxError

pytestmark = pytest.mark.docker


def test_no_network_route_and_no_privileges(sandbox):
    assert sandbox.exec("ls /sys/class/net").output.split() == ["lo"]
    assert sandbox.exec("tail -n +2 /proc/net/route | wc -l").output.strip() == "0"  # no route, not even a default
    assert sandbox.exec("id -u; id -g").output.split() == ["1000", "1000"]
    assert "CapEff:\t0000000000000000" in sandbox.exec("grep CapEff /proc/self/status").output
    # root in the sandbox keeps only CHOWN, DAC_OVERRIDE, FOWNER and KILL (bits 0, 1, 3, 5), for verifiers and setup
    assert "CapEff:\t000000000000002b" in sandbox.exec("grep CapEff /proc/self/status", user="root").output


def test_root_filesystem_is_read_only_and_writable_places_are_capped(terminal_image, run_id, docker_client):
    spec = SandboxSpec(image=terminal_image, max_file_size="1m", workspace_size="4m", tmp_size="8m")
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        for user in (None, "root"):
            result = sb.exec("touch /usr/bin/x", user=user)
            assert result.exit_code == 1 and "Read-only file system" in result.output
        big = sb.exec("head -c 2M /dev/zero > /tmp/big")  # past the fsize ulimit: SIGXFSZ
        assert big.exit_code == 153 and "File size limit exceeded" in big.output
        assert sb.exec("stat -c %s /tmp/big").output.strip() == str(1 << 20)
        full = sb.exec("for i in 1 2 3 4 5 6; do head -c 900k /dev/zero > f$i || exit; done")  # past the workspace
        assert full.exit_code == 1 and "No space left on device" in full.output
        assert sb.exec("rm f*; echo ok > after.txt && cat after.txt").output == "ok\n"  # space comes back
        assert sb.alive()


def test_fork_bomb_is_contained_by_the_pids_limit(terminal_image, run_id, docker_client):
    spec = SandboxSpec(image=terminal_image, pids_limit=64)
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        bomb = sb.exec("bomb() { bomb | bomb; }; bomb", timeout=3)  # in the foreground: its timeout ends it
        assert bomb.timed_out and bomb.seconds < 15
        for _ in range(20):  # the killed group's last members may take a moment to go
            after = sb.exec("ps -e --no-headers | wc -l")
            if after.exit_code == 0 and int(after.output) < 10:
                break
            time.sleep(0.5)
        assert after.exit_code == 0 and int(after.output) < 10, after
        assert sb.exec("echo still works").output == "still works\n"

        sb.exec(":(){ :|:& };:")  # in the background: it outlives the command, held by the pids limit only
        time.sleep(1)
        pids = docker_client.api.stats(sb.id, stream=False, one_shot=True)["pids_stats"]["current"]
        assert 32 < pids <= 64
    with DockerSandbox.create(spec, run_id, client=docker_client) as fresh:  # the next episode runs normally
        assert fresh.exec("echo fresh").output == "fresh\n"
    assert list_run_containers(run_id, docker_client) == []


def test_memory_hog_is_oom_killed_and_reported_and_the_sandbox_survives(terminal_image, run_id, docker_client):
    spec = SandboxSpec(image=terminal_image, memory="128m")
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        sb.exec("cd /tmp; export KEEP=1")
        hog = sb.exec("head -c 400m /dev/zero | tail -c 300m > /dev/null", timeout=30)
        assert (hog.exit_code, hog.oom_killed, hog.timed_out) == (137, True, False)
        assert hog.output.endswith("[killed: the sandbox ran out of memory]")
        assert sb.alive()
        calm = sb.exec("pwd; echo $KEEP")
        assert (calm.output, calm.oom_killed) == ("/tmp\n1\n", False)


def test_network_names_only_internal_networks(terminal_image, run_id, docker_client):
    with pytest.raises(SandboxError, match="default bridge"):
        DockerSandbox.create(SandboxSpec(image=terminal_image, network=True), run_id, client=docker_client)
    with pytest.raises(SandboxError, match="docker network create --internal nope-"):
        DockerSandbox.create(SandboxSpec(image=terminal_image, network=f"nope-{run_id}"), run_id, client=docker_client)
    labels = {LABEL_RUN: run_id}
    internal = docker_client.networks.create(f"{run_id}-internal", internal=True, labels=labels)
    public = docker_client.networks.create(f"{run_id}-public", labels=labels)
    try:
        with pytest.raises(SandboxError, match="is not internal"):
            DockerSandbox.create(SandboxSpec(image=terminal_image, network=public.name), run_id, client=docker_client)
        spec = SandboxSpec(image=terminal_image, network=internal.name)
        # Docker isolates an internal network on the host (no NAT, no forwarding), so no packet is sent out to test it
        with DockerSandbox.create(spec, run_id, client=docker_client) as a, \
                DockerSandbox.create(spec, run_id, client=docker_client) as b:
            assert docker_client.api.inspect_container(a.id)["HostConfig"]["NetworkMode"] == internal.name
            assert sorted(a.exec("ls /sys/class/net").output.split()) == ["eth0", "lo"]
            assert b.exec(f"getent hosts {a.name}").exit_code == 0  # its peers on the network resolve
        assert list_run_containers(run_id, docker_client) == []
    finally:
        internal.remove()
        public.remove()


def test_labels_are_merged_and_stamped(terminal_spec, run_id, docker_client):
    before = int(time.time())
    extra = {"sandforge.driver.pid": "42", LABEL_RUN: "not-this-one"}
    with DockerSandbox.create(terminal_spec, run_id, client=docker_client, labels=extra) as sb:
        labels = docker_client.api.inspect_container(sb.id)["Config"]["Labels"]
        assert labels["sandforge.driver.pid"] == "42" and labels[LABEL_RUN] == run_id
        assert before <= int(labels[LABEL_CREATED]) <= time.time() + 1
        volume = docker_client.api.inspect_container(sb.id)["Mounts"][0]["Name"]
        assert docker_client.api.inspect_volume(volume)["Labels"][LABEL_RUN] == run_id
    assert not docker_client.volumes.list(filters={"name": volume})  # removed with its container


def test_50_mb_file_round_trips_byte_exact(sandbox):
    data = os.urandom(50 << 20)
    sandbox.put_file("big.bin", data, mode=0o600)
    assert sandbox.exec("stat -c '%s %U %a' big.bin").output.split() == [str(len(data)), "sandbox", "600"]
    assert sandbox.get_file("/workspace/big.bin") == data
    sandbox.put_file("/tmp/dir/odd name", b"\0\xff\n", user="root")
    assert sandbox.exec("stat -c %U '/tmp/dir/odd name' /tmp/dir").output.split() == ["root", "root"]
    assert sandbox.get_file("/tmp/dir/odd name") == b"\0\xff\n"
    assert sandbox.get_file("missing.bin") is None
    sandbox.exec("ln -s /etc/hostname link")
    sandbox.put_file("link", b"replaced")  # replaces the symlink, never writes through it
    assert sandbox.exec("test -L link || cat link").output == "replaced"


def test_dockers_archive_api_reaches_the_workspace(sandbox, docker_client):
    # A tmpfs *mount* of a read-only container is out of reach of put_archive/get_archive; the workspace is a
    # tmpfs-backed volume so that `docker cp` and the archive API still work there.
    name = f"{uuid.uuid4().hex}.txt"
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo(name)
        member.size = 5
        tar.addfile(member, io.BytesIO(b"hello"))
    assert docker_client.api.put_archive(sandbox.id, "/workspace", archive.getvalue())
    assert sandbox.exec(f"cat {name}").output == "hello"
    chunks, stat = docker_client.api.get_archive(sandbox.id, f"/workspace/{name}")
    assert stat["size"] == 5 and b"hello" in b"".join(chunks)


def test_programs_made_in_tmp_and_the_scratch_folders_run_and_the_caps_hold(terminal_image, run_id, docker_client):
    """Docker mounts a tmpfs noexec unless told otherwise, so a grader that builds a binary in a temp dir and runs it
    (Go's tests, a C task's a.out) scored 0 where Harbor's plain Docker passes. /tmp, the hardened agent's scratch
    folders and the workspace run what is made there, for the policy's user and for root (a script and a copied ELF);
    nosuid and nodev stay, the session spools stay noexec, each folder keeps its cap, and what a tmpfs holds counts
    towards the sandbox's memory."""
    scratch = ("/var/tmp", "/run/lock", "/home/sandbox")
    spec = SandboxSpec(image=terminal_image, tmp_size="8m", memory="256m", scratch=scratch, workspace_size="16m")
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        for folder in ("/tmp", *scratch, "/workspace"):
            for user in (None, "root"):
                made = sb.exec(f"d=$(mktemp -d -p {folder}) && printf '#!/bin/sh\\necho ran\\n' > $d/prog && "
                               "chmod +x $d/prog && cp /bin/true $d/elf && $d/prog && $d/elf && echo elf", user=user)
                assert (made.exit_code, made.output) == (0, "ran\nelf\n"), (folder, user, made)
        mounts = {f[1]: f[3].split(",") for f in map(str.split, sb.exec("cat /proc/mounts").output.splitlines())}
        for folder in ("/tmp", *scratch):
            assert {"nosuid", "nodev"} <= set(mounts[folder]) and "noexec" not in mounts[folder], mounts[folder]
        assert "noexec" in mounts["/run/sandforge"], mounts["/run/sandforge"]
        for folder in ("/tmp", *scratch):
            full = sb.exec(f"head -c 9m /dev/zero > {folder}/fill")
            assert full.exit_code == 1 and "No space left on device" in full.output, (folder, full)
        used = "cat /sys/fs/cgroup/memory.current 2>/dev/null || cat /sys/fs/cgroup/memory/memory.usage_in_bytes"
        sb.exec(f"rm {' '.join(f'{folder}/fill' for folder in ('/tmp', *scratch))}")
        before = int(sb.exec(used).output)
        sb.exec("head -c 6m /dev/urandom > /tmp/kept")
        assert int(sb.exec(used).output) - before > 5 << 20  # the tmpfs pages are the container's memory
