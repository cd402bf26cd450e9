"""The import rules of ARCHITECTURE.md, read from ARCHITECTURE.md itself and checked against every module's imports (ast,
imports inside functions included), and no import circle anywhere in the package.

The rules are the fenced block under "## Which part may import which": one line per part, ``part -> parts it may
import[; never module, ...]`` (``everything`` for the job). A module's part is its folder: ``models/`` is
``sandforge.models``, ``sandforge/grading/`` is the grading room, part ``grading``, and the other files of
``sandforge/`` are the core, part ``sandforge``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("sandforge", "grading", "models", "engine", "sandbox", "environments", "verifiers", "rollout", "trainer", "job")
FOLDERS = {"sandforge": "sandforge", "grading": "sandforge/grading"}  # the rest: the part's own name at the root


def read_rules(architecture: Path) -> dict[str, tuple[set[str], set[str]]]:
    """part -> (parts it may import, top-level modules it must never import), from ARCHITECTURE.md."""
    text = architecture.read_text()
    section = text.split("## Which part may import which", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    rules = {}
    for line in block.strip().splitlines():
        part, _, rest = (x.strip() for x in line.partition("->"))
        allowed, _, never = rest.partition(";")
        parts = set(PARTS) if allowed.strip() == "everything" else {p.strip() for p in allowed.split(",")}
        banned = {m.strip() for m in never.replace("never", "").split(",") if m.strip()}
        rules[part] = (parts, banned)
    return rules


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every source file of the package (the folders of pyproject's package-dir)."""
    found = {}
    for part in PARTS:
        folder = root / FOLDERS.get(part, part)
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            names = [] if rel.name == "__init__" and rel.parent == Path(".") else list(rel.parts)
            if names and names[-1] == "__init__":
                names = names[:-1]
            prefix = ["sandforge"] if part == "sandforge" else ["sandforge", part]
            found[".".join(prefix + names)] = path  # sandforge/grading/ is met twice, as the same module names
    return found


def part_of(module: str) -> str:
    second = module.split(".")[1] if module.count(".") else ""
    return second if second in PARTS[1:] else "sandforge"


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file; ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``. Relative imports are resolved against ``module``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.append((target if target in known else base, node.lineno))
    return list(dict.fromkeys(out))  # `from m import a, b`: one import of m


def violations(root: Path, rules: dict[str, tuple[set[str], set[str]]]) -> list[str]:
    known = modules(root)
    problems = []
    for module, path in known.items():
        part = part_of(module)
        allowed, banned = rules[part]
        for target, line in imports(module, path, known):
            where = f"{path.relative_to(root)}:{line}"
            top = target.split(".")[0]
            if top in banned:
                problems.append(f"{where}: {part}/ imports {target}, which ARCHITECTURE.md says it never does")
            if top == "sandforge" and part_of(target) not in allowed:
                problems.append(f"{where}: {part}/ imports {target} ({part_of(target)}/); ARCHITECTURE.md lets "
                                f"{part}/ import only {', '.join(sorted(allowed))}")
    return problems


