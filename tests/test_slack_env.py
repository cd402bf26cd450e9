"""The slack env on real containers: reference solutions score 1 through the real agent loop, doing nothing or acting
in the wrong place scores 0, runs repeat exactly, and the policy's tool arguments cannot reach past the app's API."""

from __future__ import annotations

import dataclasses

import pytest
from app_episodes import act, app_spec, episode, train_one_step
from seeded import slack_task as make_task

from sandforge.environments.apps.env import APP_DIR
from sandforge.sandbox.docker_sandbox import SandboxSpec
from containers import list_run_containers
from sandforge.environments.slack.env import SlackEnv
from sandforge.environments.slack.tasks import FAMILIES
from sandforge.environments.words import split_of
from sandforge.types import SandboxError, ToolCall
from sandforge.verifiers.checks import score_task
from sandforge.verifiers.state import query_rows

DB = SlackEnv.db_path()

# --- tasks, no Docker ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tasks_are_deterministic_varied_and_split_apart(family):
    assert make_task(family, 11) == make_task(family, 11)
    assert len({t.instruction for t in (make_task(family, s) for s in range(20))}) > 15
    train, held = make_task(family, 4), make_task(family, 4, "heldout")
    assert (train.id, held.id) == (f"slack/{family}/4", f"slack/{family}/heldout/4")
    assert (train.env, train.family, held.split) == ("slack", family, "heldout")
    assert train.checks[0]["verifier"] == "sql" and train.checks[0]["db"] == DB
    assert train.solution[-1] == ToolCall("submit")
    tools = {t["name"] for t in SlackEnv.__new__(SlackEnv).tools}
    assert {c.name for c in train.solution} <= tools


def test_train_and_heldout_names_are_words_of_their_split():
    for split in ("train", "heldout"):  # people, channels and emoji are words of the task's split
        for task in (make_task(f, s, split) for f in FAMILIES for s in range(5)):
            app = task.setup["app"]
            names = [u[1] for u in app["users"][2:]] + [c[1] for c in app["channels"]]
            names += [c.arguments["emoji"] for c in task.solution if c.name == "add_reaction"]
            assert {split_of(n) for n in names} == {split}, task.id


