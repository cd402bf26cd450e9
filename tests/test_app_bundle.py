"""The mock apps' bundles (environments/apps/env.py): each app module runs beside the shared server, and reads its
arguments through the server's one ``text_arg``: Slack keeps a message's text as sent, Notion strips ids and titles.
Runs the bundle with the host's python, no Docker (the docker tests of test_slack_env.py / test_notion_env.py run it
in sandboxes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sandforge.environments.apps.env import app_bundle
from sandforge.environments.notion.env import NotionEnv
from sandforge.environments.slack.env import SlackEnv

CALL = """import json, sys
sys.path.insert(0, sys.argv[1])
import app, server
results = []
for key, args, strip, required in json.loads(sys.argv[2]):
    try:
        results.append(server.text_arg(args, key, required=required, strip=strip))
    except ValueError as e:
        results.append("ValueError: " + str(e))
print(json.dumps([results, sorted(app.METHODS)]))
"""


@pytest.mark.parametrize("env", [SlackEnv, NotionEnv])
def test_each_app_imports_beside_the_server_and_its_arguments_are_read_one_way(env, tmp_path):
    bundle = tmp_path / "app.pyz"
    bundle.write_bytes(app_bundle(env.app_module))
    cases = [["text", {"text": "  hi  "}, False, True], ["id", {"id": " p01 "}, True, True],
             ["text", {"text": 3}, False, True], ["text", {"text": "  "}, False, True], ["q", {}, True, False]]
    out = subprocess.run([sys.executable, "-c", CALL, str(bundle), json.dumps(cases)], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    results, methods = json.loads(out)
    assert results == ["  hi  ", "p01", "ValueError: 'text' must be a string", "ValueError: 'text' must not be empty",
                       ""]
    assert methods  # the app module loaded, with its `from server import text_arg`