def circles(root: Path) -> list[list[str]]:
    """Every import circle (a strongly connected set of two or more modules, or a module importing itself)."""
    known = modules(root)
    graph = {m: {t for t, _ in imports(m, p, known) if t in known} for m, p in known.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_follows_the_rules_of_architecture_md():
    problems = violations(ROOT, read_rules(ROOT / "ARCHITECTURE.md"))
    assert not problems, "imports that break ARCHITECTURE.md's rules:\n" + "\n".join(problems)


def test_no_module_imports_itself_back():
    found = circles(ROOT)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_architecture_md_names_every_module_by_its_path():
    """The map newcomers read names every source file of the package (packages' ``__init__.py`` aside), so a new
    module comes with its line there; tests/test_quickstart.py checks the quickstart's own files against an import
    trace of its processes."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    paths = sorted(str(p.relative_to(ROOT)) for p in modules(ROOT).values() if p.name != "__init__.py")
    assert len(paths) > 100 and not [p for p in paths if p not in text], [p for p in paths if p not in text]


def test_the_rules_cover_every_part():
    assert set(read_rules(ROOT / "ARCHITECTURE.md")) == set(PARTS)


def test_the_engine_uses_only_the_core_and_models():
    allowed, banned = read_rules(ROOT / "ARCHITECTURE.md")["engine"]
    assert allowed == {"sandforge", "models", "engine"} and {"ray", "docker", "deepspeed"} <= banned


def test_only_the_sandbox_imports_docker():
    rules = read_rules(ROOT / "ARCHITECTURE.md")
    assert [part for part, (_, banned) in rules.items() if "docker" not in banned] == ["sandbox"]


def test_grading_is_reached_only_by_the_graders():
    """The grader's start-up and the shadow set-aside are grading's own: the core does not import them, and they import
    nothing but the core (no Docker: a grader sees the ``Sandbox`` protocol only)."""
    rules = read_rules(ROOT / "ARCHITECTURE.md")
    assert {part for part, (allowed, _) in rules.items() if "grading" in allowed} == {
        "grading", "environments", "verifiers", "job"}
    allowed, banned = rules["grading"]
    assert allowed == {"sandforge", "grading"} and {"docker", "torch", "ray", "deepspeed"} <= banned


# --- the checker itself, on a planted tree --------------------------------------------------------------------------


def planted(tmp_path: Path, files: dict[str, str]) -> Path:
    for part in PARTS:
        (tmp_path / FOLDERS.get(part, part)).mkdir()
        (tmp_path / FOLDERS.get(part, part) / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


RULES = {"sandforge": ({"sandforge"}, set()), "grading": ({"sandforge", "grading"}, {"docker"}),
         "sandbox": ({"sandforge", "sandbox"}, set()), "models": ({"sandforge", "models"}, set()),
         "engine": ({"sandforge", "models", "engine"}, {"ray"}),
         "environments": ({"sandforge", "environments"}, set()), "verifiers": ({"sandforge", "verifiers"}, {"docker"}),
         "rollout": (set(PARTS) - {"job", "trainer"}, set()), "trainer": ({"sandforge", "models", "trainer"}, set()),
         "job": (set(PARTS), set())}


def test_the_checker_finds_an_upward_import_a_banned_module_and_a_circle(tmp_path):
    root = planted(tmp_path, {
        "sandforge/types.py": "X = 1\n",
        "models/net.py": "def f():\n    from sandforge.trainer.rank import R  # inside a function: still counted\n",
        "trainer/rank.py": "from sandforge.models import net\nR = 1\n",
        "verifiers/checks.py": "import docker\nfrom .grader import g\n",
        "verifiers/grader.py": "from sandforge.verifiers.checks import x\ng = 1\n",
        "job/cli.py": "from sandforge.trainer.rank import R\nfrom sandforge.models.net import f\n",
        "engine/core.py": "from sandforge.rollout.agent import run_episode\nfrom sandforge.models import net\n",
    })
    problems = violations(root, RULES)
    assert any(p.startswith("models/net.py:2: models/ imports sandforge.trainer.rank") for p in problems), problems
    assert any(p.startswith("verifiers/checks.py:1: verifiers/ imports docker") for p in problems), problems
    assert any(p.startswith("engine/core.py:1: engine/ imports sandforge.rollout.agent") for p in problems), problems
    assert len(problems) == 3, problems  # trainer -> models, engine -> models and job -> anything are allowed
    assert sorted(circles(root)) == [["sandforge.models.net", "sandforge.trainer.rank"],
                                     ["sandforge.verifiers.checks", "sandforge.verifiers.grader"]]


def test_the_checker_keeps_docker_in_the_sandbox_and_grading_in_its_room(tmp_path):
    rules = dict(RULES, environments=({"sandforge", "grading", "sandbox", "environments"}, {"docker"}),
                 verifiers=({"sandforge", "grading", "verifiers"}, {"docker"}), job=(set(PARTS), {"docker"}))
    root = planted(tmp_path, {
        "sandbox/daemon.py": "import docker\nimport docker.errors\n",  # the one part that may
        "environments/env.py": "from sandforge.sandbox.daemon import docker_client\n",
        "environments/images.py": "def f():\n    import docker.errors\n",
        "job/preflight.py": "from docker.utils import parse_bytes\n",
        "verifiers/command.py": "from sandforge.grading import startup\n",
        "sandforge/config.py": "from sandforge.grading.startup import prepare\n",
        "sandforge/grading/startup.py": "from sandforge.types import Sandbox\nfrom sandforge.sandbox import daemon\n",
        "sandforge/grading/shadows.py": "import docker\n",
        "sandforge/types.py": "Sandbox = object\n",
    })
    problems = violations(root, rules)
    expected = ["environments/images.py:2: environments/ imports docker.errors",
                "job/preflight.py:1: job/ imports docker.utils",
                "sandforge/config.py:1: sandforge/ imports sandforge.grading.startup (grading/)",
                "sandforge/grading/startup.py:2: grading/ imports sandforge.sandbox.daemon (sandbox/)",
                "sandforge/grading/shadows.py:1: grading/ imports docker"]
    assert sorted(p.split(",")[0].split(";")[0] for p in problems) == sorted(expected), problems