def test_unknown_family_and_split_are_explained():
    with pytest.raises(ValueError, match="unknown slack task family 'dm'.*reply_in_thread"):
        make_task("dm", 1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        make_task("post_message", 1, "test")


def test_the_policy_gets_only_the_apps_tools():
    names = [t["name"] for t in SlackEnv.__new__(SlackEnv).tools]
    assert names == ["submit", "list_channels", "read_channel", "post_message", "reply_in_thread", "add_reaction",
                     "search_messages"]


# --- episodes in real containers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slack_spec(docker_client) -> SandboxSpec:
    return app_spec(docker_client, SlackEnv)


@pytest.mark.docker
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_solves_doing_nothing_fails_and_runs_repeat(family, slack_spec, run_id, docker_client):
    task = make_task(family, 7)
    first = episode(SlackEnv, task, slack_spec, run_id, docker_client)
    assert (first.finish_reason, first.reward.value, first.reward.success) == ("submit", 1.0, True), first.reward
    shown = [task.instruction] + [o for t in first.turns for o in t.observations]
    for i, call in enumerate(c for t in first.turns for c in t.tool_calls):  # every id it uses was shown first
        assert all(v in "\n".join(shown[: i + 1]) for k, v in call.arguments.items() if k.endswith("_id")), call
    again = episode(SlackEnv, make_task(family, 7), slack_spec, run_id, docker_client)
    assert again.task == first.task and again.reward == first.reward
    observations = [t.observations for t in first.turns]
    assert [t.observations for t in again.turns] == observations  # same ids, same timestamps, same text
    nothing = episode(SlackEnv, task, slack_spec, run_id, docker_client, solution=[ToolCall("submit")])
    assert (nothing.reward.value, nothing.reward.success) == (0.0, False)
    assert list_run_containers(run_id, client=docker_client) == []


@pytest.fixture
def env(slack_spec, run_id, docker_client):
    env = SlackEnv(make_task("reply_in_thread", 3), slack_spec, run_id, client=docker_client)
    env.reset()
    yield env
    env.close()


def question_and_build(task) -> tuple[str, str, str]:
    """(question message id, its channel id, the right build number) of a reply_in_thread task."""
    expect = task.checks[0]["expect"][0]
    build = task.solution[2].arguments["text"].split()[-1]
    return expect[2], expect[1], build


@pytest.mark.docker
def test_acting_in_the_wrong_place_or_doing_extra_scores_zero(env):
    question, channel, build = question_and_build(env.task)
    other_thread = next(m[0] for m in env.task.setup["app"]["messages"]
                        if m[0] != question and m[1] == channel and m[4] is None)
    assert act(env, "reply_in_thread", message_id=other_thread, text=f"Build {build}").startswith("replied")
    assert score_task(env.sandbox, env.task).value == 0.0  # right words, wrong thread
    assert act(env, "reply_in_thread", message_id=question, text=f"Build {build}").startswith("replied")
    assert score_task(env.sandbox, env.task).value == 0.0  # the stray reply still counts against it


@pytest.mark.docker
def test_a_reply_naming_every_build_scores_zero(env):
    question, _, build = question_and_build(env.task)
    builds = [m[3].split()[1] for m in env.task.setup["app"]["messages"] if m[3].startswith("Build ")]
    assert build in builds and len(builds) == 4
    act(env, "reply_in_thread", message_id=question, text=" or ".join(builds))
    reward = score_task(env.sandbox, env.task)
    assert reward.value == 0.0 and "expected" in reward.reason


@pytest.mark.docker
def test_replying_to_a_reply_lands_in_the_same_thread(env):
    question, _, build = question_and_build(env.task)
    reply = next(m[0] for m in env.task.setup["app"]["messages"] if m[4] == question)
    answer = act(env, "reply_in_thread", message_id=reply, text=f"it is build {build}")
    assert answer.endswith(f"thread of [{question}]")
    assert score_task(env.sandbox, env.task).value == 1.0


@pytest.mark.docker
def test_tool_arguments_cannot_escape_the_api(env):
    ci = "#" + env.task.setup["app"]["channels"][0][1]  # the build bot's channel
    before = query_rows(env.sandbox, DB, "SELECT count(*), (SELECT count(*) FROM users) FROM messages")
    assert act(env, "search_messages", query="' OR 1=1 --") == "no messages contain \"' OR 1=1 --\""
    assert act(env, "search_messages", query="%").startswith("no messages contain")  # a literal %, not a wildcard
    assert act(env, "search_messages", query="x'); DROP TABLE messages; --").startswith("no messages contain")
    assert act(env, "read_channel", channel="../../etc/passwd").startswith("Error: no channel '../../etc/passwd'")
    assert act(env, "reply_in_thread", message_id="m001' OR '1'='1", text="hi").startswith("Error: no message")
    assert act(env, "add_reaction", message_id="m001", emoji="x; rm -rf /").startswith("Error: 'x; rm -rf /' is not")
    shell = "$(touch /tmp/pwned) `touch /tmp/pwned2` '; touch /tmp/pwned3 #"
    assert act(env, "post_message", channel=ci, text=shell).startswith("posted")
    assert query_rows(env.sandbox, DB, "SELECT count(*), (SELECT count(*) FROM users) FROM messages") == \
        [[before[0][0] + 1, before[0][1]]]
    assert query_rows(env.sandbox, DB, "SELECT text FROM messages WHERE user_id = 'U00'") == [[shell]]
    found = env.sandbox.exec("find /tmp /workspace -name 'pwned*' | wc -l", user="root", session=False)
    assert found.output.strip() == "0"
    assert act(env, "read_channel", channel=7).startswith("Error: read_channel: 'channel' must be string")
    assert act(env, "post_message", channel=ci, text="x" * 5000).startswith("Error: the message is 5000")
    assert act(env, "search_messages", query="x" * 200_000).startswith("Error: search.messages: the arguments are")


@pytest.mark.docker
def test_the_database_is_out_of_the_policys_reach(env):
    sandbox = env.sandbox
    listing = sandbox.exec(f"stat -c '%U %a %n' {APP_DIR} {DB}", user="root", session=False).output.split("\n")
    assert listing[:2] == [f"root 755 {APP_DIR}", f"root 600 {DB}"]
    write = f"python3 -c \"import sqlite3; sqlite3.connect('{DB}').execute('DELETE FROM messages')\""
    assert sandbox.exec(write).exit_code != 0  # as the sandbox user, even with a shell it would have no way in
    assert sandbox.exec(f"touch {APP_DIR}/x").exit_code != 0
    # no network but the sandbox's own loopback, where the app listens
    probe = "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\""
    assert "Network is unreachable" in sandbox.exec(probe).output


@pytest.mark.docker
def test_the_app_server_keeps_running_through_the_episode(env):
    pid = env.sandbox.exec(f"cat {APP_DIR}/ready", user="root", session=False).output.strip()
    for _ in range(3):
        assert act(env, "list_channels").count("#") == 4
    owner = env.sandbox.exec(f"ps -o user=,pid= -p {pid}", user="root", session=False).output.split()
    assert owner == ["root", pid]
    env.sandbox.exec("sleep 1")
    ci = env.task.setup["app"]["channels"][0][1]
    assert f"#{ci}" in act(env, "read_channel", channel=ci) and act(env, "search_messages", query="deploy")


@pytest.mark.docker
def test_a_dead_app_fails_the_episode_instead_of_scoring_it(env):
    pid = env.sandbox.exec(f"cat {APP_DIR}/ready", user="root", session=False).output.strip()
    env.sandbox.exec(f"kill -9 {pid}", user="root", session=False)
    with pytest.raises(SandboxError, match="the slack app failed on conversations.list: the app is not answering"):
        env.step(ToolCall("list_channels"))


@pytest.mark.docker
def test_a_task_whose_seed_the_app_rejects_fails_at_reset(slack_spec, run_id, docker_client):
    task = make_task("post_message", 1)
    broken = dataclasses.replace(task, setup={"app": {"me": "U00", "channels": []}})
    env = SlackEnv(broken, slack_spec, run_id, client=docker_client)
    with pytest.raises(SandboxError, match="(?s)slack app could not start: the app server did not start:.*KeyError"):
        env.reset()
    assert list_run_containers(run_id, client=docker_client) == []  # the failed sandbox is gone


# --- the shipped config trains ------------------------------------------------------------------------------------

@pytest.mark.docker
@pytest.mark.slow
def test_configs_slack_yaml_trains_one_step(tmp_path, slack_spec):
    rows = train_one_step("configs/slack.yaml", tmp_path / "run")
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [0]
    assert rows[-1]["episodes/count"] == 2 and rows[-1]["episodes/failed"] == 0  # the app started in pooled sandboxes
    assert "success/slack" in rows[-1]
