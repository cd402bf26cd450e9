"""sandforge's grader start-up (sandforge/grader_files/sitecustomize.py), run by this machine's own Python: root's
sys.path entries win, the task's answers keep Python's order, metadata comes from root's folders only, the image's
own sitecustomize still runs. The folders play the policy's by belonging to nobody (these tests run as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from sandforge import harness

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the policy's folders are made by chown, which needs root")


@pytest.fixture
def folders(tmp_path):
    """(the harness's folder, root-owned; the policy's working directory, owned by nobody)."""
    tmp_path.chmod(0o755)
    site = tmp_path / "harness"
    site.mkdir(mode=0o755)
    shutil.copy(harness.FILES / "sitecustomize.py", site)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, 65534, 65534)
    return site, work


def python(site, work, code, answers="", extra=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *extra]), "SANDFORGE_ANSWERS": answers}
    env.pop("PYTHONSAFEPATH", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_root_module_wins_over_the_working_directorys(folders):
    site, work = folders
    (work / "json.py").write_text("raise SystemExit('shadow imported')\n")
    (work / "solver.py").write_text("ANSWER = 42\n")
    shown = python(site, work, "import json, solver; print(json.__file__, solver.ANSWER)")
    assert "/work/" not in shown.split()[0] and shown.endswith(" 42")  # the policy's own module still imports
    # without the harness the shadow wins: the test ties the two
    done = subprocess.run([sys.executable, "-c", "import json"], cwd=work, capture_output=True, text=True)
    assert "shadow imported" in done.stderr


def test_an_answer_keeps_pythons_order_and_a_namespace_portion_does_not_outrank_a_module(folders, tmp_path):
    site, work = folders
    (work / "statistics.py").write_text("SPREAD = 1\n")
    assert python(site, work, "import statistics; print(statistics.SPREAD)", answers="statistics") == "1"
    assert python(site, work, "import statistics; print(hasattr(statistics, 'SPREAD'))") == "False"
    lib = tmp_path / "lib"
    (lib / "helpers").mkdir(parents=True)  # a folder without __init__: only a namespace portion
    (work / "helpers.py").write_text("NAME = 'module'\n")
    assert python(site, work, "import helpers; print(helpers.NAME)", extra=[str(lib)]) == "module"


def test_metadata_comes_from_roots_folders_only(folders):
    site, work = folders
    dist = work / "evil-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nevil = evilplug\n")
    code = ("import importlib.metadata as m; print(sorted({d.metadata['Name'] for d in m.distributions()} & "
            "{'evil', 'pytest'}), [e.name for e in m.entry_points(group='pytest11') if e.name == 'evil'])")
    assert python(site, work, code) == "['pytest'] []"


def test_the_next_sitecustomize_still_runs(folders, tmp_path):
    site, work = folders
    image = tmp_path / "image-site"
    image.mkdir()
    (image / "sitecustomize.py").write_text("import builtins\nbuiltins.IMAGE_SITE = True\n")
    (work / "sitecustomize.py").write_text("import builtins\nbuiltins.POLICY_SITE = True\n")
    code = "import builtins; print(getattr(builtins, 'IMAGE_SITE', False), getattr(builtins, 'POLICY_SITE', False))"
    assert python(site, work, code, extra=[str(work), str(image)]) == "True False"


def test_answer_modules_are_the_named_files_stems():
    assert harness.answer_modules(["/app/statistics.py", "./solver.py", "lib/json.py", "x-y.py", "notes.txt"]) == (
        "statistics", "solver", "json")
