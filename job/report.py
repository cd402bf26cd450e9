"""``sandforge report RUN_DIR``: the run's curves as report.png and a self-contained report.html in the run directory.

The same curves users watch in wandb (reward, success per environment, held-out success, response length, turns, KL,
entropy, warm-start SFT loss), drawn from metrics.jsonl so a run can be read without a wandb server. The page adds a
summary table and a few sample episodes (reasoning, tool calls, observations, reward breakdown).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from sandforge.job.eval_summary import EvalSummary, RunEvals
from sandforge.rundir import check_run_dir, read_episodes, read_eval, read_metrics, run_id
from sandforge.job.show import clip_observation


@dataclass
class Series:
    label: str
    x: list[float]
    y: list[float]
    env: str = ""  # colours match across panels by environment
    style: str = "line"  # "line" | "dotted" | "reward" | "base" | "before" | "after" (eval.json markers)
    err: list[float] | None = None  # eval.json markers: each point's standard error, drawn as an error bar


@dataclass
class Panel:
    title: str
    missing: str  # shown in the panel when it has no series: which rows or keys would fill it
    series: list[Series] = field(default_factory=list)


def curve(rows: list[dict], key: str, label: str, env: str = "", x_key: str = "step") -> list[Series]:
    points = [(r[x_key], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
              and isinstance(r.get(x_key), (int, float))]
    return [Series(label, [p[0] for p in points], [p[1] for p in points], env)] if points else []


def rolling_mean(y: list[float], window: int) -> list[float]:
    """Each point averaged with its neighbours, ``window // 2`` either side (fewer at the ends): RL curves are noisy
    step to step and people read them for the trend. Centred, so a drop shows where it happened, not later."""
    half = window // 2
    return [sum(y[max(0, i - half) : i + half + 1]) / len(y[max(0, i - half) : i + half + 1]) for i in range(len(y))]


def suffixes(rows: list[dict], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    """Environment names from keys such as ``success/<env>``, sorted."""
    return sorted({k[len(prefix):] for r in rows for k in r if k.startswith(prefix) and k[len(prefix):] not in skip
                   and "/" not in k[len(prefix):]})


BASE_X = -1  # where the pretrained base's markers sit: left of RL step 0 (the warm start's evaluation)


def eval_markers(evals: RunEvals) -> list[Series]:
    """eval.json's held-out success, per environment and overall, as markers on the held-out panel: the pretrained
    base (left of step 0), the warm start RL begins from (before) and the end of RL (after)."""
    out = []
    for style in ("base", "before", "after"):
        point: EvalSummary | None = getattr(evals, style)
        if point is None or (point.step is None and style != "base"):
            continue
        x = BASE_X if style == "base" else point.step
        for env, rates in {"all": point.rates, **point.per_env}.items():
            out.append(Series(f"{env} {style}", [x], [rates.success], env, style, [rates.stderr]))
    return out


def panels(metrics: dict[str, list[dict]], evals: RunEvals) -> list[Panel]:
    rl, ev, warm = metrics.get("rl", []), metrics.get("eval", []), metrics.get("warmup", [])
    success = Panel("success per environment", "no rl rows with success/<env> in metrics.jsonl")
    for env in suffixes(rl, "success/", skip=("rate",)):
        success.series += curve(rl, f"success/{env}", env, env)
    if len(success.series) > 1:  # with one environment the overall rate is the same line
        success.series += curve(rl, "success/rate", "all envs", "all")
    held = Panel("held-out success: base, warm start, RL", "no eval rows in metrics.jsonl and no eval.json")
    for env in suffixes(ev, "eval/success/"):
        held.series += curve(ev, f"eval/success/{env}", env, env)
    held.series += curve(ev, "eval/success", "all envs", "all") + eval_markers(evals)
    for s in curve(ev, "eval/greedy/success", "all envs, greedy", "all"):
        s.style = "dotted"
        held.series.append(s)
    # the mean reward: a continuous one moves where success does not
    for s in curve(ev, "eval/reward", "all envs, mean reward", "all"):
        s.style = "reward"
        held.series.append(s)

    def single(title: str, key: str, rows: list[dict], phase: str, x_key: str = "step") -> Panel:
        return Panel(title, f"no {phase} rows with {key} in metrics.jsonl", curve(rows, key, key, x_key=x_key))

    return [
        single("reward (mean)", "reward/mean", rl, "rl"),
        success,
        held,
        single("response length (tokens)", "response/length_mean", rl, "rl"),
        single("turns per episode", "turns/mean", rl, "rl"),
        single("KL to reference", "kl", rl, "rl"),
        single("entropy", "entropy", rl, "rl"),
        cold_start(metrics.get("pretrain", []), warm),
    ]


def cold_start(pre: list[dict], warm: list[dict]) -> Panel:
    """Synthetic pretraining loss, then the warm start's SFT loss, on one axis of optimizer steps."""
    panel = Panel("cold start: pretraining, then SFT loss", "no pretrain or warmup rows in metrics.jsonl")
    panel.series += curve(pre, "pretrain/loss", "pretraining", "pretrain", x_key="pretrain/step")
    shifted = [{**r, "cold/step": len(pre) + r["warmup/step"]} for r in warm if "warmup/step" in r]
    panel.series += curve(shifted, "warmup/loss", "warm-start SFT", "warmup", x_key="cold/step")
    return panel


