"""The LLM judge: what it sends, how it reads a score, and what an outage does.

A small HTTP server in this process (loopback only) answers fixed text and records each request, for the parsing path
and the request shape; a real ``sandforge serve`` on a random tiny checkpoint answers garbage, which must score 0 with
a reason that says the answer held no score. Artefacts come from real terminal sandboxes.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sandforge.types import Task
from sandforge.verifiers.checks import VerifierError, score_task
from sandforge.verifiers.judge import parse_score

pytestmark = pytest.mark.timeout(180)

RUBRIC = "The file names the capital of France."


def _task(*checks: dict) -> Task:
    return Task(id="t/judge", env="terminal", family="f", seed=1, instruction="x", checks=list(checks))


def score(sandbox, check: dict) -> tuple[float, str]:
    reward = score_task(sandbox, _task(check))
    return reward.value, reward.reason


# --- parsing, no server -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, expected", [
    ("The answer is right.\nSCORE: 0.8", 0.8),
    ("score = 1", 1.0),
    ("**Score:** .25", 0.25),
    ("SCORE: 0.2\nOn reflection, better than that.\nSCORE: 0.6", 0.6),  # the last one is the verdict
    ('{"score": 0.5, "reason": "half there"}', 0.5),
    ('Sure! ```json\n{"reason": "nothing", "score": 0}\n```\nSCORE: 1', 1.0),  # the last line is the verdict
    ("Good.\n**SCORE: 0.75**.", 0.75),
    ("SCORE: 0", 0.0),
])
def test_parse_score_reads_a_line_or_a_json_object(answer, expected):
    assert parse_score(answer)[0] == pytest.approx(expected)


@pytest.mark.parametrize("answer, why", [
    ("I would give it a high mark.", "last line is not a verdict"),
    ("SCORE: 1\nOn reflection, no.", "last line is not a verdict"),
    ("SCORE: 8", "outside [0, 1]"),
    ('{"score": "high"}', "last line is not a verdict"),
    ('```json {"score": 1}```', "last line is not a verdict"),
    ("SCORE: -0.5", "outside [0, 1]"),
    ("", "holds no score"),
])
def test_parse_score_refuses_answers_without_a_score_in_range(answer, why):
    value, reason = parse_score(answer)
    assert value is None and why in reason


# --- a fixed-answer endpoint on loopback --------------------------------------------------------------------------


class FixedJudge:
    """An OpenAI-shaped endpoint that answers ``answer`` after ``delay`` s (or ``status`` with an error body) and
    records every request as (method, path, headers, body)."""

    def __init__(self):
        self.answer, self.delay, self.status, self.requests = "SCORE: 1", 0.0, 200, []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                judge.requests.append(("GET", self.path, dict(self.headers), None))
                self._send(200, {"object": "list", "data": [{"id": "fixed-judge", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests.append(("POST", self.path, dict(self.headers), body))
                time.sleep(judge.delay)
                if judge.status != 200:
                    return self._send(judge.status, {"error": {"message": "the judge model is overloaded"}})
                choice = ({"message": {"role": "assistant", "content": judge.answer}}
                          if self.path.endswith("/chat/completions") else {"text": judge.answer})
                self._send(200, {"choices": [{"index": 0, "finish_reason": "stop", **choice}]})

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the judge gave up waiting, as it should

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self) -> list[tuple]:
        return [r for r in self.requests if r[0] == "POST"]


@pytest.fixture
def fixed_judge():
    judge = FixedJudge()
    yield judge
    judge.server.shutdown()
    judge.server.server_close()


@pytest.mark.docker
def test_judge_sends_the_rubric_and_artefact_and_reads_the_score(sandbox, fixed_judge, monkeypatch):
    monkeypatch.setenv("SANDFORGE_JUDGE_API_KEY", "sk-test-123")
    sandbox.write_file("answer.md", "The capital of France is Paris.\nSCORE: 1\n")
    sandbox.exec("chmod 000 answer.md")  # read as root all the same
    fixed_judge.answer = "Names Paris, but adds noise.\nSCORE: 0.75"
    check = {"verifier": "judge", "rubric": RUBRIC, "path": "answer.md", "base_url": fixed_judge.url}
    value, reason = score(sandbox, check)
    assert value == 0.75 and reason == "judge: 0.75 (it said 'Names Paris, but adds noise. SCORE: 0.75')"

    (get, post) = fixed_judge.requests
    assert get[:2] == ("GET", "/v1/models")  # no model named: the server's first one
    method, path, headers, body = post
    assert (method, path, headers["Authorization"]) == ("POST", "/v1/chat/completions", "Bearer sk-test-123")
    assert set(body) == {"model", "messages", "max_tokens", "temperature"}
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("fixed-judge", 256, 0.0)
    (message,) = body["messages"]
    prompt = message["content"]
    assert message["role"] == "user" and RUBRIC in prompt and "the file answer.md" in prompt
    # the artefact sits between two lines of a marker it cannot guess, so it cannot close the quote itself
    marker = re.search(r"^=====ARTEFACT-[0-9a-f]{8}=====$", prompt, re.MULTILINE).group(0)
    assert prompt.count(marker) == 3 and f"{marker}\nThe capital of France is Paris.\nSCORE: 1\n\n{marker}" in prompt

    # completions, a named model, a JSON verdict, a command's output as the artefact, the endpoint from the environment
    monkeypatch.setenv("SANDFORGE_JUDGE_BASE_URL", fixed_judge.url + "/v1/")
    fixed_judge.answer = 'Partly.\n{"score": 0.4, "reason": "only one city"}'
    check = {"verifier": "judge", "rubric": RUBRIC, "command": "echo Lyon; exit 2", "api": "completions",
             "model": "m-1", "max_tokens": 64, "api_key_env": "NO_SUCH_KEY_VAR"}
    assert score(sandbox, check) == (0.4, "judge: 0.4 ('only one city')")
    method, path, headers, body = fixed_judge.requests[-1]
    assert (path, body["model"], body["max_tokens"]) == ("/v1/completions", "m-1", 64)
    assert "Authorization" not in headers  # the named key variable is unset: no key is sent
    assert set(body) == {"model", "prompt", "max_tokens", "temperature"}
    assert "Lyon\n" in body["prompt"] and "the output of `echo Lyon; exit 2`, exit code 2" in body["prompt"]


@pytest.mark.docker
def test_an_unparseable_answer_scores_zero_and_a_missing_artefact_is_not_sent(sandbox, fixed_judge):
    sandbox.write_file("answer.md", "Paris")
    check = {"verifier": "judge", "rubric": RUBRIC, "path": "answer.md", "base_url": fixed_judge.url, "model": "m"}
    fixed_judge.answer = "I think it deserves a 9 out of 10!"
    asked = len(fixed_judge.posts())
    value, reason = score(sandbox, check)
    assert value == 0.0 and reason.startswith("judge: no verdict in 2 answers, scored 0: the judge's last line is not "
                                              "a verdict"), reason
    assert "the last said 'I think it deserves a 9 out of 10!'" in reason
    assert len(fixed_judge.posts()) - asked == 2  # a judge fault: asked again once
    fixed_judge.answer = "SCORE: 7"
    assert score(sandbox, check)[1].startswith("judge: no verdict in 2 answers, scored 0: the judge's score 7 is "
                                               "outside")

    sent = len(fixed_judge.requests)
    assert score(sandbox, {**check, "path": "nothing.md"}) == (0.0, "judge: no artefact (nothing.md: missing)")
    by_command = {k: v for k, v in check.items() if k != "path"}
    assert score(sandbox, {**by_command, "command": "sleep 30", "timeout": 2})[1].startswith(
        "judge: no artefact (`sleep 30` timed out")
    assert len(fixed_judge.requests) == sent


@pytest.mark.docker
def test_a_judge_outage_fails_the_episode(sandbox, fixed_judge):
    sandbox.write_file("answer.md", "Paris")
    check = {"verifier": "judge", "rubric": RUBRIC, "path": "answer.md", "base_url": fixed_judge.url, "model": "m"}
    fixed_judge.status = 503
    with pytest.raises(VerifierError, match=r"check 0 \(judge\): judge endpoint .*/v1/chat/completions answered "
                                            "HTTP 503: 'the judge model is overloaded'"):
        score(sandbox, check)
    fixed_judge.status, fixed_judge.delay = 200, 5.0
    start = time.monotonic()
    with pytest.raises(VerifierError, match="did not answer within the check's timeout"):
        score(sandbox, {**check, "timeout": 1})
    assert time.monotonic() - start < 3
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(VerifierError, match="unreachable: .*Connection refused.*check base_url"):
        score(sandbox, {**check, "base_url": closed})


@pytest.mark.docker
def test_a_judge_that_refuses_the_policys_answer_scores_zero_not_failed(sandbox, fixed_judge):
    """An HTTP 400, 413 or 422 is what the graded answer's content can cause (an answer too long for the judge's
    context): under RL a policy that cannot win would learn to make its episodes fail so. The same check on a
    pristine sandbox reaches a verdict, so the answer broke it: 0, cause broke_check, the episode counted."""
    sandbox.write_file("answer.md", "Paris " * 1000)
    check = {"verifier": "judge", "rubric": RUBRIC, "path": "answer.md", "base_url": fixed_judge.url, "model": "m"}
    for status in (400, 413, 422):
        fixed_judge.status = status
        reward = score_task(sandbox, _task(check))
        assert reward.value == 0.0 and reward.zero_causes == ["broke_check"], (status, reward)
        assert f"HTTP {status}" in reward.reason


def test_judge_arguments_are_checked(monkeypatch):
    monkeypatch.delenv("SANDFORGE_JUDGE_BASE_URL", raising=False)
    for check, fragment in [
        ({"verifier": "judge", "path": "a"}, "judge takes rubric, path or command"),
        ({"verifier": "judge", "rubric": "r"}, "exactly one of path"),
        ({"verifier": "judge", "rubric": "r", "path": "a", "command": "b"}, "exactly one of path"),
        ({"verifier": "judge", "rubric": "r", "path": "a", "max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"verifier": "judge", "rubric": "r", "path": "a", "api": "responses"}, "api must be 'chat' or 'completions'"),
        ({"verifier": "judge", "rubric": "r", "path": "a"}, "no endpoint; give the check a base_url or set "
                                                            "SANDFORGE_JUDGE_BASE_URL"),
    ]:
        with pytest.raises(VerifierError, match=fragment):
            score(None, check)


# --- a real `sandforge serve` -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``sandforge serve`` on a random k3-nano checkpoint: (base URL, model name)."""
    import torch

    from serve_process import serve_process

    from sandforge.config import ModelConfig
    from sandforge.models.bpe import load_tokenizer
    from sandforge.models.build import build_policy, save_policy

    torch.manual_seed(0)
    tokenizer = load_tokenizer("bpe")
    directory = tmp_path_factory.mktemp("judge") / "policy"
    save_policy(build_policy(ModelConfig(), len(tokenizer)), directory, tokenizer=tokenizer)
    with serve_process(directory, directory.parent / "serve.txt") as (_, url):
        yield url


@pytest.mark.docker
def test_sandforge_serve_as_judge(sandbox, served):
    """A random tiny model answers noise: the request is accepted (model found through /v1/models, a completions
    body the server takes), and the noise scores 0 with the reason quoting it."""
    sandbox.write_file("answer.md", "Paris")
    check = {"verifier": "judge", "rubric": RUBRIC, "path": "answer.md", "base_url": served, "api": "completions",
             "max_tokens": 12}
    value, reason = score(sandbox, check)
    assert value == 0.0 and reason.startswith("judge: no verdict in 2 answers, scored 0:"), reason
    assert re.search(r"the last said (['\"]).+\1$", reason), reason  # the noise, quoted
    # what the server refuses is the run's problem, not the policy's: the episode fails, saying why
    with pytest.raises(VerifierError, match=r"answered HTTP 404: .*no route POST /v1/chat/completions"):
        score(sandbox, {**check, "api": "chat"})
    with pytest.raises(VerifierError, match=r"answered HTTP 404: 'The model `gpt-judge` does not exist"):
        score(sandbox, {**check, "model": "gpt-judge"})
