"""``sandforge harbor check TASK_DIR...``: the first thing to run on a new Harbor task set. For each task: build its
image here (its base mapped when needed), replay its oracle as Harbor does and a no-op, grade both, and print one row:
image, oracle reward, no-op reward, seconds, and a one-line reason where something is off.

The oracle runs as Harbor runs it: ``solution/`` uploaded to ``/solution``, ``solve.sh`` executed as a file (by its
shebang) by the task's agent user (root, or the non-root user of ``--mode hardened``) in the image's WORKDIR, with
``DEBIAN_FRONTEND=noninteractive`` under ``[solution] env``, its output in ``/logs/agent/oracle.txt``. ``--set
sandbox.KEY=VALUE`` (or a job's ``--config``) sets the sandbox, ``sandbox.base_map`` among it.
The no-op grades a sandbox nobody touched. A task is fine when the oracle scores 1 and the no-op 0.
"""

from __future__ import annotations

import re
import shlex
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from sandforge.environments.harbor.settings import shell_exports
from sandforge.environments.harbor.tasks import ORACLE_ENV, solution_mode

NETWORK = re.compile(r"\b(curl|wget)\b|\bpip3?\s+install\b|\buv\s+(pip|sync|run|tool|add)\b|\bapt(-get)?\s+(install|"
                     r"update)\b|\bnpm\s+(install|ci)\b")
RUN_PREFIX = "harbor-check"  # each `harbor check` labels its sandboxes with a run id of its own


@dataclass
class CheckRow:
    task: str
    image: str = "-"
    oracle: float | None = None
    noop: float | None = None
    seconds: float = 0.0
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.oracle == 1.0 and self.noop == 0.0


def needs_network(task_dir: Path) -> str | None:
    """What in tests/test.sh reaches for the network at test time (the sandbox has none), or None."""
    test = task_dir / "tests" / "test.sh"
    m = NETWORK.search(test.read_text(errors="replace")) if test.is_file() else None
    return m.group(0) if m else None


def _tail(text: str, n: int = 160) -> str:
    line = " | ".join(x.strip() for x in text.strip().splitlines()[-3:] if x.strip())
    return line[-n:]


def malformed_note(which: str, reward) -> str | None:
    """The note for a run (``which``: oracle, noop) whose test.sh wrote a reward that is not one (out of [0, 1],
    ``nan``, not JSON): in training such an episode scores 0 (cause ``malformed``), and since the policy's answer can
    drive a metric there, the row says so; None for a usable reward."""
    if "malformed" not in reward.zero_causes:
        return None
    return f"{which}: test.sh wrote a reward that is not one, trained on as 0 ({_tail(reward.reason or '', 200)})"


def upload_solution(sandbox, solution: Path) -> None:
    """``solution/`` into ``/solution`` as root, readable by every user, scripts executable."""
    sandbox.exec("rm -rf /solution && install -d -m 0755 /solution", timeout=30, user="root", session=False)
    for f in sorted(p for p in solution.rglob("*") if p.is_file()):
        sandbox.put_file(f"/solution/{f.relative_to(solution).as_posix()}", f.read_bytes(), user="root",
                         mode=solution_mode(f))
    sandbox.exec("chmod -R a+rX /solution", timeout=30, user="root", session=False)


ORACLE_LOG = "/logs/agent/oracle.txt"


def oracle_command(env: dict[str, str]) -> str:
    """solve.sh executed as a file (its shebang picks the interpreter; bash reads one without), its output to
    ``ORACLE_LOG`` as in Harbor, then the log's end on stdout and solve.sh's exit status."""
    return (f"{shell_exports({**ORACLE_ENV, **env})}/solution/solve.sh > {ORACLE_LOG} 2>&1; rc=$?\n"
            f"tail -c 4000 {ORACLE_LOG}; exit $rc")


def graded(sandbox, task, task_dir: Path, timeout: float, oracle: bool):
    """The oracle's run (``oracle``) or a no-op's, graded: (a one-line account of solve.sh's failure or "", the
    reward). A multi-step task runs step by step as an episode does (rollout/steps.py): each step's set-up, its
    solve.sh, its checks, a ``min_reward`` that stops it; the reward made from the steps'."""
    from sandforge.rollout import steps
    from sandforge.verifiers.checks import score_task

    if not task.steps:
        failure = run_oracle(sandbox, task, task_dir / "solution", timeout) if oracle else ""
        return failure, score_task(sandbox, task)
    steps.first_prepare(sandbox, task)
    results, failures, note = [], [], ""
    for i, step in enumerate(task.steps):
        if i > 0 and (why := steps.prepare(sandbox, step)):
            results.append(steps.StepResult(step.name, steps.unprepared(why)))
            note = f"the steps after {step.name} did not run"
            break
        if oracle and (failure := run_oracle(sandbox, task, task_dir / "steps" / step.name / "solution",
                                             step.agent_timeout or timeout)):
            failures.append(f"{step.name}: {failure}")
        reward = score_task(sandbox, steps.step_task(task, i))
        results.append(steps.StepResult(step.name, reward))
        if steps.stops_after(step, reward) and i + 1 < len(task.steps):
            note = f"step {step.name} scored {reward.value:g}, below its min_reward {step.min_reward:g}"
            break
    return "; ".join(failures), steps.combine(task, results, note)


