"""The Docker sandbox and the image pipeline, against real containers (except the COPY-parsing unit test)."""

from __future__ import annotations

import pytest

from sandforge.sandbox import images
from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec
from sandforge.sandbox.labels import LABEL_RUN
from sandforge.sandbox.lifecycle import remove_run_containers
from sandforge.types import SandboxError
from containers import image_for, list_run_containers

AWKWARD = "quotes ' \" `backticks` $HOME $(id) \\n \\\\ \n\ttabs\nünïcödé ✓ \x01\x7f\r\nno trailing newline"


def test_context_files_are_the_dockerfile_and_its_copy_sources(tmp_path):
    (tmp_path / "Dockerfile").write_text(
        "ARG BASE\nFROM ${BASE}\n# COPY ignored.txt /\nCOPY --chown=1000 app.sh \\\n  conf/ /opt/\n"
        'ADD ["data.txt", "/data/"]\nCOPY --from=builder /bin/x /bin/x\nRUN echo done\n'
    )
    for name in ("app.sh", "conf/a.ini", "conf/sub/b.ini", "data.txt", "env.py", "ignored.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "conf" / "__pycache__").mkdir()
    (tmp_path / "conf" / "__pycache__" / "x.pyc").write_text("")
    found = [p.relative_to(tmp_path).as_posix() for p in images._context_files(tmp_path)]
    assert found == ["Dockerfile", "app.sh", "conf/a.ini", "conf/sub/b.ini", "data.txt"]

    (tmp_path / "Dockerfile").write_text("FROM x\nCOPY missing.txt /\n")
    with pytest.raises(images.ImageError, match="'missing.txt' matches nothing"):
        images._context_files(tmp_path)


def test_unknown_env_names_the_envs_that_have_images():
    with pytest.raises(images.ImageError, match="no Dockerfile for env 'nope'.*terminal"):
        images.env_build_context("nope")


def test_slack_and_notion_share_the_apps_image():
    assert images.available_envs() == ["apps", "browser", "repo", "terminal"]
    assert [images.image_name(env) for env in ("slack", "notion", "terminal")] == ["apps", "apps", "terminal"]


@pytest.mark.docker
def test_the_mock_apps_build_one_image(docker_client):
    tags = images.build_images(["slack", "notion"], client=docker_client, show_progress=False)
    assert list(tags) == ["apps"] and tags["apps"].startswith("sandforge/apps:")
    assert image_for("notion", docker_client) == tags["apps"]


@pytest.mark.docker
def test_second_build_is_a_no_op(docker_client, terminal_image, monkeypatch):
    image_id = docker_client.images.get(terminal_image).id

    def no_build(*args, **kwargs):
        raise AssertionError("build_images rebuilt an image whose sources did not change")

    monkeypatch.setattr(docker_client.api, "build", no_build)
    monkeypatch.setattr(docker_client.api, "import_image", no_build)
    assert images.build_images(["terminal"], client=docker_client, show_progress=False) == {"terminal": terminal_image}
    assert docker_client.images.get(terminal_image).id == image_id
    assert image_for("terminal", docker_client) == terminal_image
    assert terminal_image.startswith("sandforge/terminal:") and len(terminal_image.split(":")[1]) == 12


@pytest.mark.docker
def test_sandbox_is_hardened(sandbox, docker_client, run_id):
    assert sandbox.exec("id -u").output.strip() == "1000"
    caps = dict(line.split(":\t") for line in sandbox.exec("grep ^Cap /proc/self/status").output.splitlines())
    assert caps["CapEff"] == caps["CapPrm"] == caps["CapAmb"] == "0000000000000000"
    assert sandbox.exec("grep NoNewPrivs /proc/self/status").output.split() == ["NoNewPrivs:", "1"]
    assert sandbox.exec("ls /sys/class/net").output.split() == ["lo"]
    assert sandbox.exec("pwd").output.strip() == "/workspace"

    attrs = docker_client.api.inspect_container(sandbox.id)
    host = attrs["HostConfig"]
    assert attrs["Config"]["Labels"][LABEL_RUN] == run_id
    assert attrs["Config"]["Labels"]["sandforge.episode"]
    assert host["NetworkMode"] == "none"
    assert host["Memory"] == host["MemorySwap"] == 512 << 20
    assert host["NanoCpus"] == 1_000_000_000
    assert host["PidsLimit"] == 256
    assert host["CapDrop"] == ["ALL"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["Init"] is True
    assert host["ReadonlyRootfs"] is True and set(host["Tmpfs"]) == {"/tmp", "/run/sandforge", "/run/sandforge-root"}
    assert {u["Name"]: u["Hard"] for u in host["Ulimits"]} == {"nofile": 4096, "fsize": 256 << 20}
    (workspace,) = attrs["Mounts"]
    assert (workspace["Type"], workspace["Destination"], workspace["RW"]) == ("volume", "/workspace", True)
    facts = sandbox.exec("stat -c %U:%a /workspace; echo $HOME; df --output=size -B1M /workspace | tail -1").output
    assert facts.split() == ["sandbox:755", "/workspace", "192"]  # the user's own, size-capped workspace is HOME
    assert list_run_containers(run_id, docker_client) == [sandbox.id]


@pytest.mark.docker
def test_exec_reports_exit_code_and_merged_output(sandbox):
    result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.timed_out) == (3, False)
    assert sorted(result.output.split()) == ["err", "out"]
    assert sandbox.exec("cat").output == ""  # stdin is empty, nothing waits for input


@pytest.mark.docker
def test_exec_timeout_kills_the_process_inside(sandbox):
    result = sandbox.exec("echo started; sleep 100", timeout=1)
    assert result.timed_out and result.exit_code == 124
    assert result.output == "started\n" and result.seconds < 5
    assert "sleep 100" not in sandbox.exec("ps -eo args").output

    stubborn = sandbox.exec("trap '' TERM; sleep 100", timeout=1)  # ignores TERM: KILL follows
    assert stubborn.timed_out and stubborn.exit_code == 137 and stubborn.seconds < 8
    assert "sleep 100" not in sandbox.exec("ps -eo args").output


@pytest.mark.docker
def test_background_jobs_live_on_without_holding_the_call(sandbox):
    result = sandbox.exec("sleep 101 & setsid sleep 102 & sleep 103 >/dev/null 2>&1 & echo ok", timeout=5)
    assert (result.output, result.exit_code, result.timed_out) == ("ok\n", 0, False)
    assert result.seconds < 3
    procs = sandbox.exec("ps -eo args").output
    assert "sleep 101" in procs and "sleep 102" in procs and "sleep 103" in procs


@pytest.mark.docker
def test_exec_output_is_truncated_in_the_middle(terminal_image, run_id, docker_client):
    spec = SandboxSpec(image=terminal_image, max_output_bytes=1000)
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        result = sb.exec("seq 1 20000; echo done >&2")
        total = len("".join(f"{i}\n" for i in range(1, 20001))) + len("done\n")
        assert result.exit_code == 0
        assert result.output.startswith("1\n2\n3\n") and result.output.endswith("20000\ndone\n")
        assert f"[... truncated {total - 1000} bytes]" in result.output
        assert len(result.output) < 1100
        flood = sb.exec("yes", timeout=5)  # endless output fills the sandbox's spool, not the client
        assert flood.exit_code != 0 and len(flood.output) < 1150 and "truncated" in flood.output
        assert flood.output.endswith("[output spool full: past 64m lost]")
        assert sb.exec("echo after").output == "after\n"


@pytest.mark.docker
def test_files_round_trip_awkward_content(sandbox):
    path = "/workspace/dir with space/-odd 'name\".txt"
    sandbox.write_file(path, AWKWARD)
    assert sandbox.read_file(path) == AWKWARD
    assert sandbox.exec("stat -c %U /workspace/dir\\ with\\ space/*").output.strip() == "sandbox"
    big = "0123456789abcdef\n" * 20000  # several write chunks
    sandbox.write_file("relative/big.txt", big)
    assert sandbox.read_file("/workspace/relative/big.txt") == big
    sandbox.write_file("empty.txt", "")
    assert sandbox.read_file("empty.txt") == ""
    assert sandbox.read_file("/workspace/missing.txt") is None

    with pytest.raises(OSError, match="Read-only file system"):
        sandbox.write_file("/etc/passwd", "x")
    sandbox.exec("mkdir locked", user="root")
    with pytest.raises(OSError, match="Permission denied"):
        sandbox.write_file("locked/x.txt", "x")
    with pytest.raises(OSError, match="Is a directory"):
        sandbox.read_file("/workspace")
    sandbox.exec("umask 077; echo secret > private.txt")
    assert sandbox.read_file("private.txt", user="root") == "secret\n"  # root reads what the policy locked


@pytest.mark.docker
def test_a_dead_sandbox_raises_sandbox_error(sandbox, docker_client):
    docker_client.api.kill(sandbox.id)
    assert not sandbox.alive()
    with pytest.raises(SandboxError, match="not running"):
        sandbox.exec("true")
    with pytest.raises(SandboxError):
        sandbox.read_file("/workspace/x")
    sandbox.close()
    sandbox.close()  # idempotent
    with pytest.raises(SandboxError):
        sandbox.write_file("/workspace/x", "y")


@pytest.mark.docker
def test_remove_run_containers_leaves_none(terminal_spec, run_id, docker_client):
    boxes = [DockerSandbox.create(terminal_spec, run_id, client=docker_client) for _ in range(2)]
    docker_client.api.kill(boxes[0].id)  # exited containers count too
    assert sorted(list_run_containers(run_id, docker_client)) == sorted(b.id for b in boxes)
    assert remove_run_containers(run_id, docker_client) == 2
    assert list_run_containers(run_id, docker_client) == []
    assert docker_client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={run_id}"}) == []
    for box in boxes:
        box.close()  # already removed: still fine


@pytest.mark.docker
def test_missing_image_says_how_to_build(run_id, docker_client):
    with pytest.raises(SandboxError, match="sandforge images build"):
        DockerSandbox.create(SandboxSpec(image="sandforge/terminal:000000000000"), run_id, client=docker_client)
    assert list_run_containers(run_id, docker_client) == []
