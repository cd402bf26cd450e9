"""sandforge's grader start-up (sandforge/grading/files/), run by this machine's own Python and bash as a root grader
would run them in a sandbox: root's folders win, library code never imports from the policy's, metadata comes from
root's folders only, the task's answers keep Python's order, the image's own sitecustomize still runs; git reads the
policy's repository and runs nothing it configures; PATH keeps root's folders; the offline uv refuses what it does
not know. The policy's folders are made by chown to nobody (these tests run as root). Each attack is shown to work
without the harness first, where it can be, so the test can fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from sandforge.grading import startup

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the policy's folders are made by chown, which needs root")
NOBODY = 65534
# the user site (the harness's first way in) is off in a venv without the system's packages, as this suite's own
# Python is: the tests of that way use the interpreter the venv was made from (no third-party packages)
BASE = getattr(sys, "_base_executable", sys.executable)


@pytest.fixture
def folders(tmp_path):
    """(the harness's folder, root-owned, as prepare lays it out; the policy's working directory, nobody's)."""
    tmp_path.chmod(0o755)
    site = tmp_path / "harness"
    subprocess.run(["bash", "-c", startup.install_script(str(site))], check=True)  # prepare's own script
    for folder in (site, *site.rglob("*")):
        if folder.is_dir():
            folder.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    os.chown(work, NOBODY, NOBODY)
    return site, work


def grader_env(site, answers="", pythonpath=None, user_site=True):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH", "PYTHONNOUSERSITE")}
    env.update(PYTHONPATH=pythonpath if pythonpath is not None else str(site / "py"), SANDFORGE_ANSWERS=answers,
               SANDFORGE_POLICY_IDS=f"{NOBODY} {NOBODY}", HOME="/root")
    if user_site:
        env["PYTHONUSERBASE"] = str(site / "base")
    else:
        env["PYTHONNOUSERSITE"] = "1"
    return env


def python(site, work, code, answers="", extra=(), pythonpath=None, user_site=True, args=("-c",), check=True,
           exe=sys.executable):
    path = pythonpath if pythonpath is not None else os.pathsep.join([str(site / "py"), *map(str, extra)])
    done = subprocess.run([exe, *args, code], cwd=work, env=grader_env(site, answers, path, user_site),
                          capture_output=True, text=True, timeout=120)
    assert not check or done.returncode == 0, done.stderr
    return done.stdout.strip() if check else done


def bare(work, code, pythonpath=""):
    """The same command without the harness: what a root grader got before."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONNOUSERSITE")}
    env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=work, env=env, capture_output=True, text=True,
                          timeout=120)


def plant(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    subprocess.run(["chown", "-R", str(NOBODY), str(path.parent)], check=True)


MARK = "import pathlib; pathlib.Path({0!r}).write_text('ran'); "


@pytest.mark.parametrize("user_site", [True, False], ids=["user-site", "sitecustomize"])
def test_a_root_module_wins_over_the_working_directorys(folders, user_site):
    site, work = folders
    plant(work / "json.py", "raise SystemExit('shadow imported')\n")
    plant(work / "solver.py", "ANSWER = 42\n")
    code = "import json, solver, sys; print(json.__file__, solver.ANSWER, site.ENABLE_USER_SITE)".replace(
        "sys;", "sys, site;")
    shown = python(site, work, code, user_site=user_site, pythonpath="" if user_site else None, exe=BASE)
    assert shown.endswith(" True" if user_site else " False")  # the way in under test
    assert "/work/" not in shown.split()[0] and shown.split()[1] == "42"  # the policy's own module still imports
    assert "shadow imported" in bare(work, "import json").stderr


def test_an_emptied_environment_reads_the_policys_ids_from_the_spool(folders):
    """#56: a test.sh's `env -i python3 ...` dropped SANDFORGE_POLICY_IDS, so the start-up the image's .pth ran judged
    nothing the policy's and the working directory's json.py shadowed the standard one, as root. The ids (and the
    answer modules) are also in the `context` file prepare writes beside the start-up on root's spool."""
    site, work = folders
    plant(work / "json.py", "raise SystemExit('shadow imported')\n")
    env = {"PYTHONUSERBASE": str(site / "base"), "PATH": os.environ["PATH"], "HOME": "/root"}  # no ids, no answers
    code = "import json; print(json.__file__)"

    def run():
        return subprocess.run([BASE, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=120)

    assert "shadow imported" in run().stderr  # prepare's context names no policy here: nothing is set aside
    (site / "py" / "context").write_text(f"{NOBODY} {NOBODY}\n\n")
    shown = run()
    assert shown.returncode == 0 and not shown.stdout.startswith(str(work)), shown.stderr


def test_a_library_import_statement_never_reaches_the_policys_folders(folders, tmp_path):
    """Red team F5: an optional import a library tries (copy's `org.python.core`, requests' `simplejson`) missed on
    root's folders and fell through to the policy's, as root. The tests' own imports still reach them."""
    site, work = folders
    ran = tmp_path / "ran"
    plant(work / "org" / "__init__.py", MARK.format(str(ran)) + "raise ImportError\n")
    plant(work / "simplejson.py", MARK.format(str(ran)) + "from json import *\n")
    code = "import copy, requests.compat as c; print(c.json.__name__)"
    assert bare(work, code).returncode == 0 and ran.exists()  # without the harness: the policy's code ran
    ran.unlink()
    assert python(site, work, code) == "json" and not ran.exists()
    assert python(site, work, "import simplejson; print(simplejson.__file__)").startswith(str(work))  # a test's import


def test_pytests_rewrite_hook_and_namespace_portions_search_roots_folders_first(folders, tmp_path):
    """Red team F1 and F3: pytest's assertion-rewriting hook (ahead of every finder) searched the whole path for the
    plugins' modules it rewrites, the working directory first; a namespace package's portions listed the
    working directory's first. Every search of the path finder is trusted-first now."""
    site, work = folders
    ran = tmp_path / "ran"
    plant(work / "sub" / "pytest_timeout.py", MARK.format(str(ran)) + "\n")
    plant(work / "google" / "protobuf" / "__init__.py", MARK.format(str(ran)) + "\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(f"import google.protobuf\ndef test_a():\n    assert not google.protobuf"
                                     f".__file__.startswith({str(work)!r})\n")
    done = python(site, work / "sub", str(tests), args=("-m", "pytest", "-q", "-p", "no:cacheprovider"), check=False)
    assert done.returncode == 0 and not ran.exists(), done.stdout + done.stderr


def test_a_policy_folder_first_on_pythonpath_cannot_replace_the_start_up(folders, tmp_path):
    """Red team F2: `export PYTHONPATH=/app/src:$PYTHONPATH` put the policy's sitecustomize.py ahead of sandforge's:
    the harness never started. It starts from the user site's .pth first, and site's `import sitecustomize` is a
    library's import statement: root's folders only."""
    site, work = folders
    ran = tmp_path / "ran"
    plant(work / "src" / "sitecustomize.py", MARK.format(str(ran)) + "\n")
    plant(work / "json.py", "raise SystemExit('shadow imported')\n")
    path = os.pathsep.join([str(work / "src"), str(site / "py")])
    assert "/work/" not in python(site, work, "import json; print(json.__file__)", pythonpath=path, exe=BASE)
    assert not ran.exists()


def test_an_answer_keeps_pythons_order_and_a_namespace_portion_does_not_outrank_a_module(folders, tmp_path):
    site, work = folders
    plant(work / "statistics.py", "SPREAD = 1\n")
    assert python(site, work, "import statistics; print(statistics.SPREAD)", answers="statistics") == "1"
    assert python(site, work, "import statistics; print(hasattr(statistics, 'SPREAD'))") == "False"
    lib = tmp_path / "lib"
    (lib / "helpers").mkdir(parents=True)  # a folder without __init__: only a namespace portion
    plant(work / "helpers.py", "NAME = 'module'\n")
    assert python(site, work, "import helpers; print(helpers.NAME)", extra=[str(lib)]) == "module"


def test_metadata_comes_from_roots_folders_only(folders):
    """And stays so after the importlib_metadata backport (red team F4), which deletes the path finder's own
    distribution finder: sandforge's is its own finder."""
    site, work = folders
    dist = work / "evil-1.0.dist-info"
    plant(dist / "METADATA", "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    plant(dist / "entry_points.txt", "[pytest11]\nevil = evilplug\n")
    code = ("import importlib.metadata as m; print(sorted({d.metadata['Name'] for d in m.distributions()} & "
            "{'evil', 'pytest'}), [e.name for e in m.entry_points(group='pytest11') if e.name == 'evil'])")
    assert "'evil'" in bare(work, code).stdout
    assert python(site, work, code) == "['pytest'] []"
    vendored = os.path.join(os.path.dirname(__import__("setuptools").__file__), "_vendor")
    assert python(site, work, "import importlib_metadata; " + code, extra=[vendored]) == "['pytest'] []"


def test_a_site_packages_a_service_user_owns_is_still_trusted(folders, tmp_path):
    """Red team H1: trust asked for root's ownership, so an image whose packages belong to another user (conda's
    `jovyan`) lost every plugin. Trusted now means: the policy cannot write it."""
    site, work = folders
    lib = tmp_path / "conda"
    (lib / "tool-1.0.dist-info").mkdir(parents=True)
    (lib / "tool-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: tool\nVersion: 1.0\n")
    (lib / "tool.py").write_text("NAME = 'tool'\n")
    subprocess.run(["chown", "-R", "1234:100", str(lib)], check=True)
    lib.chmod(0o2775)  # group-writable, by a group the policy is not in
    code = "import importlib.metadata as m, tool; print(m.version('tool'), tool.NAME)"
    assert python(site, work, code, extra=[str(lib)]) == "1.0 tool"


def test_the_next_sitecustomize_still_runs(folders, tmp_path):
    site, work = folders
    image = tmp_path / "image-site"
    image.mkdir()
    (image / "sitecustomize.py").write_text("import builtins\nbuiltins.IMAGE_SITE = True\n")
    plant(work / "sitecustomize.py", "import builtins\nbuiltins.POLICY_SITE = True\n")
    code = "import builtins; print(getattr(builtins, 'IMAGE_SITE', False), getattr(builtins, 'POLICY_SITE', False))"
    assert python(site, work, code, extra=[str(work), str(image)]) == "True False"


def test_a_root_policy_gets_no_start_up(folders):
    site, work = folders
    env = {**grader_env(site), "SANDFORGE_POLICY_IDS": "0 0"}
    plant(work / "json.py", "X = 1\n")
    done = subprocess.run([sys.executable, "-c", "import json, sys; print(hasattr(json, 'X'), sys._sandforge_imports)"],
                          cwd=work, env=env, capture_output=True, text=True)
    assert done.stdout.split() == ["True", "True"], done.stderr


def test_path_keeps_only_the_folders_the_policy_cannot_write(folders, tmp_path):
    """Red team F6: an image's `ENV PATH=/app/.venv/bin:$PATH` put the policy's folder first: its `python3` ran
    as root."""
    site, work = folders
    venv_bin = work / ".venv" / "bin"
    plant(venv_bin / "python3", "#!/bin/sh\necho policy\n")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    path = f"{venv_bin}:{shared}:relative:/usr/bin:/no/such/dir:/bin"
    env = {"PATH": path, "SANDFORGE_POLICY_IDS": f"{NOBODY} {NOBODY}"}
    kept = subprocess.run(["/bin/bash", str(site / "path.sh")], env=env, capture_output=True, text=True).stdout
    assert kept == "/usr/bin:/bin"
    env["SANDFORGE_POLICY_IDS"] = "0 0"
    assert subprocess.run(["/bin/bash", str(site / "path.sh")], env=env, capture_output=True, text=True).stdout == path


def test_answer_modules_are_the_named_files_stems():
    assert startup.answer_modules(["/app/statistics.py", "./solver.py", "lib/json.py", "x-y.py", "notes.txt",
                                   "/app/calendar/__init__.py"]) == ("statistics", "solver", "json", "calendar")


def git_repo(root, owner=65534):
    """A repository at root/proj with one commit and one change, its .git/config naming commands, owned by owner."""
    repo = root / "proj"

    def run(*args):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True)

    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    run("config", "user.email", "policy@example.invalid")
    run("config", "user.name", "policy")
    (repo / "f.txt").write_text("one\n")
    run("add", "f.txt")
    run("commit", "-qm", "one")
    (repo / "f.txt").write_text("one\ntwo\n")
    ran = root / "ran"
    run("config", "core.fsmonitor", f"touch {ran}/fsmonitor; false")
    run("config", "diff.evil.textconv", f"sh -c 'touch {ran}/textconv; cat \"$1\"' --")
    (repo / ".gitattributes").write_text("*.txt diff=evil\n")
    hooks = repo / ".git" / "hooks"
    (hooks / "post-index-change").write_text(f"#!/bin/sh\ntouch {ran}/hook\n")
    (hooks / "post-index-change").chmod(0o755)
    ran.mkdir(mode=0o777)
    subprocess.run(["chown", "-R", str(owner), str(repo)], check=True)
    return repo, ran


def wrapped_git(site, *args, cwd):
    return subprocess.run(["bash", str(site / "git.sh"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def git_site(folders):
    return folders[0]


def test_roots_git_reads_the_policys_repository_and_runs_nothing_it_configures(git_site, tmp_path):
    repo, ran = git_repo(tmp_path)
    refused = subprocess.run(["git", "status"], cwd=repo, capture_output=True, text=True)
    assert refused.returncode == 128 and "dubious ownership" in refused.stderr  # what a root check got before
    status = wrapped_git(git_site, "status", "--porcelain", cwd=repo)
    assert status.returncode == 0 and " M f.txt" in status.stdout, status.stderr
    diff = wrapped_git(git_site, "-C", str(repo), "diff", "HEAD", cwd=tmp_path)
    assert "+two" in diff.stdout, diff.stderr
    assert "one" in wrapped_git(git_site, "log", "--format=%s", cwd=repo / ".git").stdout
    assert sorted(p.name for p in ran.iterdir()) == []  # no fsmonitor, textconv or hook ran
    assert (repo / ".git" / "index").stat().st_uid == 65534  # the policy's index was not rewritten as root
    assert not [p for p in git_site.glob("git.*") if p.is_dir()]  # the view is gone


def test_a_linked_index_is_not_written_through(git_site, tmp_path):
    repo, _ = git_repo(tmp_path)
    target = tmp_path / "reward.json"
    target.write_text('{"reward": 0}')
    index = repo / ".git" / "index"
    index.unlink()
    index.symlink_to(target)
    wrapped_git(git_site, "status", "--porcelain", cwd=repo)
    wrapped_git(git_site, "add", "f.txt", cwd=repo)
    assert target.read_text() == '{"reward": 0}'


def test_a_repository_root_owns_gets_gits_own_behaviour(git_site, tmp_path):
    repo, ran = git_repo(tmp_path, owner=0)
    done = wrapped_git(git_site, "status", "--porcelain", cwd=repo)
    assert done.returncode == 0 and (ran / "fsmonitor").exists()  # root's own repository: its config is root's


def uv(site, script, cwd, env=None):
    """``script`` run by bash with the harness's uv, uvx, apt-get and curl functions, as a test.sh would; (exit code,
    its output)."""
    prelude = (f"uv() {{ bash {site / 'uv.sh'} uv \"$@\"; }}\nuvx() {{ bash {site / 'uv.sh'} uvx \"$@\"; }}\n"
               f"apt-get() {{ bash {site / 'apt.sh'} apt-get \"$@\"; }}\ncurl() {{ bash {site / 'curl.sh'} curl \"$@\"; }}\n"
               "export -f uv uvx apt-get curl\n")
    done = subprocess.run(["bash", "-c", prelude + script], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=env)
    return done.returncode, done.stdout + done.stderr


def test_uv_venv_replaces_what_stands_there_and_refuses_what_it_does_not_know(folders):
    """Red team F7: options it guessed the arity of made the venv elsewhere (the last word won) and left the
    planted activate for test.sh to source as root."""
    site, work = folders
    plant(work / ".t" / "bin" / "activate", "echo PLANTED\n")
    code, out = uv(site, "uv venv .t && source .t/bin/activate && echo sourced $VIRTUAL_ENV", work)
    assert code == 0 and f"sourced {work}/.t" in out and "PLANTED" not in out, out
    plant(work / ".u" / "bin" / "activate", "echo PLANTED\n")
    code, out = uv(site, "uv venv .u --index-strategy unsafe-best-match --frobnicate x; source .u/bin/activate; "
                   "echo went on", work)
    assert code != 0 and "PLANTED" not in out and "went on" not in out, out
    assert "does not know" in out


def test_uvx_keeps_its_options_as_harbors_own_test_sh_template_writes_them(folders):
    """#58: `uvx --with pytest==8.4.1 --with pytest-json-ctrf==0.3.5 pytest ...` (Harbor's `harbor tasks init` template)
    lost its options to the stand-in's global-option skip: it ran `pytest==8.4.1 ...` and exited 127, so such a task
    scored 0 even with pytest in its image. Its options are `uv tool run`'s; `uvx name@version` checks the version."""
    site, work = folders
    code, out = uv(site, "uvx --with pytest==8.4.1 -p 3.13 pytest --version", work)
    assert code == 0 and re.search(r"pytest \S+ is installed", out), out
    code, out = uv(site, "uvx --with no-such-package-anywhere pytest --version", work)
    assert code == 1 and "no-such-package-anywhere" in out, out
    code, out = uv(site, "uvx pytest@8 --version", work)
    assert code == 0 and re.search(r"pytest \S+ is installed \(asked for ==8\)", out), out
    code, out = uv(site, "uvx --from pytest pytest --version; uvx --frobnicate pytest", work)
    assert "does not know" in out and code != 0, out


def test_harbors_own_template_lines_run_offline(folders, tmp_path):
    """#58: Harbor's `harbor tasks init` test.sh starts `set -euo pipefail; apt-get update; apt-get install -y curl;
    curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh; source "$HOME/.local/bin/env"`: offline every line failed
    and the script stopped before its tests. apt-get keeps the image's lists and installs what the image has (and
    names what it lacks); uv's installer is not fetched (uv is the stand-in); any other URL is the real curl's."""
    site, work = folders
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    template = ("set -euo pipefail\napt-get update\napt-get install -y --no-install-recommends bash coreutils\n"
                "curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh\nsource \"$HOME/.local/bin/env\"\n"
                "uvx --with pytest pytest --version\necho reached the tests\n")
    code, out = uv(site, template, work, env)
    assert code == 0 and "reached the tests" in out and (tmp_path / "home" / ".local" / "bin" / "env").exists(), out
    code, out = uv(site, "set -e; apt-get install -y no-such-package-anywhere; echo went on", work, env)
    assert code == 100 and "not installed" in out and "no-such-package-anywhere" in out and "went on" not in out, out
    code, out = uv(site, "apt-get dist-upgrade", work, env)
    assert code == 100 and "not available in a sandbox" in out, out
    code, out = uv(site, "curl --version", work, env)
    assert code == 0 and out.startswith("curl "), out  # the image's own curl


def test_uv_run_and_pip_install_offline(folders):
    site, work = folders
    plant(work / "reqs.txt", f"#!/bin/sh\ntouch {work}/ran\n")
    (work / "reqs.txt").chmod(0o755)
    code, out = uv(site, "uv run --with-requirements reqs.txt python3 -c 'print(42)'", work)
    assert not (work / "ran").exists() and "not installed" in out and code == 1, out  # read, never run
    code, out = uv(site, "uv pip install pytest && uv run -m pytest --version", work)
    assert code == 0 and "pytest" in out, out
    code, out = uv(site, "uv pip install no-such-package-anywhere", work)
    assert code == 1 and "no-such-package-anywhere" in out, out