def run_oracle(sandbox, task, solution: Path, timeout: float) -> str:
    """solve.sh as Harbor runs it: ``solution`` (a task's solution/, or a step's) uploaded to ``/solution``,
    ``/logs/agent`` in place (the agent's user may write it), the file executed by the agent's user in the WORKDIR
    with DEBIAN_FRONTEND=noninteractive and ``[solution] env``; returns a one-line account of a failure ("" when it
    exited 0)."""
    if not (solution / "solve.sh").is_file():
        return "no solution/solve.sh"
    upload_solution(sandbox, solution)
    user = sandbox.spec.user
    owner = "" if user in ("root", "0", "0:0") else f" -o {shlex.quote(user.split(':')[0])}"
    sandbox.exec(f"install -d -m 0755 /logs && install -d -m 0755{owner} /logs/agent", timeout=30, user="root",
                 session=False)
    result = sandbox.exec(oracle_command(task.setup.get("solution_env") or {}), timeout=timeout, user=user,
                          workdir=sandbox.spec.workdir, session=False)
    if result.timed_out:
        return f"solve.sh timed out after {timeout:g}s: {_tail(result.output)}"
    if result.exit_code != 0:
        return f"solve.sh exited {result.exit_code}: {_tail(result.output)}"
    return ""


def check_task(task_dir: Path, mode: str, base_map, sandbox_cfg, client, run_id: str) -> CheckRow:
    from sandforge.environments.harbor.dockerfile import BaseImageError
    from sandforge.environments.harbor.env import HarborEnv
    from sandforge.environments.harbor.healthcheck import Healthcheck, wait_healthy
    from sandforge.environments.harbor.tasks import HarborTaskError, load_tasks, with_base_map
    from sandforge.sandbox.docker_sandbox import DockerSandbox
    from sandforge.sandbox.images import ImageError, build_images
    from sandforge.sandbox.job_spec import grading_spec, sandbox_spec
    from sandforge.types import SandboxError
    from sandforge.verifiers.checks import SERVICE_STOPPED

    row = CheckRow(task=task_dir.name)
    start = time.monotonic()
    try:
        [task], images = load_tasks(task_dir, mode)
        row.task = task.id
        row.notes += [f"not honoured: {x}" for x in task.setup.get("not_honoured", [])]
        net = needs_network(task_dir)  # said only where the oracle falls short: apt-get and uv's installer run offline
        contexts = {name: with_base_map(ctx, base_map) for name, ctx in images.items()}
        tags = build_images([], client=client, show_progress=False, contexts=contexts)
        # a FROM mapped to the local base, said in one line (the task's image, then a separate verifier's)
        row.notes = [note for ctx in contexts.values() for note in ctx.prepare.notes] + row.notes
        row.image = tags[task.image]
        spec = sandbox_spec(sandbox_cfg, tags[task.image], HarborEnv, task.sandbox, client)
        if task.grading_image is not None:  # test.sh in a separate verifier's own sandbox
            spec = replace(spec, grading=grading_spec(sandbox_cfg, tags[task.grading_image], HarborEnv,
                                                      task.sandbox, client))
        timeout = float(task.agent_timeout or 1800.0)
        has_oracle = bool(task.solution) or (task_dir / "solution" / "solve.sh").is_file()
        if not has_oracle:
            row.reason = ("no solve.sh in every step's solution/" if task.steps else "no solution/solve.sh") + \
                ": the oracle cannot be checked"
        for which in ("oracle", "noop") if has_oracle else ("noop",):
            sandbox = DockerSandbox.create(spec, run_id, client=client)
            try:
                if (health := task.setup.get("healthcheck")) is not None:  # as HarborEnv, before the agent
                    wait_healthy(sandbox, Healthcheck.from_dict(health))
                failure, reward = graded(sandbox, task, task_dir, timeout, which == "oracle")
            finally:
                sandbox.close()
            setattr(row, which, reward.value)
            if note := malformed_note(which, reward):
                row.notes.append(note)
            if which == "oracle" and reward.value != 1.0:
                why = reward.reason or ""
                if "service_stopped" in reward.zero_causes:  # the one line that says why, in full
                    why = why[why.find(SERVICE_STOPPED):]
                row.reason = failure or f"oracle scored {reward.value:g}: {_tail(why, 400)}"
                if net:
                    row.notes.append(f"test.sh may need the network ({net}); sandboxes have none")
            elif which == "noop" and reward.value != 0.0 and not row.reason:
                row.reason = f"doing nothing scores {reward.value:g}: the tests do not check the work"
    except (HarborTaskError, BaseImageError, ImageError, SandboxError) as e:
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        row.reason = lines[0] + (f" | {lines[-1][-200:]}" if len(lines) > 1 else "")  # a build's last output line
    except Exception as e:  # noqa: BLE001 - one task's trouble is its row, not the command's end
        row.reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    row.reason = row.reason.replace(f"{task_dir.resolve()}/", "").replace(str(task_dir.resolve()), task_dir.name)
    row.seconds = time.monotonic() - start
    return row


