"""Writes tests/data/run_sample/: a small recorded run directory for the report and show tests.

Episodes are real ``Trajectory`` objects (terminal tasks from ``make_task``) written as ``sandforge train`` writes
them (``RunLogger``): a scripted warm-start episode, RL episodes with reasoning and tool calls, one that ends on a
malformed call, one whose sandbox broke (failed), and one from a second environment. Metrics cover warm-up, ten RL
steps and three held-out evaluations, plus eval.json. No training job runs; rerun after changing the formats:

    .venv/bin/python tests/data/make_run_sample.py
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from sandforge.registry import environment
from sandforge.types import Message, Reward, Task, ToolCall, Trajectory, Turn

make_task = environment("terminal").make_task()
OUT = Path(__file__).parent / "run_sample"
RUN_ID = "sample-20261130-120000-ab12"
T0 = 1796040000.0


def episode(task: Task, group: str, session: str, replies: list[tuple[str, str, list[ToolCall]]],
            observations: list[list[tuple[str, str]]], reward: Reward | None, finish: str, version: int,
            failure: str = "", parse_errors: dict[int, str] | None = None) -> Trajectory:
    """One episode: ``replies[i]`` = (reasoning, content, calls) of turn i; ``observations[i]``: its (tool, output)s."""
    traj = Trajectory(task=task, group=group, policy_version=version, finish_reason=finish,
                      metadata={"session": session, "sandbox": f"sf-{session[-6:]}", "seconds": 3.2})
    traj.messages.append(Message("user", task.instruction))
    prompt = 96
    traj.token_ids += list(range(1, prompt + 1))
    traj.loss_mask += [0] * prompt
    for i, ((reasoning, content, calls), obs) in enumerate(zip(replies, observations)):
        for n, c in enumerate(calls):
            c.id = f"call_{i}_{n}"
        traj.messages.append(Message("assistant", content, reasoning, calls))
        for (name, text), call in zip(obs, calls + [ToolCall("")] * len(obs)):
            traj.messages.append(Message("tool", text, name=name, tool_call_id=call.id if name != "error" else ""))
        generated = 12 + len(reasoning) // 4 + 10 * len(calls)
        observed = 8 + sum(len(t) for _, t in obs) // 4
        errors = [parse_errors[i]] if parse_errors and i in parse_errors else []
        traj.turns.append(Turn(index=i, prompt_tokens=len(traj.token_ids), generated_tokens=generated,
                               observation_tokens=observed, finish_reason="stop", tool_calls=list(calls),
                               observations=[t for _, t in obs], parse_errors=errors,
                               executed=len(calls), version=version, prefill_tokens=observed,
                               seconds_generate=0.4, seconds_tools=0.1))
        traj.token_ids += [(7 * k) % 251 + 3 for k in range(generated + observed)]
        traj.loss_mask += [1] * generated + [0] * observed
    traj.logprobs = [-0.5 if m else 0.0 for m in traj.loss_mask]
    traj.token_versions = [version if m else -1 for m in traj.loss_mask]
    traj.reward, traj.failed, traj.failure = reward, bool(failure), failure
    return traj


def episodes() -> list[tuple[int, str, Trajectory]]:
    warm = make_task("write_file", 3)
    words = make_task("count_words", 7)
    words2 = make_task("count_words", 11)
    held = make_task("write_file", 2, "heldout")
    path = next(iter(words.setup["files"]))
    n = words.checks[0]["content"]
    wrong = str(int(n) - 1)
    listing = "\n".join(f"-rw-r--r-- 1 sandbox sandbox {40 + k} Nov 30 12:00 file_{k:02d}.txt" for k in range(60))
    repo_task = Task(id="repo/fix_off_by_one/4", env="repo", family="fix_off_by_one", seed=4,
                     instruction="The tests in /workspace/repo fail: fix the bug in src/ranges.py so they pass.",
                     checks=[{"verifier": "tests_pass", "command": "pytest -q tests"}])
    return [
        (0, "warmup", episode(  # the reference solution, replayed: no reasoning
            warm, f"warmup/{warm.id}", f"warmup/{warm.id}/0c1d2e3f4a5b", [("", "", warm.solution)],
            [[("write_file", f"wrote {len(warm.checks[0]['content'])} bytes to {warm.checks[0]['path']}"),
              ("submit", "submitted")]],
            Reward(1.0, True, {f"file_equals:{warm.checks[0]['path']}": 1.0}, "content matches"), "submit", 0)),
        (0, "rl", episode(  # counts lines, not words: wrong answer
            words, f"0/{words.id}", f"0/{words.id}/1a2b3c4d5e6f",
            [("I should look at the file first.", "", [ToolCall("bash", {"command": f"cat {path}"})]),
             ("It has two lines, so the answer is the line count.", "",
              [ToolCall("bash", {"command": f"echo {wrong} > /workspace/answer.txt"}), ToolCall("submit")])],
            [[("bash", words.setup["files"][path] + "[exit code 0]")],
             [("bash", "[exit code 0]"), ("submit", "submitted")]],
            Reward(0.0, False, {"file_equals:/workspace/answer.txt": 0.0},
                   f"/workspace/answer.txt: expected '{n}', got '{wrong}'"), "submit", 1)),
        (3, "rl", episode(  # the episode the CLI test shows: reasoning, two tools, a pass
            words2, f"3/{words2.id}", f"3/{words2.id}/9f8e7d6c5b4a",
            [("The task wants words, not lines: wc -w counts words.", "Counting the words with wc.",
              [ToolCall("bash", {"command": f"wc -w < {next(iter(words2.setup['files']))} > /workspace/answer.txt"})]),
             ("Check what was written before submitting.", "",
              [ToolCall("read_file", {"path": "/workspace/answer.txt"})]),
             ("The count is there; done.", "", [ToolCall("submit")])],
            [[("bash", "[exit code 0]")], [("read_file", words2.checks[0]["content"] + "\n")],
             [("submit", "submitted")]],
            Reward(1.0, True, {"file_equals:/workspace/answer.txt": 1.0}, "content matches"), "submit", 4)),
        (5, "rl", episode(  # a malformed call, HTML-like output and a long listing; never submits
            words, f"5/{words.id}", f"5/{words.id}/5a5b5c5d5e5f",
            [("List the workspace; <b>maybe</b> the file is elsewhere & hidden.", "",
              [ToolCall("bash", {"command": "ls -la /workspace; echo '<script>alert(\"x\")</script>'"})]),
             ("Now write the answer.", '{"name": "bash", "arguments": {"command": ', [])],
            [[("bash", listing + "\n<script>alert(\"x\")</script>\n[exit code 0]")],
             [("error", "Error: could not parse a tool call: unterminated JSON object")]],
            Reward(0.0, False, {"file_equals:/workspace/answer.txt": 0.0}, "/workspace/answer.txt does not exist"),
            "max_turns", 6, parse_errors={1: "unterminated JSON object"})),
        (7, "rl", episode(  # the sandbox died mid-episode: failed, excluded from the gradient
            words2, f"7/{words2.id}", f"7/{words2.id}/0f0e0d0c0b0a",
            [("Count the words.", "", [ToolCall("bash", {"command": f"wc -w {next(iter(words2.setup['files']))}"})])],
            [[("bash", "")]],
            Reward(0.0, False, {}, "sandbox: container sf-0c0b0a exited (OOM killed)"), "error", 8,
            failure="sandbox: container sf-0c0b0a exited (OOM killed)")),
        (9, "rl", episode(  # a second environment, so per-env curves and tables have two lines
            repo_task, f"9/{repo_task.id}", f"9/{repo_task.id}/abcdefabcdef",
            [("The range end is exclusive; the loop stops one short.", "",
              [ToolCall("bash", {"command": "sed -i 's/range(a, b)/range(a, b + 1)/' src/ranges.py && pytest -q"}),
               ToolCall("submit")])],
            [[("bash", "....\n4 passed in 0.05s\n[exit code 0]"), ("submit", "submitted")]],
            Reward(1.0, True, {"tests_pass:0": 1.0}, "4 passed"), "submit", 10)),
        (10, "eval", episode(  # a held-out episode from the final evaluation
            held, f"eval10/{held.id}", f"eval10/{held.id}/eeeeeeeeeeee", [("Write the file as asked.", "", held.solution)],
            [[("write_file", f"wrote {len(held.checks[0]['content'])} bytes to {held.checks[0]['path']}"),
              ("submit", "submitted")]],
            Reward(1.0, True, {f"file_equals:{held.checks[0]['path']}": 1.0}, "content matches"), "submit", 10)),
    ]


def metrics() -> list[dict]:
    rows = []
    for s in range(5):
        rows.append({"phase": "warmup", "time": T0 + s, "warmup/step": s, "warmup/loss": round(2.4 * 0.6**s, 4),
                     "warmup/grad_norm": round(3.0 * 0.7**s, 4)})
    for s in range(10):
        p = 1 - math.exp(-s / 4)
        rows.append({"phase": "rl", "time": T0 + 10 + 5 * s, "step": s, "reward/mean": round(0.2 + 0.7 * p, 4),
                     "success/rate": round(0.1 + 0.75 * p, 4), "success/terminal": round(0.1 + 0.8 * p, 4),
                     "success/repo": round(0.05 + 0.5 * p, 4), "response/length_mean": round(60 - 20 * p, 2),
                     "turns/mean": round(3.0 - 1.2 * p, 3), "kl": round(0.002 * s, 5),
                     "entropy": round(1.9 - 0.5 * p, 4), "loss": round(0.05 - 0.03 * p, 4), "grad_norm": 0.8,
                     "episodes/failed": 1 if s == 7 else 0, "time/step": 5.0})
    for s, (t, r) in zip((0, 5, 10), ((0.3, 0.0), (0.55, 0.25), (0.8, 0.5))):
        success = round((2 * t + r) / 3, 4)
        rows.append({"phase": "eval", "time": T0 + 10 + 5 * s + 1, "step": s, "eval/success": success,
                     "eval/pass@k": min(1.0, round(success + 0.2, 4)), "eval/k": 4, "eval/failed": 1,
                     "eval/success/repo": r, "eval/pass@k/repo": min(1.0, r + 0.25),
                     "eval/success/terminal": t, "eval/pass@k/terminal": min(1.0, t + 0.2)})
    return rows


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    (OUT / "run_id").write_text(RUN_ID + "\n")
    (OUT / "config.yaml").write_text("run:\n  name: sample\n  output_dir: runs/sample\ntrainer:\n  steps: 10\n")
    with (OUT / "metrics.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in metrics())
    with (OUT / "trajectories.jsonl").open("w") as f:
        f.writelines(json.dumps({"step": step, "phase": phase, **t.to_dict()}) + "\n" for step, phase, t in episodes())
    (OUT / "eval.json").write_text(json.dumps(eval_record(), indent=1) + "\n")


def eval_record() -> dict:
    """eval.json as job/run.py writes it (job/evaluation.py EvalRecord): every evaluation, before and after."""
    def summary(step: int, terminal: float, repo: float) -> dict:
        envs = {"repo": {"success": repo, "pass@k": min(1.0, repo + 0.25), "tasks": 2, "episodes": 8, "failed": 0},
                "terminal": {"success": terminal, "pass@k": min(1.0, terminal + 0.2), "tasks": 4, "episodes": 16,
                             "failed": 1}}
        success = round((2 * terminal + repo) / 3, 4)
        return {"step": step, "policy_version": step + 1, "k": 4, "success": success,
                "pass@k": min(1.0, round(success + 0.2, 4)), "tasks": 6, "episodes": 24, "failed": 1, "per_env": envs}

    history = [summary(0, 0.3, 0.0), summary(5, 0.55, 0.25), summary(10, 0.8, 0.5)]
    before, after = history[0], history[-1]
    return {"k": 4, "tasks_per_family": 2, "history": history, "before": before, "after": after,
            "delta_points": {"success": round(100 * (after["success"] - before["success"]), 2),
                             "per_env": {env: round(100 * (after["per_env"][env]["success"]
                                                           - before["per_env"][env]["success"]), 2)
                                         for env in sorted(after["per_env"])}}}

if __name__ == "__main__":
    main()