MARKERS = {"base": "s", "before": "o", "after": "*"}
MARKER_LABELS = {"base": "pretrained base", "before": "warm start (RL step 0)", "after": "after RL"}
SMOOTH_FROM = 20  # points in a curve from which it is drawn smoothed


def plot_curves(panel_list: list[Panel]):
    """One figure, a subplot per panel; a panel without data says which rows would fill it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cols = 4
    rows = -(-len(panel_list) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    envs = sorted({s.env for p in panel_list for s in p.series if s.env and s.env != "all"})
    colors = {env: f"C{i % 10}" for i, env in enumerate(envs)} | {"all": "black", "": "C0"}
    for ax, panel in zip(axes.flat, panel_list):
        ax.set_title(panel.title, fontsize=11)
        if not panel.series:
            ax.text(0.5, 0.5, f"no data:\n{panel.missing}", ha="center", va="center", wrap=True, fontsize=8,
                    color="0.4", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for s in panel.series:
            color = colors.get(s.env, "C0")
            if s.style == "dotted":
                ax.plot(s.x, s.y, color=color, label=s.label, linestyle=":", marker=".")
            elif s.style == "reward":
                ax.plot(s.x, s.y, color=color, label=s.label, linestyle="-.", marker="x", alpha=0.7)
            elif s.style == "line":
                y = s.y
                if len(s.x) >= SMOOTH_FROM:  # the raw values faint, their rolling mean on top
                    ax.plot(s.x, s.y, color=color, alpha=0.25, linewidth=0.8)
                    y = rolling_mean(s.y, max(5, len(s.y) // 10))
                ax.plot(s.x, y, color=color, label=s.label, marker="." if len(s.x) < SMOOTH_FROM else None,
                        linestyle="--" if s.env == "all" and len(panel.series) > 1 else "-")
            else:  # eval.json: hollow square for the base, hollow circle before RL, star after; the legend names the shape once, not per env
                ax.scatter(s.x, s.y, color=color, s=90 if s.style == "after" else 45, zorder=3,
                           marker=MARKERS[s.style], facecolors=color if s.style == "after" else "none")
                if s.err:  # the standard error eval.json records
                    ax.errorbar(s.x, s.y, yerr=s.err, fmt="none", ecolor=color, capsize=3, linewidth=1, zorder=2)
        styles = [st for st in MARKERS if any(s.style == st for s in panel.series)]
        handles = [Line2D([], [], color="0.4", marker=MARKERS[st], linestyle="", markerfacecolor="none"
                          if st != "after" else "0.4", label=f"{MARKER_LABELS[st]} (eval.json)") for st in styles]
        ax.set_xlabel("optimizer step" if panel.title.startswith("cold start") else "RL step", fontsize=9)
        ax.grid(alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(handles=ax.get_legend_handles_labels()[0] + handles, fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panel_list):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def fmt(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "—"


def summary_rows(run_dir: Path, metrics: dict[str, list[dict]], evals: RunEvals, episodes: list[dict]
                 ) -> list[tuple]:
    """(label, value) rows of the page's summary table."""
    rl, warm = metrics.get("rl", []), metrics.get("warmup", [])
    last = rl[-1] if rl else {}
    rows = [("run id", run_id(run_dir)), ("RL steps logged", str(len(rl))),
            ("final reward (mean)", fmt(last.get("reward/mean"))),
            ("final success rate", fmt(last.get("success/rate")))]
    if warm:
        rows.append(("warm-start SFT loss", f"{fmt(warm[0].get('warmup/loss'))} → {fmt(warm[-1].get('warmup/loss'))} "
                                            f"({len(warm)} steps)"))
    failed = sum(1 for e in episodes if e.get("failed"))
    rows.append(("episodes recorded", f"{len(episodes)} ({failed} failed)"))
    before, after, base, k = evals.before, evals.after, evals.base, evals.k or "k"
    if base:
        rows.append(("held-out success, pretrained base", fmt(base.rates.success)))
    if before and after and before.greedy and after.greedy:
        rows.append(("held-out success, greedy", f"{fmt(before.greedy.rates.success)} → "
                                                 f"{fmt(after.greedy.rates.success)}"))
    if before and after and before.rates.reward is not None and after.rates.reward is not None:
        rows.append(("held-out mean reward", f"{fmt(before.rates.reward)} → {fmt(after.rates.reward)}"))
    envs = sorted({env for s in (before, after) if s for env in s.per_env})
    for env in ["all"] + envs:
        b, a = (None if s is None else s.rates if env == "all" else s.per_env.get(env) for s in (before, after))
        if b or a:
            rows.append((f"held-out success, {env}", f"{fmt(b and b.success)} → {fmt(a and a.success)}  (pass@{k} "
                                                    f"{fmt(b and b.pass_at_k)} → {fmt(a and a.pass_at_k)})"))
    return rows


