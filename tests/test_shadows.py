"""Which files a task's instruction names as its answer (sandforge/grading/shadows.py): those the shadow set-aside keeps."""

from __future__ import annotations

from sandforge.grading.shadows import answer_names, answer_paths


def test_the_python_files_an_instruction_names_are_found_in_prose_and_paths():
    text = ("Write `/app/statistics.py` and ./solver.py (see lib/json.py and /opt/tools/re.py). Then json.py again; "
            "not my_statistics.pyc, foo.python, or https://example.invalid/x/y.py?raw.")
    paths = answer_paths(text)
    assert paths[:5] == ("/app/statistics.py", "./solver.py", "lib/json.py", "/opt/tools/re.py", "json.py")
    assert not any(p.endswith(("pyc", "python")) for p in paths)


def test_only_the_files_at_the_top_of_the_workdir_are_kept():
    paths = ("/app/statistics.py", "./solver.py", "lib/json.py", "/opt/tools/re.py", "json.py", "/app/../app/csv.py")
    assert answer_names(paths, "/app") == ("statistics.py", "solver.py", "json.py", "csv.py")
    assert answer_names(paths, "/workspace/") == ("solver.py", "json.py")
    assert answer_names((), "/app") == ()
