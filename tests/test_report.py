"""`sandforge report RUN_DIR` on a recorded run directory (tests/data/run_sample, see tests/data/make_run_sample.py):
report.png holds the curves, report.html embeds them with a summary and readable sample episodes; and the wandb sample
table carries each episode's reward breakdown."""

from __future__ import annotations

import base64
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sandforge.job.report import panels, plot_curves, rolling_mean, write_report
from sandforge.job.eval_summary import RunEvals
from sandforge.rundir import read_eval, read_metrics

SAMPLE = Path(__file__).parent / "data" / "run_sample"
SANDFORGE = Path(sys.executable).parent / "sandforge"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def reported(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`sandforge report` run once on a copy (the report goes into the run directory; the shipped sample stays)."""
    run_dir = Path(shutil.copytree(SAMPLE, tmp_path_factory.mktemp("report") / "run"))
    out = subprocess.run([str(SANDFORGE), "report", str(run_dir)], capture_output=True, text=True, timeout=120)
    return run_dir, out


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def panel(panel_list, title):
    return next(p for p in panel_list if p.title.startswith(title))


def test_cli_writes_png_and_html_with_curves_and_episodes(reported):
    run_dir, out = reported
    assert out.returncode == 0, out.stderr
    assert str(run_dir / "report.png") in out.stdout and str(run_dir / "report.html") in out.stdout
    png = (run_dir / "report.png").read_bytes()
    width, height = png_size(png)
    assert width >= 1200 and height >= 500 and len(png) > 30_000  # eight panels of curves, not an empty canvas
    page = (run_dir / "report.html").read_text()
    embedded = re.search(r'<img alt="training curves" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == png  # self-contained: the same curves, inline
    assert "sample-20261130-120000-ab12" in page  # run id in the summary
    # a sample episode's tool call, its reasoning and its reward breakdown, escaped for HTML
    assert "call bash" in page and "ls -la /workspace" in page
    assert "List the workspace; &lt;b&gt;maybe&lt;/b&gt; the file is elsewhere &amp; hidden." in page
    assert "file_equals:/workspace/answer.txt" in page
    assert "sandbox: container sf-0c0b0a exited (OOM killed)" in page  # the failed episode is among the samples


def test_episode_text_cannot_inject_html(reported):
    page = (reported[0] / "report.html").read_text()
    # the policy echoed a script tag; it must show as text, not run when the page is opened
    assert "&lt;script&gt;alert" in page
    assert "<script" not in page and "<b>maybe" not in page


def test_summary_shows_final_metrics_and_eval_before_after(reported):
    page = (reported[0] / "report.html").read_text()
    rows = dict(re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td></tr>", page))
    assert rows["RL steps logged"] == "10"
    assert rows["final reward (mean)"] == "0.826"  # last rl row of metrics.jsonl
    assert rows["episodes recorded"] == "7 (1 failed)"
    assert rows["held-out success, terminal"].startswith("0.300 → 0.800")  # eval.json before -> after
    assert rows["held-out success, repo"].startswith("0.000 → 0.500")
    assert "pass@4 0.400 → 0.900" in rows["held-out success, all"]


def test_curves_follow_the_metrics_rows():
    metrics, summary = read_metrics(SAMPLE), read_eval(SAMPLE)
    rl = metrics["rl"]
    p = panels(metrics, RunEvals.from_json(summary))
    reward = panel(p, "reward").series
    assert reward[0].x == [r["step"] for r in rl] and reward[0].y == [r["reward/mean"] for r in rl]
    success = {s.label: s.y for s in panel(p, "success per environment").series}
    assert set(success) == {"terminal", "repo", "all envs"}  # one line per environment, plus the overall rate
    assert success["repo"] == [r["success/repo"] for r in rl]
    held = panel(p, "held-out success: base, warm start, RL").series
    lines = {s.label: (s.x, s.y) for s in held if s.style == "line"}
    assert lines["terminal"] == ([0, 5, 10], [0.3, 0.55, 0.8])  # eval rows
    markers = {s.label: (s.x, s.y) for s in held if s.style not in ("line", "reward")}
    assert markers["terminal before"] == ([0], [0.3]) and markers["all after"] == ([10], [0.7])
    with_base = {**summary, "base": {**summary["before"], "success": 0.05, "stderr": 0.02,
                                     "per_env": {"terminal": {"success": 0.1, "stderr": 0.04}}}}
    rows = [{**r, "eval/greedy/success": r["eval/success"] + 0.1} for r in metrics["eval"]]
    held = panel(panels({**metrics, "eval": rows}, RunEvals.from_json(with_base)), "held-out success: base, warm start, RL").series
    marks = {s.label: (s.style, s.x, s.y) for s in held}
    assert marks["all base"] == ("base", [-1], [0.05]) and marks["terminal base"] == ("base", [-1], [0.1])
    errs = {s.label: s.err for s in held}  # eval.json's standard errors become the markers' error bars
    assert errs["all base"] == [0.02] and errs["terminal base"] == [0.04] and errs["all envs"] is None
    assert marks["all envs, greedy"][0] == "dotted" and marks["all envs, greedy"][1] == [0, 5, 10]
    plot_curves(panels({**metrics, "eval": rows}, RunEvals.from_json(with_base)))  # draws every style
    sft = panel(p, "cold start: pretraining, then SFT loss").series[0]  # the sample run has no pretraining rows
    assert sft.x == [0, 1, 2, 3, 4] and sft.y[0] > sft.y[-1]
    both = panel(panels({"pretrain": [{"pretrain/step": i, "pretrain/loss": 5.0 - i} for i in range(3)],
                         "warmup": [{"warmup/step": i, "warmup/loss": 1.0} for i in range(2)]}, RunEvals()),
                 "cold start: pretraining, then SFT loss").series
    assert [(s.label, s.x) for s in both] == [("pretraining", [0, 1, 2]), ("warm-start SFT", [3, 4])]


def test_long_noisy_curves_are_drawn_smoothed_over_the_raw_values():
    assert rolling_mean([0, 3, 0, 3, 0, 3], 3) == [1.5, 1, 2, 1, 2, 1.5]
    rows = [{"phase": "rl", "step": s, "reward/mean": float(s % 2)} for s in range(40)]
    ax = plot_curves(panels({"rl": rows}, RunEvals())).axes[0]
    raw, smooth = ax.lines
    assert list(raw.get_ydata()) == [float(s % 2) for s in range(40)]
    middle = smooth.get_ydata()[5:-5]  # the ends average fewer points
    assert max(middle) - min(middle) < 0.25  # the trend, not the zigzag


def test_panels_without_data_say_so(tmp_path):
    """A run that has only warmed up: the RL panels stay in the figure and say what would fill them."""
    (tmp_path / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (SAMPLE / "metrics.jsonl").read_text().splitlines() if '"warmup"' in line)
        + '{"phase": "rl", "step": 0, "reward/m')  # and a torn last line, as a killed run leaves
    metrics = read_metrics(tmp_path)
    p = panels(metrics, RunEvals.from_json(read_eval(tmp_path)))
    fig = plot_curves(p)
    texts = {ax.get_title(): " ".join(t.get_text() for t in ax.texts) for ax in fig.axes}
    assert len(texts) == 8
    assert "no data" in texts["KL to reference"] and "kl" in texts["KL to reference"]
    assert "no eval rows" in texts["held-out success: base, warm start, RL"]
    assert "no data" not in texts["cold start: pretraining, then SFT loss"]
    png, page = write_report(tmp_path)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "No data yet for: reward (mean)" in page.read_text() and "No episodes recorded yet" in page.read_text()


def test_bad_run_dir_is_one_clear_line(tmp_path):
    for bad in (tmp_path / "missing", tmp_path):  # no such directory; a directory with no run in it
        out = subprocess.run([str(SANDFORGE), "report", str(bad)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(bad) in lines[0], out.stderr
        assert "run.output_dir" in lines[0]  # says what to pass instead
    assert not (tmp_path / "report.png").exists()


def test_wandb_sample_table_carries_reward_breakdown(tmp_path):
    """The offline wandb run's sample table has a breakdown column: each check's score, as JSON."""
    from sandforge.config import JobConfig
    from sandforge.job.runlog import RunLogger
    from sandforge.types import Trajectory

    rows = [json.loads(line) for line in (SAMPLE / "trajectories.jsonl").read_text().splitlines()]
    trajs = [Trajectory.from_dict({k: v for k, v in r.items() if k not in ("step", "phase")}) for r in rows]
    cfg = JobConfig.model_validate({"logging": {"wandb": {"mode": "offline"}, "sample_trajectories": 8}})
    logger = RunLogger(tmp_path, cfg, "test-breakdown")
    try:
        logger.log_trajectories(3, "rl", trajs)
    finally:
        logger.close()
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/samples/rl_*.table.json"))
    assert len(tables) == 1, list(tmp_path.rglob("*.json"))
    table = json.loads(tables[0].read_text())
    col = table["columns"].index("breakdown")
    got = {r[table["columns"].index("task")] + f"#{i}": json.loads(r[col]) for i, r in enumerate(table["data"])}
    want = {t.task.id + f"#{i}": t.reward.breakdown for i, t in enumerate(trajs)}
    assert got == want and any(v == {"file_equals:/workspace/answer.txt": 0.0} for v in got.values())


def test_browser_screenshots_land_in_the_run_directory_the_report_and_show(tmp_path):
    """An episode that left screenshots (the agent loop puts a browser's PNGs in its metadata): the run log writes them
    as files under screenshots/, the trajectory row names them instead of carrying the bytes, report.html shows them
    and `sandforge show` lists them."""
    import io

    from rich.console import Console

    from sandforge.config import JobConfig
    from sandforge.job.runlog import RunLogger
    from sandforge.job.show import render_episode
    from sandforge.types import Trajectory

    shutil.copytree(SAMPLE, tmp_path / "run")
    run_dir = tmp_path / "run"
    row = json.loads((SAMPLE / "trajectories.jsonl").read_text().splitlines()[-1])
    traj = Trajectory.from_dict({k: v for k, v in row.items() if k not in ("step", "phase")})
    png = PNG_MAGIC + bytes(range(64))
    traj.metadata["screenshots_png"] = [base64.b64encode(png).decode(), base64.b64encode(png).decode()]
    logger = RunLogger(run_dir, JobConfig.model_validate({"logging": {"wandb": {"mode": "disabled"}}}), "shots")
    logger.log_trajectories(7, "eval", [traj])
    shots = sorted((run_dir / "screenshots" / "eval-7").glob("*.png"))
    assert [p.read_bytes() for p in shots] == [png, png]
    last = json.loads((run_dir / "trajectories.jsonl").read_text().splitlines()[-1])
    assert last["metadata"]["screenshots"] == ["screenshots/eval-7/0000-0.png", "screenshots/eval-7/0000-1.png"]
    assert "screenshots_png" not in last["metadata"]
    _, html_path = write_report(run_dir)
    page = html_path.read_text()
    assert 'src="screenshots/eval-7/0000-0.png"' in page and 'src="screenshots/eval-7/0000-1.png"' in page
    console = Console(file=io.StringIO(), width=160, color_system=None)
    console.print(render_episode(last))
    assert "screenshots/eval-7/0000-1.png" in console.file.getvalue()


def test_the_held_out_mean_reward_is_drawn_and_listed():
    """#55: a continuous reward reads in the report where success stays at 0: its mean is a line of the held-out
    panel and a row of the summary."""
    from sandforge.job.report import summary_rows

    metrics, summary = read_metrics(SAMPLE), read_eval(SAMPLE)
    ev = [{**r, "eval/reward": 0.1 * (i + 1)} for i, r in enumerate(metrics["eval"])]
    held = panel(panels({**metrics, "eval": ev}, RunEvals.from_json(summary)), "held-out success: base, warm start, RL").series
    (reward,) = [s for s in held if s.style == "reward"]
    assert reward.label == "all envs, mean reward" and reward.y == pytest.approx([0.1, 0.2, 0.3])
    plot_curves(panels({**metrics, "eval": ev}, RunEvals.from_json(summary)))
    with_reward = {**summary, "before": {**summary["before"], "reward": 0.12},
                   "after": {**summary["after"], "reward": 0.34}}
    rows = dict(summary_rows(SAMPLE, metrics, RunEvals.from_json(with_reward), []))
    assert rows["held-out mean reward"] == "0.120 → 0.340"
