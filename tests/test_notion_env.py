"""The notion env on real containers: reference solutions score 1 through the real agent loop, doing nothing or
changing the wrong thing scores 0, runs repeat exactly, and tool arguments cannot reach past the app's API."""

from __future__ import annotations

import pytest
from app_episodes import act, app_spec, episode, train_one_step
from seeded import notion_task as make_task

from sandforge.environments.notion.env import NotionEnv, parse_blocks
from sandforge.environments.notion.tasks import FAMILIES
from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.environments.tools import ToolError
from sandforge.environments.words import split_of
from sandforge.types import ToolCall
from sandforge.verifiers.checks import score_task
from sandforge.verifiers.state import query_rows

DB = NotionEnv.db_path()

# --- tasks and block text, no Docker ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tasks_are_deterministic_varied_and_split_apart(family):
    assert make_task(family, 11) == make_task(family, 11)
    assert len({t.instruction for t in (make_task(family, s) for s in range(20))}) > 15
    train, held = make_task(family, 4), make_task(family, 4, "heldout")
    assert (train.id, held.id) == (f"notion/{family}/4", f"notion/{family}/heldout/4")
    assert train.checks[0]["verifier"] == "sql" and train.checks[0]["db"] == DB
    assert train.solution[-1] == ToolCall("submit")
    for task in (train, held):  # every title is made of words of the task's split
        titles = [p[3] for p in task.setup["app"]["pages"]] + [d[2] for d in task.setup["app"]["databases"]]
        assert {split_of(w) for t in titles for w in t.lower().split() if w not in ("the", "notes")} == {task.split}


def test_unknown_family_is_explained():
    with pytest.raises(ValueError, match="unknown notion task family 'rename'.*create_page"):
        make_task("rename", 1)


def test_the_policy_gets_only_the_apps_tools():
    names = [t["name"] for t in NotionEnv.__new__(NotionEnv).tools]
    assert names == ["submit", "search", "get_page", "create_page", "append_blocks", "update_page_properties",
                     "query_database"]


def test_block_lines_become_a_nested_tree():
    tree = parse_blocks("t", "# Plan\nsome text\n- one\n  - one.a\n    [x] done\n  - one.b\n[ ] later\n")
    assert tree == [
        {"type": "heading", "text": "Plan", "children": []},
        {"type": "paragraph", "text": "some text", "children": []},
        {"type": "bullet", "text": "one", "children": [
            {"type": "bullet", "text": "one.a", "children": [
                {"type": "todo", "text": "done", "checked": True, "children": []}]},
            {"type": "bullet", "text": "one.b", "children": []}]},
        {"type": "todo", "text": "later", "checked": False, "children": []},
    ]
    with pytest.raises(ToolError, match="line 2 is nested two levels below"):
        parse_blocks("t", "- a\n    - b")
    with pytest.raises(ToolError, match="line 1 is indented by 1 spaces"):
        parse_blocks("t", " - a")
    with pytest.raises(ToolError, match="no blocks given"):
        parse_blocks("t", "\n  \n")


# --- episodes in real containers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def notion_spec(docker_client) -> SandboxSpec:
    return app_spec(docker_client, NotionEnv)


@pytest.mark.docker
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reference_solves_doing_nothing_fails_and_runs_repeat(family, notion_spec, run_id, docker_client):
    task = make_task(family, 7)
    first = episode(NotionEnv, task, notion_spec, run_id, docker_client)
    assert (first.finish_reason, first.reward.value, first.reward.success) == ("submit", 1.0, True), first.reward
    shown = [task.instruction] + [o for t in first.turns for o in t.observations]
    for i, call in enumerate(c for t in first.turns for c in t.tool_calls):  # every id it uses was shown first
        assert all(v in "\n".join(shown[: i + 1]) for k, v in call.arguments.items() if k.endswith("_id")), call
    again = episode(NotionEnv, make_task(family, 7), notion_spec, run_id, docker_client)
    assert again.task == first.task and again.reward == first.reward
    assert [t.observations for t in again.turns] == [t.observations for t in first.turns]
    nothing = episode(NotionEnv, task, notion_spec, run_id, docker_client, solution=[ToolCall("submit")])
    assert (nothing.reward.value, nothing.reward.success) == (0.0, False)


def started(family: str, spec, run_id, client, seed: int = 2) -> NotionEnv:
    env = NotionEnv(make_task(family, seed), spec, run_id, client=client)
    env.reset()
    return env


