"""What the policy writes reaches the host bounded and, on a terminal, inert (#32, item 5).

Attacks: an `exact` json_match answer whose one unexpected key is 8 MB (its reason quoted the key in full: an
8,000,055-character reason and an 8 MB trajectory row, against a 4,096-character observation cap); ESC sequences in a
tool's output, a reply and a reward reason, printed raw by `sandforge show` (clear screen, window title, an OSC 52
clipboard write)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from sandforge.job.show import episode_table, render_episode
from sandforge.policy_text import bounded, visible, visible_tree
from sandforge.types import Task
from sandforge.verifiers.checks import MAX_PART_CHARS, MAX_REASON_CHARS, MAX_TASK_REASON_CHARS, score_task

CLEAR, TITLE, CLIPBOARD = "\x1b[2J\x1b[H", "\x1b]0;pwned\x07", "\x1b]52;c;cm0gLXJmIH4=\x07"
CSI_C1 = "\x9b31m"  # the one-character CSI some terminals read


def test_bounded_keeps_head_and_tail_within_the_limit():
    text = "a" * 500 + "MIDDLE" + "z" * 500
    cut = bounded(text, 200)
    assert len(cut) == 200 and cut.startswith("aaa") and cut.endswith("zzz") and "characters cut" in cut
    assert bounded("short", 200) == "short" and len(bounded("x" * 50, 10)) == 10


def test_visible_writes_control_characters_as_escapes():
    assert visible(f"ok\n\tline{CLEAR}{TITLE}{CSI_C1}") == "ok\n\tline\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07\\x9b31m"
    row = visible_tree({"k\x1b": ["\x1b[2J", 3, None, {"x": "\x07"}]})
    assert row == {"k\\x1b": ["\\x1b[2J", 3, None, {"x": "\\x07"}]}


def test_sandforge_show_prints_escape_sequences_as_text():
    hostile = f"done{CLEAR}{TITLE}{CLIPBOARD}{CSI_C1}"
    ep = {"task": {"id": f"t{TITLE}", "env": "terminal", "instruction": "x"}, "phase": "rl", "step": 0,
          "reward": {"value": 0.0, "success": False, "reason": hostile, "breakdown": {f"k{CLEAR}": 0.0}},
          "messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "content": hostile, "reasoning": hostile,
                        "tool_calls": [{"name": "bash", "arguments": {"command": hostile}}]},
                       {"role": "tool", "name": "bash", "content": hostile}],
          "turns": [{"tool_calls": [{"name": "bash", "arguments": {"command": hostile}}],
                     "observations": [hostile]}]}
    for color in (None, "truecolor"):  # plain and styled output alike
        out = io.StringIO()
        console = Console(file=out, width=300, color_system=color, force_terminal=color is not None)
        console.print(render_episode(ep))
        console.print(episode_table([ep]))
        text = out.getvalue()
        assert "\x07" not in text and "\x9b" not in text and "]52;" not in text.replace("\\x1b]52;", ""), text
        assert "2J" not in text.replace("\\x1b[2J", "")  # only as visible text
        assert "\\x1b]0;pwned\\x07" in text and "\\x1b[2J" in text
        if color is None:
            assert "\x1b" not in text  # rich's own styles are off: nothing at all reaches the terminal raw


@pytest.mark.docker
def test_an_answer_with_a_huge_key_gives_a_bounded_reason(sandbox):
    """The policy's answer holds the expected values plus one 8 MB key; `exact` scores it 0 (an unexpected key), and
    the reason that names the key stays within the grader's bound instead of quoting 8 MB."""
    sandbox.exec("""{ printf '{"name": "ok", "'; head -c 8000000 /dev/zero | tr '\\0' k; printf '": 1}'; } """
                 "> answer.json", timeout=60)
    size = int(sandbox.exec("stat -c %s answer.json", timeout=10).output.strip())
    assert size > 7_000_000, size
    task = Task(id="t/json", env="terminal", family="f", seed=0, instruction="",
                checks=[{"verifier": "json_match", "path": "answer.json", "expected": {"name": "ok"}, "exact": True},
                        {"verifier": "json_match", "path": "answer.json", "expected": {"name": "ok"}}])
    reward = score_task(sandbox, task)
    assert reward.value == 0.5 and not reward.success  # the exact check: an unexpected key; the subset check: 1
    assert "unexpected" in reward.reason and "characters cut" in reward.reason
    assert len(reward.reason) <= MAX_TASK_REASON_CHARS and len(json.dumps(reward.__dict__)) < 20_000


def test_a_verifier_cannot_put_unbounded_text_in_a_reward(monkeypatch):
    """Whatever a check returns (a plugin's, quoting the policy), its reason and part names are bounded."""
    from sandforge.verifiers import checks

    monkeypatch.setitem(checks.VERIFIERS, "quoter", lambda sandbox, args: (0.0, "x" * 10**6, {"p" * 10**5: 0.0}))
    task = Task(id="t", env="terminal", family="f", seed=0, instruction="", checks=[{"verifier": "quoter"}] * 9)
    reward = score_task(object(), task)
    assert len(reward.reason) <= MAX_TASK_REASON_CHARS
    assert all(len(k) <= MAX_PART_CHARS + len("quoter:0#8/") for k in reward.breakdown)
    assert MAX_REASON_CHARS < MAX_TASK_REASON_CHARS


def test_a_job_error_that_quotes_the_policy_reaches_the_terminal_as_text(capsys):
    """#56: every episode of a batch failed alike and the job stopped with one line quoting the failure, which the
    policy's output carried: its escape codes reached the user's terminal. JobError and the command line's error line
    make every control character visible, whoever built the message."""
    import typer

    from sandforge.job.cli import fail
    from sandforge.job.console import JobError
    from sandforge.job.fleet.rollout_workers import stop_if_all_failed
    from sandforge.types import Trajectory

    hostile = "worker: harness exited 97: \x1b]0;pwned\x07\x1b[2J"
    trajs = [Trajectory(task=Task(id=f"t{i}", env="harbor", family="f", seed=i, instruction=""), group="g",
                        failed=True, failure=hostile) for i in range(2)]
    with pytest.raises(JobError) as e:
        stop_if_all_failed(trajs, "rl step 0")
    assert "\x1b" not in str(e.value) and "\\x1b]0;pwned\\x07\\x1b[2J" in str(e.value)
    assert "\x1b" not in str(JobError(hostile))
    with pytest.raises(typer.Exit):
        fail(hostile)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b[2J" in err
