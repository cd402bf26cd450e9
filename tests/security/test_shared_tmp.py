"""A root test.sh's writes to a predictable /tmp path go where it meant (#32: graders share /tmp with the policy).

/tmp is the policy's too (a sticky, world-writable tmpfs), and on these hosts the kernel's guards for it
(fs.protected_symlinks, protected_regular, protected_fifos) shipped off: a link the policy planted at the path root's
test.sh writes was followed. Pointed at the policy's own answer, root's `cp /tests/expected.txt /tmp/expected.txt`
wrote the expected answer into it (reward 1); pointed at /logs/verifier/reward.json, test.sh's report made that file
unreadable and the episode failed (a loss taken out of the gradient). scripts/harden_host.sh turns the guards on
(setup.sh runs it; a job's preflight warns when they are off), so root's open through the link is refused.
"""

from __future__ import annotations

import pytest
from harbor_folder import grader, harbor_task

from sandforge.job.preflight import sticky_guard_warnings

COMPARE = "import sys\nsys.exit(open(sys.argv[1]).read() != open(sys.argv[2]).read())\n"
EXPECTED = "42\n"


@pytest.mark.docker
def test_a_link_planted_in_tmp_does_not_redirect_a_root_write(repo_spec, run_id, docker_client, tmp_path):
    assert not sticky_guard_warnings(), "run scripts/harden_host.sh (setup.sh does): " + "; ".join(
        sticky_guard_warnings())
    test_sh = ("cd /workspace\n"
               "python3 -m pytest -q -p no:cacheprovider /tests/test_outputs.py > /tmp/pytest-report.txt 2>&1\n"
               "cp /tests/expected.txt /tmp/expected.txt && python3 /tests/compare.py /tmp/expected.txt out.txt\n"
               "if [ $? -eq 0 ]; then r=1; else r=0; fi\necho $r > /logs/verifier/reward.txt\n")
    tests = {"expected.txt": EXPECTED, "compare.py": COMPARE, "test_outputs.py": "def test_nothing():\n    pass\n"}
    task, images = harbor_task(tmp_path, repo_spec.image, test_sh, tests,
                               "Write the answer to life into /workspace/out.txt.\n")
    run = grader(task, images, run_id, docker_client)
    forged = run("echo wrong > /workspace/out.txt && ln -s /workspace/out.txt /tmp/expected.txt")
    assert forged.reward.value == 0.0, forged.reward.reason
    planted = run("echo wrong > /workspace/out.txt && echo wrong > /tmp/expected.txt")  # a file, not a link
    assert planted.reward.value == 0.0, planted.reward.reason
    broken = run("echo 42 > /workspace/out.txt && ln -s /logs/verifier/reward.json /tmp/pytest-report.txt && "
                 "mkfifo /tmp/x")  # run() asserts the episode did not fail
    assert broken.reward.value == 1.0, broken.reward.reason  # the report went nowhere; the answer is right
    assert run("echo 42 > /workspace/out.txt").reward.value == 1.0


def test_the_preflight_names_each_guard_that_is_off(tmp_path):
    for name, value in {"protected_symlinks": 0, "protected_regular": 1, "protected_fifos": 2,
                        "protected_hardlinks": 1}.items():
        (tmp_path / name).write_text(f"{value}\n")
    lines = sticky_guard_warnings(tmp_path)
    assert [line.split()[0] for line in lines] == ["fs.protected_symlinks", "fs.protected_regular"]
    assert "sudo sysctl -w fs.protected_symlinks=1" in lines[0]
    assert sticky_guard_warnings(tmp_path / "missing") == []
