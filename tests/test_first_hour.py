"""The first hour of a new user: `bash scripts/quickstart.sh`, shortened, with its output redirected to a file as a CI
log or `nohup` would. What reaches the file is what the user needs: no setuptools or Ray notices, a line at least every
30 s however long a phase takes, and the run directory holds the browser episodes' screenshots, shown in report.html."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["trainer.steps=1", "warmup.steps=1", "warmup.episodes=8", "warmup.batch_size=4", "trainer.grad_accum_steps=4",
         "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.max_turns=3", "rollout.max_new_tokens=32",
         "eval.tasks_per_family=1", "eval.samples=1", "eval.greedy=false", "eval.base=false"]
NOISE = re.compile(r"setuptools|SetuptoolsDeprecationWarning|easy_install|Token authentication|RAY_AUTH_MODE|"
                   r"Started a local Ray instance|is ignored: it is neither|\[WARNING\]|real_accelerator", re.I)
LONGEST_SILENCE_S = 33.0  # the heartbeat's 30 s, plus its 1 s tick and this test's polling


def follow(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None
           ) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd`` with stdout and stderr into ``log``; (exit code, each line with the time it appeared)."""
    lines: list[tuple[float, str]] = []
    seen = 0
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        while True:
            done = proc.poll() is not None
            text = log.read_bytes().decode(errors="replace")
            complete = text[seen:].rpartition("\n")[0]
            if complete:
                now = time.monotonic() - start
                lines += [(now, line) for line in complete.split("\n")]
                seen += len(complete) + 1
            if done:
                return proc.returncode, lines
            if time.monotonic() - start > timeout:
                proc.kill()
                pytest.fail(f"quickstart did not finish within {timeout:.0f} s; last lines: {lines[-10:]}")
            time.sleep(0.5)


@pytest.mark.docker
@pytest.mark.slow
def test_the_shortened_quickstart_redirected_to_a_file(tmp_path):
    """...and ARCHITECTURE.md names every module the quickstart's processes import (the driver, the trainer rank, the
    engine and the rollout workers: an import trace, tests/import_trace/sitecustomize.py)."""
    run_dir = tmp_path / "quickstart"
    trace = tmp_path / "import_trace"
    trace.mkdir()
    env = dict(os.environ, SANDFORGE_TEST_IMPORT_TRACE=str(trace),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "import_trace"),
                                                         os.environ.get("PYTHONPATH")])))
    code, lines = follow(["bash", "scripts/quickstart.sh", f"run.output_dir={run_dir}", *SHORT], tmp_path / "out.log",
                         timeout=1500, env=env)
    text = "\n".join(line for _, line in lines)
    assert code == 0, text[-4000:]
    noise = [line for _, line in lines if NOISE.search(line)]
    assert not noise, noise
    times = [0.0] + [t for t, _ in lines]
    gaps = [(b - a, lines[i][1]) for i, (a, b) in enumerate(zip(times, times[1:]))]
    longest = max(gaps)
    assert longest[0] <= LONGEST_SILENCE_S, f"{longest[0]:.0f} s of silence before: {longest[1]!r}"
    assert any("trainer: 1 rank on cpu" in line for _, line in lines), text[-3000:]  # where each part runs

    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    acted = [r for r in rows if r["task"]["env"] == "browser" and not r["failed"]  # episodes that used the browser
             and any(c["name"] != "submit" for m in r["messages"] for c in m.get("tool_calls") or [])]
    assert acted and all(r["metadata"].get("screenshots") for r in acted), [r["metadata"] for r in acted]
    browser = acted
    shots = [run_dir / p for r in browser for p in r["metadata"]["screenshots"]]
    assert all(p.is_file() and p.read_bytes().startswith(b"\x89PNG") for p in shots)
    page = (run_dir / "report.html").read_text()
    assert f'src="{browser[-1]["metadata"]["screenshots"][-1]}"' in page

    traced = {name for f in trace.glob("*.txt") for name in f.read_text().split()}
    # the trace reached every kind of process: the driver, a trainer rank, the engine, a rollout worker
    assert {"sandforge.job.run", "sandforge.trainer.rank", "sandforge.engine.llama", "sandforge.rollout.worker"} <= traced
    assert not unnamed_in_architecture(traced), unnamed_in_architecture(traced)


def unnamed_in_architecture(traced: set[str]) -> list[str]:
    """The files of the ``traced`` modules (packages' ``__init__.py`` aside) whose path ARCHITECTURE.md never names."""
    from test_layering import modules

    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = {str(path.relative_to(ROOT)) for name, path in modules(ROOT).items() if name in traced}
    return sorted(p for p in paths if not p.endswith("__init__.py") and p not in text)