def sandbox_settings(config: Path | None = None, sets: list[str] | tuple[str, ...] = ()):
    """The sandbox settings a check runs under: a job's ``sandbox`` section (``config``), with ``sets`` (``--set
    sandbox.KEY=VALUE``, e.g. ``sandbox.base_map={"ubuntu:*": base}``) over it, and no warm pool. ConfigError names a
    bad key or value."""
    from sandforge.config import ConfigError, config_from_raw, load_config

    other = [s for s in sets if not s.partition("=")[0].strip().startswith("sandbox.")]
    if other:
        raise ConfigError(f"--set {other[0]!r}: harbor check takes sandbox settings only (--set sandbox.KEY=VALUE, "
                          "e.g. sandbox.base_map='{\"ubuntu:*\": base}' or sandbox.memory=2g)")
    cfg = load_config(config, list(sets)) if config else config_from_raw({}, "harbor check", list(sets))
    return cfg.sandbox.model_copy(update={"warm_pool": 0})


def task_dirs(paths: list[Path]) -> list[Path]:
    """Each path a task folder, or a folder of them."""
    from sandforge.environments.harbor.tasks import is_task_dir

    out = []
    for p in paths:
        out += [p] if is_task_dir(p) else sorted(d for d in p.iterdir() if d.is_dir() and is_task_dir(d))
    return list({d.resolve(): d for d in out}.values())  # a folder named twice is checked once


def labels(dirs: list[Path]) -> list[str]:
    """What each task folder is called in the check's rows: its name, or where two folders share a name, its path
    from the nearest folder above them that tells them apart."""
    resolved = [d.resolve() for d in dirs]
    out = []
    for d in resolved:
        alike = [o for o in resolved if o.name == d.name]
        depth = 1
        while len({o.parts[-depth:] for o in alike}) < len(alike) and depth < len(d.parts):
            depth += 1
        out.append("/".join(d.parts[-depth:]) if len(alike) > 1 else d.name)
    return out


def table(rows: list[CheckRow]) -> Table:
    t = Table(title=f"Harbor tasks: {sum(r.ok for r in rows)}/{len(rows)} fine (oracle 1, no-op 0)")
    for col in ("task", "image", "oracle", "no-op", "seconds", "reason / notes"):
        t.add_column(col, overflow="fold")
    fmt = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
    for r in rows:
        image = "built" if r.image != "-" else "failed"
        said = "; ".join([r.reason] * bool(r.reason) + r.notes)
        t.add_row(escape(r.task), image, fmt(r.oracle), fmt(r.noop), f"{r.seconds:.0f}", escape(said))
    return t


def check(paths: list[Path], mode: str = "root", sandbox_cfg=None) -> list[CheckRow]:
    """Check every task under ``paths``, printing each row's task as it goes; the rows."""
    from sandforge.sandbox.daemon import docker_client
    from sandforge.sandbox.lifecycle import remove_run_containers
    from sandforge.job.console import console, phase

    sandbox_cfg = sandbox_cfg or sandbox_settings()
    client = docker_client()
    rows = []
    run_id = f"{RUN_PREFIX}-{uuid.uuid4().hex[:12]}"  # two checks at once on one host leave each other's sandboxes be
    try:
        dirs = task_dirs(paths)
        for d, label in zip(dirs, labels(dirs)):
            console.print(f"checking {label} ...", highlight=False, markup=False)
            with phase(f"checking {label}: image, oracle, no-op"):
                row = check_task(d, mode, sandbox_cfg.base_map, sandbox_cfg, client, run_id)
                if label != d.name:  # two task sets with a folder of one name: their rows must differ
                    row.task = f"{row.task} ({label})"
                rows.append(row)
    finally:
        remove_run_containers(run_id)
    return rows
