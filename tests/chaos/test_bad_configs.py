"""Case 10: a bad config fails in one clear line, with a non-zero exit, before anything starts: no run directory, no
Ray, no container."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from harness import ROOT, sandforge

pytestmark = [pytest.mark.chaos]

BAD = [
    ("sandbox.memroy=1g", "unknown key 'sandbox.memroy' (did you mean 'memory'?)"),
    ("trainer.steps=many", "invalid value for 'trainer.steps'"),
    ("sandbox.base_image=sandforge/no-such-base:1", "'sandbox.base_image' = 'sandforge/no-such-base:1' is not a local "
                                                    "image"),
    ("sandbox.runtime=no-such-runtime", "'sandbox.runtime' = 'no-such-runtime': the Docker daemon has no such runtime"),
    ("sandbox.memory=100000g", "'sandbox.memory' = 100000g is more than this machine has"),
    ("sandbox.cpus=4096", "'sandbox.cpus' = 4096 is more than this machine has"),
    ("rollout.workers=0", "invalid value for 'rollout.workers'"),
]


@pytest.mark.parametrize("override, says", BAD, ids=[b[0].split("=")[0] for b in BAD])
def test_a_bad_config_fails_in_one_line_before_anything_starts(override, says, tmp_path, docker_client):
    name = f"chaos-bad-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.run(sandforge("train", "configs/terminal.yaml", f"run.name={name}", f"run.output_dir={out}",
                                    override), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: configs/terminal.yaml"), proc.stderr[-2000:]
    assert says in lines[0]
    assert time.monotonic() - started < 60  # nothing heavy was imported, let alone started
    assert not out.exists()  # no run directory
    assert not [c for c in docker_client.containers.list(all=True, sparse=True, filters={"label": "sandforge.run"})
                if (c.attrs.get("Labels") or {}).get("sandforge.run", "").startswith(name)]