@pytest.mark.docker
def test_changing_the_wrong_thing_scores_zero(notion_spec, run_id, docker_client):
    env = started("create_page", notion_spec, run_id, docker_client)
    good = env.task.solution[1].arguments
    wrong_parent = next(p[0] for p in env.task.setup["app"]["pages"] if p[0] != good["parent_id"])
    assert act(env, "create_page", **{**good, "parent_id": wrong_parent}).startswith("created page")
    assert score_task(env.sandbox, env.task).value == 0.0
    env.close()

    env = started("update_property", notion_spec, run_id, docker_client)
    good = env.task.solution[2].arguments
    row_db = next(p[2] for p in env.task.setup["app"]["pages"] if p[0] == good["page_id"])
    other_row = next(p[0] for p in env.task.setup["app"]["pages"] if p[2] and p[2] != row_db)
    assert act(env, "update_page_properties", **{**good, "page_id": other_row}).startswith("updated")
    assert score_task(env.sandbox, env.task).value == 0.0
    assert act(env, "update_page_properties", **good).startswith("updated")
    assert score_task(env.sandbox, env.task).value == 0.0  # the stray change still counts against it
    env.close()

    env = started("append_blocks", notion_spec, run_id, docker_client)
    good = env.task.solution[2].arguments
    page = env.task.solution[1].arguments["page_id"]
    assert act(env, "append_blocks", block_id=page, blocks=good["blocks"]).startswith("added 1 blocks")
    reward = score_task(env.sandbox, env.task)  # on the right page, but not nested under the bullet
    assert reward.value == 0.0 and "expected" in reward.reason
    env.close()


@pytest.mark.docker
def test_nesting_under_the_look_alike_bullet_on_another_page_scores_zero(notion_spec, run_id, docker_client):
    env = started("append_blocks", notion_spec, run_id, docker_client)
    good = env.task.solution[2].arguments
    target_text = next(b[4] for b in env.task.setup["app"]["blocks"] if b[0] == good["block_id"])
    twins = [b[0] for b in env.task.setup["app"]["blocks"] if b[4] == target_text and b[0] != good["block_id"]]
    assert twins
    act(env, "append_blocks", block_id=twins[0], blocks=good["blocks"])
    assert score_task(env.sandbox, env.task).value == 0.0
    env.close()


@pytest.mark.docker
def test_tool_arguments_cannot_escape_the_api(notion_spec, run_id, docker_client):
    env = started("update_property", notion_spec, run_id, docker_client)
    counts = ("SELECT (SELECT count(*) FROM pages), (SELECT count(*) FROM blocks), "
              "(SELECT count(*) FROM property_values)")
    before = query_rows(env.sandbox, DB, counts)
    assert act(env, "search", query="' OR 1=1 --") == "nothing is titled with \"' OR 1=1 --\""
    assert act(env, "search", query="%_") == "nothing is titled with '%_'"
    assert act(env, "get_page", page_id="../../etc/passwd").startswith("Error: no page with id '../../etc/passwd'")
    assert act(env, "get_page", page_id="p01' OR '1'='1").startswith("Error: no page")
    database = env.task.solution[1].arguments["database_id"]
    assert act(env, "query_database", database_id=database, filter="Status = Done' OR '1'='1").startswith(
        "Error: 'Status' is a select: use one of 'Todo', 'In progress', 'Done'")
    assert act(env, "query_database", database_id="d01; DROP TABLE pages").startswith("Error: no database")
    page = env.task.solution[2].arguments["page_id"]
    assert act(env, "update_page_properties", page_id=page, properties="{Status: Done}").startswith(
        "Error: update_page_properties: 'properties' must be a JSON object like {\"Status\": \"Done\"} (Expecting")
    assert act(env, "update_page_properties", page_id=page, properties='{"Points": "3"}').startswith(
        "Error: 'Points' is a number")
    assert act(env, "update_page_properties", page_id=page, properties='{"Owner": "me"}').startswith(
        "Error: the database has no property 'Owner'")
    assert act(env, "update_page_properties", page_id="p01", properties='{"Status": "Done"}').startswith(
        "Error: page p01")
    assert act(env, "create_page", parent_id="../p01", title="x").startswith("Error: no page with id '../p01'")
    assert query_rows(env.sandbox, DB, counts) == before
    assert query_rows(env.sandbox, DB, "SELECT count(*) FROM property_values WHERE updated_by = 'agent'") == [[0]]
    assert score_task(env.sandbox, env.task).value == 0.0
    env.close()


@pytest.mark.docker
def test_filters_and_nested_blocks_round_trip(notion_spec, run_id, docker_client):
    env = started("update_property", notion_spec, run_id, docker_client)
    database = env.task.solution[1].arguments["database_id"]
    rows = act(env, "query_database", database_id=database).splitlines()[1:]
    done = act(env, "query_database", database_id=database, filter="Status = Done").splitlines()[1:]
    assert [r for r in rows if 'Status: "Done"' in r] == ([] if done == ["(no rows)"] else done)
    parent = env.task.setup["app"]["pages"][0][0]
    made = act(env, "create_page", parent_id=parent, title="Plan", blocks="- one\n  [x] two\n# three")
    page_id = made.split()[2].rstrip(":")
    shown = act(env, "get_page", page_id=page_id).splitlines()
    assert shown[0].startswith(f"page {page_id}: Plan (in {parent}:")
    assert [line.split("] ", 1)[1] for line in shown[1:]] == ["- one", "[x] two", "# three"]
    assert shown[2].startswith("  [")  # nested under "one"
    env.close()


# --- the shipped config trains ------------------------------------------------------------------------------------

@pytest.mark.docker
@pytest.mark.slow
def test_configs_notion_yaml_trains_one_step(tmp_path, notion_spec):
    rows = train_one_step("configs/notion.yaml", tmp_path / "run")
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [0]
    assert rows[-1]["episodes/count"] == 2 and rows[-1]["episodes/failed"] == 0  # the app started in pooled sandboxes
    assert "success/notion" in rows[-1]
