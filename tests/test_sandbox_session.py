"""Persistent shell sessions, against real containers: state carries over, timeouts end whole process groups and
leave the session usable, background jobs run on, and the fast path (one long-lived dispatcher) answers exactly as the
reference path (one docker exec per command) does."""

from __future__ import annotations

import time

import pytest

from sandforge.sandbox.docker_sandbox import DockerSandbox, SandboxSpec

pytestmark = pytest.mark.docker


def test_session_keeps_cwd_variables_functions_and_aliases(sandbox):
    sandbox.exec("cd /tmp && mkdir -p d && cd d; X=1; export Y='two words'; arr=(a 'b c'); f() { echo \"f:$1\"; }")
    sandbox.exec("alias hello='echo hi from alias'; export PATH=$PATH:/opt/bin")
    result = sandbox.exec("pwd; echo $X; printenv Y; echo ${arr[1]}; f arg; hello; echo $PATH")
    assert result.output.splitlines() == ["/tmp/d", "1", "two words", "b c", "f:arg", "hi from alias",
                                          "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/bin"]
    sandbox.exec("unset X; export -n Y; unset -f f; cd -")
    result = sandbox.exec("pwd; echo \"[$X]\"; printenv Y || echo not exported; type f 2>&1 | tail -1")
    assert result.output.splitlines() == ["/tmp", "[]", "not exported", "bash: line 1: type: f: not found"]
    assert sandbox.exec("exit 7").exit_code == 7 and sandbox.exec("pwd").output == "/tmp\n"


def test_timeout_kills_the_whole_group_and_the_session_goes_on(sandbox):
    sandbox.exec("cd /tmp; export KEEP=1")
    result = sandbox.exec("sleep 201 & cd /; echo started; sleep 202", timeout=1)
    assert (result.timed_out, result.exit_code, result.output) == (True, 124, "started\n")
    procs = sandbox.exec("ps -eo args").output
    assert "sleep 20" not in procs  # the background job of the timed-out command went with it
    assert sandbox.exec("pwd; echo $KEEP").output == "/\n1\n"  # like Ctrl-C in a terminal: its cd stays

    stubborn = sandbox.exec("cd /etc; trap '' TERM; sleep 203", timeout=1)  # ignores TERM: KILL follows
    assert (stubborn.timed_out, stubborn.exit_code) == (True, 137) and stubborn.seconds < 8
    assert "sleep 203" not in sandbox.exec("ps -eo args").output
    assert sandbox.exec("pwd; echo $KEEP").output == "/\n1\n"  # killed outright: the state from before


def test_background_jobs_run_on_and_their_output_shows_later(sandbox):
    start = sandbox.exec("sleep 300 & (while :; do echo tick; sleep 0.2; done) & echo started")
    assert "started" in start.output.splitlines() and start.exit_code == 0 and start.seconds < 3
    later = sandbox.exec("sleep 1; echo now")
    # as a terminal shows it: the job's ticks, then "now" (a tick may land just after it, before the command ends)
    lines = later.output.splitlines()
    assert lines[0] == "tick" and "now" in lines and set(lines) == {"tick", "now"}, later.output
    assert "sleep 300" in sandbox.exec("ps -eo args").output


def test_one_off_commands_neither_see_nor_change_the_session(sandbox):
    sandbox.exec("cd /tmp; export S=session")
    one_off = sandbox.exec("pwd; echo \"[$S]\"; cd /etc; export S=other", session=False)
    assert one_off.output == "/workspace\n[]\n"
    assert sandbox.exec("pwd; echo $S").output == "/tmp\nsession\n"
    assert sandbox.exec("pwd", session=False, workdir="/etc").output == "/etc\n"
    assert sandbox.exec("echo \"[$S]\"; id -u; cd /; export R=1", user="root").output == "[]\n0\n"  # root's own
    assert sandbox.exec("pwd; echo $R", user="root").output == "/\n1\n"
    assert sandbox.exec("pwd; echo \"[$R]\"").output == "/tmp\n[]\n"
    assert sandbox.exec("pwd", workdir="/usr").output == "/usr\n"  # workdir with a session: a cd before the command


def test_a_killed_shell_is_restarted_with_the_session_state(sandbox):
    sandbox.exec("cd /tmp; export A=1")
    killed = sandbox.exec("kill -9 -1")  # every process of the sandbox user, the session's dispatcher included
    assert killed.exit_code == 137 and "shell was killed" in killed.output
    assert sandbox.exec("pwd; echo $A").output == "/tmp\n1\n"


def test_a_full_spool_neither_bricks_the_session_nor_fakes_a_verifier_result(sandbox):
    sandbox.exec("yes &")  # its output fills the session's spool until yes dies of ENOSPC
    time.sleep(0.5)
    assert sandbox.exec("echo hi").output == "hi\n"  # what it printed between commands is dropped
    sandbox.exec("head -c 80M /dev/zero > /run/sandforge/1000/junk")  # the policy fills its spool itself
    short = sandbox.exec("echo hi")  # fits where the last command was, but its output does not
    assert short.exit_code == 1 and short.output == ""
    stuck = sandbox.exec("echo hi # " + "x" * 20000)
    assert stuck.exit_code == 126 and "cannot write the command" in stuck.output  # not a silent success
    assert sandbox.exec("echo verifier", user="root", session=False).output == "verifier\n"  # root has its own
    sandbox.exec("rm /run/sandforge/1000/junk", user="root", session=False)
    assert sandbox.exec("echo again").output == "again\n"


def test_commands_and_output_of_any_size(terminal_image, run_id, docker_client):
    spec = SandboxSpec(image=terminal_image, max_output_bytes=100)
    with DockerSandbox.create(spec, run_id, client=docker_client) as sb:
        long = sb.exec("cat <<'EOF' | wc -c\n" + "x" * 300_000 + "\nEOF")  # past Linux's 128 KiB per argument
        assert long.output == "300001\n"
        big = sb.exec("seq 1 100000")
        assert big.output.startswith("1\n2\n") and big.output.endswith("99999\n100000\n")
        total = sum(len(str(i)) + 1 for i in range(1, 100001))
        assert f"[... truncated {total - 100} bytes]" in big.output


SCRIPT = [
    "echo hello; echo err >&2; false",
    "cd /tmp && mkdir -p p && cd p; export V=1; g() { echo g$V; }",
    "pwd; g; printf 'ünï ✓ \\x01 no newline'",
    "seq 1 5000",
    "sleep 5",
    "pwd; echo $V; exit 3",
    "head -c 100 /dev/zero | tr '\\0' a; cat /nope",
]


def test_fast_path_and_reference_path_agree(terminal_image, run_id, docker_client):
    spec = SandboxSpec(image=terminal_image, max_output_bytes=2000)
    with DockerSandbox.create(spec, run_id, client=docker_client) as fast, \
            DockerSandbox.create(spec, run_id, client=docker_client) as ref:
        ref.reuse_shell = False  # every command a fresh docker exec
        for command in SCRIPT:
            a, b = fast.exec(command, timeout=1), ref.exec(command, timeout=1)
            assert (a.exit_code, a.output, a.timed_out) == (b.exit_code, b.output, b.timed_out), command
        assert fast.exec("ps -eo args").output.count("sandforge-shell") == 1  # one dispatcher served them all
        fast.start_session()  # already started: nothing new
        fast.start_session("root")
        assert fast.exec("ps -eo user,args").output.count("sandforge-shell") == 2