def sample_episodes(episodes: list[dict], n: int = 4) -> list[int]:
    """Indices worth reading: the latest success, graded miss and failed episode, then the latest others."""
    def last(pred) -> list[int]:
        return [i for i in range(len(episodes) - 1, -1, -1) if pred(episodes[i])][:1]

    def reward(e: dict) -> dict:
        return e.get("reward") or {}

    picks = (last(lambda e: not e.get("failed") and reward(e).get("success"))
             + last(lambda e: not e.get("failed") and not reward(e).get("success"))
             + last(lambda e: e.get("failed")))
    picks += [i for i in range(len(episodes) - 1, -1, -1) if i not in picks]
    return sorted(picks[:n])


def block(css: str, label: str, body: str) -> str:
    """A labelled part of an episode; ``label`` is escaped here, ``body`` must already be HTML."""
    return f'<div class="{css}"><span class="label">{html.escape(label)}</span>{body}</div>'


def pre(text) -> str:
    return f"<pre>{html.escape(str(text))}</pre>"


def episode_html(index: int, ep: dict) -> str:
    """One episode as escaped HTML: instruction, each turn's reasoning, reply and tool calls, observations, reward."""
    task, reward = ep.get("task") or {}, ep.get("reward") or {}
    mark = "✗ failed" if ep.get("failed") else ("✓" if reward.get("success") else "✗")
    head = html.escape(f"#{index} · {ep.get('phase', '?')} step {ep.get('step', '?')} · {task.get('id', '?')} · "
                       f"reward {fmt(reward.get('value'), 2)} {mark} · {ep.get('finish_reason') or '?'}")
    parts = []
    messages = ep.get("messages") or []
    if not any(m.get("role") == "user" for m in messages) and task.get("instruction"):
        parts.append(block("user", "instruction", pre(task["instruction"])))
    for m in messages:
        role = m.get("role", "?")
        if role == "assistant":
            inner = block("think", "reasoning", pre(m["reasoning"])) if m.get("reasoning") else ""
            inner += pre(m["content"]) if m.get("content") else ""
            for c in m.get("tool_calls") or []:
                args = json.dumps(c.get("arguments") or {}, indent=2, ensure_ascii=False)
                inner += block("call", f"call {c.get('name')}", pre(args))
            parts.append(block("assistant", "assistant", inner))
        elif role == "tool":
            parts.append(block("tool", f"tool: {m.get('name')}", pre(clip_observation(m.get("content", "")))))
        else:
            parts.append(block("user" if role == "user" else "other", str(role), pre(m.get("content", ""))))
    breakdown = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{fmt(v, 2)}</td></tr>"
                        for k, v in (reward.get("breakdown") or {}).items())
    parts.append(block("reward", f"reward {fmt(reward.get('value'), 2)} {mark}",
                       (f"<table>{breakdown}</table>" if breakdown else "")
                       + (pre(reward["reason"]) if reward.get("reason") else "")))
    if ep.get("failed"):
        parts.append(block("failure", "failure", pre(ep.get("failure", ""))))
    shots = (ep.get("metadata") or {}).get("screenshots") or []
    if shots:
        parts.append(block("shots", f"screenshots ({len(shots)})", screenshots_html(shots)))
    return f'<details open><summary>{head}</summary>{"".join(parts)}</details>'


