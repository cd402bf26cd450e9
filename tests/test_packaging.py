"""The repository-root folders install as subpackages of `sandforge`, from a wheel as well as editable."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["trainer", "trainer.algorithms", "rollout", "environments", "verifiers", "models", "models.k3"]


def test_editable_install_maps_root_folders():
    code = "import importlib; print([importlib.import_module('sandforge.' + p).__file__ for p in %r])" % PARTS
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout
    for part in PARTS:
        assert f"{ROOT}/{part.replace('.', '/')}/__init__.py" in out


def test_wheel_install_holds_every_part_and_the_dockerfiles(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    code = (
        "import sys; sys.path.insert(0, %r); import importlib, sandforge.environments.terminal.env;"
        "print([importlib.import_module('sandforge.' + p).__file__ for p in %r])" % (str(target), PARTS)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/").stdout
    for part in PARTS:
        assert f"{target}/sandforge/{part.replace('.', '/')}/__init__.py" in out
    assert (target / "sandforge" / "environments" / "terminal" / "Dockerfile").is_file()
    assert (target / "sandforge" / "environments" / "apps" / "Dockerfile").is_file()  # slack's and notion's image
    assert (target / "sandforge" / "engine" / "kernels" / "pool.c").is_file()  # the engine's kernels build from these
