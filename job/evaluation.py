"""Held-out evaluation, for a run (before RL, every ``eval.every`` steps, at the end: ``eval`` rows and eval.json) and
for ``sandforge eval CONFIG --checkpoint DIR`` (a policy directory, no trainer): a fixed set of held-out tasks, several
episodes each, summarised per environment.

The task set is the same every time it is built (seeds 0..n-1 of every family, split "heldout"), so numbers before
and after training compare the same tasks, and are compared task by task (``paired``: the mean and standard error of
each task's change in success rate: job/eval_compare.py). A pass's results are an ``EvalSummary``
(job/eval_summary.py), eval.json holds their JSON form. Sampled episodes run at ``eval.temperature`` (the rollout
temperature unless set), greedy ones at 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rich.table import Table

from sandforge.config import EnvironmentConfig, JobConfig
from sandforge.job.console import JobError
from sandforge.job.eval_compare import PairedComparison, Points, paired, points, rl_trained
from sandforge.job.eval_summary import EvalSummary, summarize
from sandforge.environments.task_sources import FiniteSource
from sandforge.job.task_sampler import env_source, with_reward_rule, with_success_at
from sandforge.types import Task, Trajectory


def heldout_tasks(envs: list[EnvironmentConfig], per_family: int, sources: list | None = None) -> list[Task]:
    """``per_family`` held-out tasks (an environment's ``eval_tasks_per_family`` where set) of every family of every
    configured environment, in a fixed order: seeds 0..n-1 of a generator, or the first n held-out tasks of a task
    file or folder (a family without held-out tasks there is left out). ``sources``: the environments' task sources,
    in order, as the run opened them (opened here when not given)."""
    tasks: list[Task] = []
    for i, env in enumerate(envs):
        n = env.eval_tasks(per_family)
        source = sources[i] if sources is not None else env_source(env)
        for family in env.families or source.families():
            if isinstance(source, FiniteSource):
                found = [t for t in source.tasks if t.family == family and t.split == "heldout"][:n]
            else:
                found = [source.task(family, seed, "heldout") for seed in range(n)]
            # success is the same reward as training's, at the same threshold
            tasks += [with_success_at(with_reward_rule(t, env.reward_rule), env.success_at) for t in found]
    return tasks


def metric_row(summary: EvalSummary) -> dict[str, float]:
    """The summary as flat metrics (``eval/success``, ``eval/success/<env>``, ``eval/pass@k/<env>``, ...; with a
    greedy evaluation ``eval/greedy/success`` and ``eval/greedy/success/<env>``)."""
    r = summary.rates
    row = {"eval/success": r.success, "eval/pass@k": r.pass_at_k, "eval/k": summary.k, "eval/failed": r.failed,
           "eval/stderr": r.stderr}
    if r.reward is not None:
        row["eval/reward"] = r.reward
    for env, e in summary.per_env.items():
        row[f"eval/success/{env}"] = e.success
        row[f"eval/pass@k/{env}"] = e.pass_at_k
        if e.reward is not None:
            row[f"eval/reward/{env}"] = e.reward
    if summary.greedy is not None:
        row["eval/greedy/success"] = summary.greedy.rates.success
        for env, e in summary.greedy.per_env.items():
            row[f"eval/greedy/success/{env}"] = e.success
    return row


def eval_temperature(cfg: JobConfig) -> float:
    """The temperature of held-out sampled episodes: ``eval.temperature``, else ``rollout.temperature``."""
    return cfg.rollout.temperature if cfg.eval.temperature is None else cfg.eval.temperature


@dataclass(frozen=True)
class HeldoutRun:
    """One held-out pass over the tasks: ``samples`` episodes of each at ``temperature``, in groups ``<tag>/<task id>``
    (the group names seed their sampling)."""

    tag: str
    tasks: tuple[Task, ...]
    samples: int
    temperature: float

    @property
    def groups(self) -> list[str]:
        return [f"{self.tag}/{task.id}" for task in self.tasks for _ in range(self.samples)]

    @property
    def episodes(self) -> list[Task]:
        return [task for task in self.tasks for _ in range(self.samples)]

    def label(self) -> str:
        how = "greedy" if self.temperature == 0 else f"at T={self.temperature:g}"
        return f"{how}: {len(self.tasks)} tasks x {self.samples}"


def heldout_run(cfg: JobConfig, tag: str, greedy: bool = False, per_family: int | None = None,
                samples: int | None = None, sources: list | None = None) -> HeldoutRun:
    """``eval.samples`` episodes of each held-out task at ``eval_temperature``; ``greedy``: one episode per task at
    temperature 0 (more would repeat it). ``per_family``: that many tasks of every family of every environment
    instead of the configured numbers; ``samples``: that many sampled episodes of each instead of ``eval.samples``."""
    envs = cfg.environments
    if per_family is not None:
        envs = [env.model_copy(update={"eval_tasks_per_family": per_family}) for env in envs]
    tasks = tuple(heldout_tasks(envs, cfg.eval.tasks_per_family, sources))
    if greedy:
        return HeldoutRun(tag, tasks, 1, 0.0)
    return HeldoutRun(tag, tasks, samples or cfg.eval.samples, eval_temperature(cfg))


def heldout_episodes(runs: list[HeldoutRun], collect: Callable[..., list[Trajectory]]
                     ) -> list[tuple[list[Trajectory], EvalSummary]]:
    """Run every pass of ``runs`` in one ``collect(tasks, groups, scripted, label, temperature)`` call, a temperature
    per episode: the workers start the longest episodes of all of them first, so the passes share one tail instead of
    each ending on its own slowest episodes. Per pass: its episodes and their summary (which records the
    temperature)."""
    tasks = [task for run in runs for task in run.episodes]
    groups = [group for run in runs for group in run.groups]
    temperatures = [run.temperature for run in runs for _ in run.episodes]
    trajs = collect(tasks, groups, scripted=False, label="held-out eval " + ", ".join(run.label() for run in runs),
                    temperature=temperatures)
    out = []
    for run in runs:
        mine = [t for t in trajs if t.group.startswith(f"{run.tag}/")]
        out.append((mine, summarize(mine, run.samples, run.temperature)))
    return out


def evaluation(cfg: JobConfig, collect: Callable[..., list[Trajectory]], tag: str,
               per_family: int | None = None, samples: int | None = None, sources: list | None = None
               ) -> tuple[list[Trajectory], EvalSummary]:
    """One held-out evaluation as configured: at ``eval.temperature`` (the rollout temperature unless set), plus
    greedy with ``eval.greedy`` (its summary the sampled one's ``greedy``, its episodes appended), both in one pass of
    the workers. ``per_family``: that many tasks per family everywhere, ``samples``: that many sampled episodes of each
    (the base evaluation's ``eval.base_tasks_per_family`` and ``eval.base_samples``); ``sources``: the run's opened
    task sources (``heldout_tasks``)."""
    runs = [heldout_run(cfg, tag, per_family=per_family, samples=samples, sources=sources)]
    if cfg.eval.greedy:
        runs.append(heldout_run(cfg, f"{tag}g", greedy=True, per_family=per_family, sources=sources))
    (trajs, summary), *greedy = heldout_episodes(runs, collect)
    if greedy:
        more, summary_g = greedy[0]
        summary = summary.at(greedy=summary_g)
        trajs = trajs + more
    return trajs, summary


@dataclass(frozen=True)
class Against:
    """``sandforge eval --against``: this evaluation against an earlier one of another checkpoint on the same
    held-out tasks, task by task (``paired``: this minus the earlier, in points) and overall (``delta``)."""

    file: str
    delta: Points
    paired: PairedComparison

    def to_json(self) -> dict:
        return {"file": self.file, "delta_points": self.delta.to_json(), "paired": self.paired.to_json()}

    def lines(self) -> list[str]:
        """The comparison in words, for the end of ``sandforge eval --against``."""
        lines = [f"against {self.file}: {self.paired.success.words()}"]
        if self.paired.greedy is not None:
            lines.append(f"  greedy: {self.paired.greedy.success.words()}")
        return lines + [f"  {env}: {p.words()}" for env, p in self.paired.per_env.items()]


def compared(summary: EvalSummary, earlier: EvalSummary, source: str) -> Against:
    pair = paired(summary, earlier)
    if pair is None:
        raise JobError(f"--against {source}: it holds no per-task results (not a `sandforge eval` summary, or one "
                       "written before summaries kept them)")
    return Against(source, points(summary, earlier), pair)


def read_against(path: Path) -> EvalSummary:
    """An earlier ``sandforge eval`` summary to compare with; refused in one line when it cannot be one (read before
    the fleet starts, not after the episodes)."""
    try:
        earlier = EvalSummary.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise JobError(f"--against {path}: cannot read it as an evaluation summary ({e})") from None
    if earlier.per_task is None:
        raise JobError(f"--against {path}: it holds no per-task results (not a `sandforge eval` summary, or one "
                       "written before summaries kept them)")
    return earlier


def evaluate_checkpoint(cfg: JobConfig, checkpoint: Path, out_file: Path, against: Path | None = None
                        ) -> EvalSummary:
    """``sandforge eval``: ``cfg.eval.samples`` episodes of each held-out task with the policy in ``checkpoint``, on the
    same fleet a run starts (without trainer ranks); writes the summary (success and pass@k, overall and per
    environment) to ``out_file`` and returns it. ``against``: an earlier ``sandforge eval`` summary (another
    checkpoint, the same config), compared task by task (``compared``, under ``against`` in the file)."""
    earlier = None if against is None else read_against(against)
    from sandforge.job.console import console, make_run_id, progress
    from sandforge.job.fleet.lifecycle import checkpoint_policy, open_fleet
    from sandforge.job.fleet.rollout_workers import collect_episodes, stop_if_all_failed

    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": checkpoint})})
    with open_fleet(cfg, make_run_id(f"{cfg.run.name}-eval"), frozenset({"engine", "workers"}),
                    policy=checkpoint_policy(checkpoint)) as fleet, progress() as bar:

        def collect(tasks, groups, scripted, label, temperature=None):
            trajs = collect_episodes(fleet.workers, tasks, groups, cfg.run.seed, 0, scripted, bar, label, temperature)
            stop_if_all_failed(trajs, label)
            return trajs

        _, summary = evaluation(cfg, collect, "eval")
    summary = summary.at(checkpoint=str(checkpoint))
    cmp = None if earlier is None else compared(summary, earlier, str(against))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(summary.to_json() | ({"against": cmp.to_json()} if cmp else {}), indent=1) + "\n")
    console.print(summary_table(summary))
    if cmp is not None:
        console.print("\n".join(cmp.lines()), soft_wrap=True, markup=False)
    console.print(f"[green]done[/]: {out_file}")
    return summary


def summary_table(summary: EvalSummary) -> Table:
    r = summary.rates
    at = f" at temperature {summary.temperature:g}" if summary.temperature is not None else ""
    table = Table(title=f"held-out success{at}: {r.tasks} tasks x {r.episodes // max(r.tasks, 1)} episodes")
    for column in ("environment", "tasks", "success (pass@1)", f"pass@{summary.k}", "mean reward", "failed episodes"):
        table.add_column(column)
    greedy = summary.greedy
    if greedy is not None:
        table.add_column("greedy")
    for env, e in [*summary.per_env.items(), ("all", r)]:
        g = None if greedy is None else greedy.rates if env == "all" else greedy.per_env.get(env)
        reward = "—" if e.reward is None else f"{e.reward:.3f} ± {e.reward_stderr or 0.0:.3f}"
        table.add_row(env, str(e.tasks), f"{100 * e.success:.1f}% ± {100 * e.stderr:.1f}",
                      f"{100 * e.pass_at_k:.1f}%", reward, str(e.failed),
                      *([f"{100 * g.success:.1f}%" if g else "—"] if greedy is not None else []))
    return table


def eval_line(summary: EvalSummary) -> str:
    """One evaluation during a run, in one line."""
    r = summary.rates
    envs = "  ".join(f"{env} {e.success:.2f}" for env, e in summary.per_env.items())
    when = "of the pretrained base" if summary.base else f"after step {summary.step}"
    if summary.temperature is not None:
        when += f" (T={summary.temperature:g})"
    greedy = f"  greedy {summary.greedy.rates.success:.2f}" if summary.greedy is not None else ""
    reward = f"  reward {r.reward:.3f}" if r.reward is not None else ""
    return (f"held-out eval {when}: success {r.success:.2f} ± {r.stderr:.2f}{greedy}{reward}  "
            f"pass@{summary.k} {r.pass_at_k:.2f}  ({envs})")


def eval_summary(record: EvalRecord) -> str:
    """Before -> after held-out success per environment (a run's ``EvalRecord``), for the end of a run."""
    if not record.history:
        return "held-out eval: nothing measured"
    b, a, base = record.history[0], record.history[-1], record.base
    delta, pair, head = points(a, b), paired(a, b), rl_trained(a, b, record.trained)

    def pct(s: EvalSummary | None, env: str | None = None) -> str:
        rates = None if s is None else s.rates if env is None else s.per_env.get(env)
        return "—" if rates is None else f"{100 * rates.success:.1f}%"

    first = f"{pct(base)} pretrained base -> " if base else ""
    lines = [f"held-out success (eval.json): {first}{pct(b)} after step {b.step} -> {pct(a)} after step "
             f"{a.step} ({delta.success:+.1f} points over RL)"]
    if pair:
        lines.append(f"  RL's share: {pair.success.words()}")
    if a.rates.reward is not None and b.rates.reward is not None:  # a continuous reward reads here where success
        paired_reward = f"; RL's share {pair.reward.words()} (reward x 100)" if pair else ""  # stays at 0
        lines.append(f"  mean reward: {b.rates.reward:.3f} -> {a.rates.reward:.3f}{paired_reward}")
    if a.greedy is not None and b.greedy is not None:
        paired_greedy = f"; RL's share {pair.greedy.success.words()}" if pair and pair.greedy else ""
        lines.append(f"  greedy: {pct(b.greedy)} -> {pct(a.greedy)} ({delta.greedy:+.1f} points over RL)"
                     f"{paired_greedy}")
    if head:
        g = head.greedy
        lines.append(f"  the environments RL trained on ({', '.join(head.environments)}): {head.sampled.before:.1f}% "
                     f"-> {head.sampled.after:.1f}%, RL's share {head.sampled.paired.words()}"
                     + (f"; greedy {g.before:.1f}% -> {g.after:.1f}%, RL's share {g.paired.words()}" if g else ""))
    for env, change in delta.per_env.items():
        start = f"{pct(base, env)} -> " if base else ""
        paired_env = f"; RL's share {pair.per_env[env].words()}" if pair and env in pair.per_env else ""
        lines.append(f"  {env}: {start}{pct(b, env)} -> {pct(a, env)} ({change:+.1f}{paired_env})")
    return "\n".join(lines)


class EvalRecord:
    """``eval.json`` in a run directory: every held-out evaluation of the run, "before" (the first, the policy RL
    starts from) and "after" (the last), and the change in percentage points per environment. Rewritten after each
    evaluation, so a killed run keeps what it measured; ``resume_from(step)`` drops evaluations a resumed run redoes."""

    def __init__(self, path, k: int, per_family: int, trained: list[str] | None = None):
        self.path = Path(path)
        self.k, self.per_family = k, per_family
        self.trained = trained or []  # the environments RL draws from: ``rl_trained``
        try:
            saved = json.loads(self.path.read_text()) if self.path.is_file() else {}
            self.history = [EvalSummary.from_json(h, f"history[{i}].") for i, h in enumerate(saved.get("history", []))]
            # the pretrained policy before any training (``eval.base``)
            self.base = EvalSummary.from_json(saved["base"], "base.") if saved.get("base") else None
        except (OSError, ValueError, AttributeError) as e:
            raise JobError(f"{self.path}: not a run's eval.json ({e}); move it away to start the record anew") from None

    def resume_from(self, step: int) -> None:
        """A run resumed after ``step`` RL steps redoes everything after it: evaluations of later steps go."""
        self.history = [h for h in self.history if h.step is not None and h.step <= step]
        self._write()

    def has(self, step: int) -> bool:
        return any(h.step == step for h in self.history)

    def add(self, summary: EvalSummary) -> None:
        self.history.append(summary)
        self._write()

    def set_base(self, summary: EvalSummary) -> None:
        self.base = summary
        self._write()

    def as_dict(self) -> dict:
        """eval.json: ``history``; ``before`` (RL's start: after the warm start) and ``after`` (the last); ``base``
        (the pretrained policy, with ``eval.base``); ``delta_points``: after - before, in points (RL's own share), and
        ``over_base``: after - base (all training); ``paired``: after vs before task by task (``paired``);
        ``rl_trained``: the same over the environments RL trained on, where it left some out (``rl_trained``)."""
        out: dict = {"k": self.k, "tasks_per_family": self.per_family, "history": [h.to_json() for h in self.history]}
        if self.base is not None:
            out["base"] = self.base.to_json()
        if self.history:
            before, after = self.history[0], self.history[-1]
            out["before"], out["after"] = before.to_json(), after.to_json()
            out["delta_points"] = points(after, before).to_json()
            if (pair := paired(after, before)) is not None:
                out["paired"] = pair.to_json()
            if (head := rl_trained(after, before, self.trained)) is not None:
                out["rl_trained"] = head.to_json()
            if self.base is not None:
                out["over_base"] = points(after, self.base).to_json()
        return out

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        tmp.replace(self.path)


def run_record(cfg: JobConfig, out: Path, resume: bool, start: int) -> EvalRecord | None:
    """The run's eval.json (None without held-out evaluation); a resumed run drops evaluations after ``start``."""
    if not cfg.eval.tasks_per_family:
        return None
    path = out / "eval.json"
    if not resume:
        path.unlink(missing_ok=True)
    record = EvalRecord(path, cfg.eval.samples, cfg.eval.tasks_per_family,
                        [env.name for env in cfg.environments if env.draw_weight("rl") > 0])
    record.resume_from(start)
    return record