def screenshots_html(paths: list[str]) -> str:
    """Images by their paths relative to the run directory, where report.html lies (a path that is not a plain
    relative one under screenshots/ is left out: rows can be edited by hand)."""
    safe = [p for p in paths if p.startswith("screenshots/") and ".." not in p and "\\" not in p]
    return "".join(f'<a href="{html.escape(p)}"><img class="shot" loading="lazy" alt="{html.escape(p)}" '
                   f'src="{html.escape(p)}"></a>' for p in safe)


def screenshot_episodes(episodes: list[dict], n: int = 2) -> list[int]:
    """The latest ``n`` episodes that left screenshots (browser episodes)."""
    return [i for i in range(len(episodes) - 1, -1, -1)
            if (episodes[i].get("metadata") or {}).get("screenshots")][:n][::-1]


STYLE = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
img{max-width:100%}table.summary td{padding:2px 12px 2px 0}pre{white-space:pre-wrap;margin:.3em 0;font-size:13px}
details{border:1px solid #ccc;border-radius:6px;margin:1em 0;padding:.5em}summary{font-weight:600;cursor:pointer}
details>div{margin:.5em 0;padding:.3em .6em;border-left:4px solid #bbb}.user{border-color:#4a7}
.assistant{border-color:#47c}.think pre{color:#666;font-style:italic}.call{border-left:2px solid #c84;padding-left:.5em}
.tool{border-color:#999;background:#f6f6f6}.reward{border-color:#a4a}.failure{border-color:#c33;background:#fee}
.label{font-size:12px;font-weight:600;color:#555}img.shot{width:320px;margin:4px;border:1px solid #ccc}"""


def write_report(run_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` into ``run_dir``; returns their paths. Raises RunDirError for a
    directory that is not a run directory."""
    import matplotlib.pyplot as plt

    run_dir = check_run_dir(run_dir)
    metrics, episodes = read_metrics(run_dir), read_episodes(run_dir)
    evals = RunEvals.from_json(read_eval(run_dir))
    panel_list = panels(metrics, evals)
    fig = plot_curves(panel_list)
    png = run_dir / "report.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)

    e = html.escape
    table = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>"
                    for k, v in summary_rows(run_dir, metrics, evals, episodes))
    empty = [p.title for p in panel_list if not p.series]
    note = f"<p>No data yet for: {e(', '.join(empty))}.</p>" if empty else ""
    picks = sample_episodes(episodes)
    samples = "".join(episode_html(i, episodes[i]) for i in picks)
    shots = "".join(episode_html(i, episodes[i]) for i in screenshot_episodes(episodes) if i not in picks)
    image = base64.b64encode(png.read_bytes()).decode()
    page = (f'<!doctype html><html><head><meta charset="utf-8"><title>sandforge report: {e(run_id(run_dir))}</title>'
            f"<style>{STYLE}</style></head><body><h1>sandforge run {e(run_id(run_dir))}</h1>"
            f'<table class="summary">{table}</table><h2>Curves</h2>{note}'
            f'<img alt="training curves" src="data:image/png;base64,{image}">'
            f"<h2>Sample episodes</h2>{samples or '<p>No episodes recorded yet.</p>'}"
            + (f"<h2>Browser episodes, with screenshots</h2>{shots}" if shots else "") + "</body></html>\n")
    out = run_dir / "report.html"
    out.write_text(page)
    return png, out
