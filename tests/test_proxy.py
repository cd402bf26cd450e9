"""The recording proxy's HTTP side (rollout/proxy.py), on a real Unix socket, driven by the real OpenAI client: what
a harness is answered, who is refused, and how budgets and a failing engine end the episode."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from agent_fakes import CHAT, limits

from sandforge.rollout.chat_api import ChatRequest, TokensAsked, read_request
from sandforge.rollout.policy_client import PolicyError
from sandforge.rollout.proxy import EpisodeProxy, ProxyBudget
from sandforge.types import GenerateRequest, Message, Sample, ToolCall

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
TOKEN = "episode-token"


class ScriptedEngine:
    """Answers each request with the next reply; records the requests."""

    def __init__(self, replies: list[Message], fail: bool = False):
        self.replies, self.fail = list(replies), fail
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> Sample:
        self.requests.append(request)
        if self.fail:
            raise PolicyError("engine: gone")
        ids = CHAT.render_assistant(self.replies.pop(0) if self.replies else Message(role="assistant", content="done"))
        return Sample(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="stop", version=7)

    async def close_session(self, session_id: str) -> None:
        pass


class Served:
    """A proxy on its own event loop in a thread, as the rollout worker runs it beside its episodes."""

    def __init__(self, tmp_path, engine, **budget):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.socket = str(tmp_path / "proxy.sock")
        ctx = budget.pop("ctx", 4096)
        b = ProxyBudget(**{"max_requests": 10, "max_tokens": 10_000, **budget})
        self.proxy = EpisodeProxy(self.socket, TOKEN, engine, CHAT, limits(max_context=ctx), b,
                                  "s/1", seed=5)
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)

    def client(self, token: str = TOKEN) -> openai.OpenAI:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=self.socket))
        return openai.OpenAI(base_url="http://proxy/v1", api_key=token, http_client=http, max_retries=0)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def served(tmp_path):
    made = []

    def make(engine, **budget):
        made.append(Served(tmp_path, engine, **budget))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_tool_call_comes_back_as_openai_tool_calls_and_is_recorded(served):
    engine = ScriptedEngine([Message(role="assistant", reasoning="look first",
                                     tool_calls=[ToolCall("bash", {"command": "ls -la"})])])
    s = served(engine)
    client = s.client()
    messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": "list the files"}]
    r = client.chat.completions.create(model="anything", messages=messages, tools=TOOLS, temperature=0.0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "bash"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"command": "ls -la"}
    assert r.usage.completion_tokens == len(s.proxy.recorder.rows[0].token_ids) - r.usage.prompt_tokens
    assert engine.requests[0].temperature == limits().temperature  # the job's, not the harness's 0.0

    echo = msg.model_dump(exclude_none=True)
    messages += [echo, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "a.txt"}]
    r2 = client.chat.completions.create(model="anything", messages=messages, tools=TOOLS)
    assert r2.choices[0].message.content == "done"
    rows = s.proxy.recorder.rows
    assert len(rows) == 1  # the echo kept its reasoning: one row
    assert engine.requests[1].prompt_ids[: len(engine.requests[0].prompt_ids)] == engine.requests[0].prompt_ids
    assert sum(rows[0].loss_mask) == r.usage.completion_tokens + r2.usage.completion_tokens
    assert engine.requests[1].session_id == "s/1" and engine.requests[0].seed != engine.requests[1].seed


def test_another_token_or_none_is_refused(served):
    s = served(ScriptedEngine([]))
    for token in ("not-it", TOKEN + "x", TOKEN[:-1]):
        with pytest.raises(openai.AuthenticationError):
            s.client(token).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    http = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert http.post("http://proxy/v1/chat/completions", json=body).status_code == 401
    assert http.get("http://proxy/v1/models").status_code == 401
    assert not s.proxy.recorder.turns


@pytest.mark.parametrize("extra, says", [({"stream": "yes"}, "stream"), ({"n": 2}, "n=2"),
                                         ({"stop": ["\n"]}, "stop"),
                                         ({"messages": [{"role": "assistant", "content": "prefill"}]}, "prefilled"),
                                         ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                                          "text content")])
def test_what_is_not_served_gets_a_400_that_says_so_and_the_episode_goes_on(served, extra, says):
    s = served(ScriptedEngine([]))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    http = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket))
    r = http.post("http://proxy/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and says in r.json()["error"]["message"]
    bad = http.post("http://proxy/v1/chat/completions", content=b"{not json",
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert bad.status_code == 400
    ok = s.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert ok.choices[0].message.content == "done" and s.proxy.ended is None


def test_a_streamed_request_gets_the_whole_reply_as_events_and_is_recorded_like_any(served):
    engine = ScriptedEngine([Message(role="assistant", reasoning="look first",
                                     tool_calls=[ToolCall("bash", {"command": "ls"})]),
                             Message(role="assistant", content="all done")])
    s = served(engine)
    client = s.client()
    messages = [{"role": "user", "content": "list the files"}]
    stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [c for ch in chunks for choice in ch.choices for c in (choice.delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("bash", {"command": "ls"})]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == sum(s.proxy.recorder.rows[0].loss_mask)

    echo = {"role": "assistant", "content": None, "reasoning_content": "look first",
            "tool_calls": [{"id": calls[0].id, "type": "function",
                            "function": {"name": "bash", "arguments": calls[0].function.arguments}}]}
    messages += [echo, {"role": "tool", "tool_call_id": calls[0].id, "content": "a.txt"}]
    # the stream the SDK assembles, as verifiers' chat program reads it
    with client.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as events:
        final = events.get_final_completion()
    assert final.choices[0].message.content == "all done" and final.choices[0].finish_reason == "stop"
    assert len(s.proxy.recorder.rows) == 1  # the streamed reply echoed back extends the row, as a plain one does


def test_a_loopback_proxy_takes_the_token_from_its_own_header(tmp_path):
    """A verifiers environment's relay sends a bearer of its own; the episode's token rides in X-Sandforge-Episode."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    proxy = EpisodeProxy(None, TOKEN, ScriptedEngine([]), CHAT, limits(), ProxyBudget(10, 10_000), "s/2")
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    try:
        assert proxy.url.startswith("http://127.0.0.1:") and proxy.url.endswith("/v1")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for headers, status in [({"Authorization": "Bearer EMPTY", "X-Sandforge-Episode": TOKEN}, 200),
                                ({"Authorization": f"Bearer {TOKEN}"}, 200),
                                ({"Authorization": f"Bearer {TOKEN}", "X-Sandforge-Episode": "other"}, 401),
                                ({"Authorization": "Bearer EMPTY"}, 401)]:
            r = httpx.post(f"{proxy.url}/chat/completions", json=body, headers=headers)
            assert r.status_code == status, (headers, r.text)
    finally:
        asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_budgets_end_the_episode_cleanly(served):
    s = served(ScriptedEngine([]), max_requests=2)
    client = s.client()
    for _ in range(2):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="2 requests are spent"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert s.proxy.ended == "max_turns" and s.proxy.over.is_set()

    long = served(ScriptedEngine([]), ctx=64)
    with pytest.raises(openai.BadRequestError, match="max_context"):
        long.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 500}])
    assert long.proxy.ended == "context"


def test_a_failing_engine_fails_the_episode_not_the_proxy(served):
    s = served(ScriptedEngine([], fail=True))
    with pytest.raises(openai.InternalServerError):
        s.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert s.proxy.failure == "engine: gone" and s.proxy.ended == "engine"


def test_a_reply_still_generating_when_the_episode_ends_is_neither_given_nor_recorded(served):
    class SlowEngine(ScriptedEngine):
        def __init__(self):
            super().__init__([])
            self.started, self.release = threading.Event(), threading.Event()

        async def generate(self, request):
            self.started.set()
            await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 10)
            return await super().generate(request)

    engine = SlowEngine()
    s = served(engine)
    out = {}
    call = threading.Thread(target=lambda: out.update(r=_post(s, {"model": "m", "messages": [
        {"role": "user", "content": "hi"}]})))
    call.start()
    assert engine.started.wait(10)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), s.loop).result(5)
    s.loop.call_soon_threadsafe(s.proxy.end)
    engine.release.set()
    call.join(10)
    assert out["r"].status_code == 400 and "over" in out["r"].json()["error"]["message"]
    assert not s.proxy.recorder.turns and not s.proxy.recorder.rows


def _post(s: Served, body: dict) -> httpx.Response:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket), timeout=30)
    return http.post("http://proxy/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TOKEN}"})


def test_the_exact_tokens_come_back_when_asked_as_vllm_returns_them(served):
    """``logprobs`` (the sampled token's), vLLM's ``return_tokens_as_token_ids`` and ``return_token_ids``: what a
    trainer reading an OpenAI-compatible server's tokens expects, equal to what the proxy records."""
    engine = ScriptedEngine([Message(role="assistant", content="one"), Message(role="assistant", content="two")])
    s = served(engine)
    http = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    r = http.post("http://proxy/v1/chat/completions", json=body, headers=auth).json()
    row = s.proxy.recorder.rows[0]
    choice = r["choices"][0]
    assert r["prompt_token_ids"] + choice["token_ids"] == row.token_ids
    assert [t["token"] for t in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [x for x, m in zip(row.logprobs, row.loss_mask) if m]

    body = {**body, "messages": [{"role": "user", "content": "hi"}], "return_tokens_as_token_ids": False,
            "return_token_ids": False, "stream": True}
    events = http.post("http://proxy/v1/chat/completions", json=body, headers=auth).text
    first = json.loads(events.split("\n\n")[0].removeprefix("data: "))
    texts = [t["token"] for t in first["choices"][0]["logprobs"]["content"]]
    assert "".join(texts).startswith("<think></think>two") and "token_ids" not in first["choices"][0]
    plain = http.post("http://proxy/v1/chat/completions", headers=auth,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert plain["choices"][0]["logprobs"] is None and "prompt_token_ids" not in plain
    refused = http.post("http://proxy/v1/chat/completions", headers=auth,
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5})
    assert refused.status_code == 400 and "top_logprobs" in refused.json()["error"]["message"]


def test_a_request_is_read_as_the_conversation_tools_and_settings_it_sends():
    """rollout/chat_api.py ``read_request`` on honest requests, lenient where OpenAI clients differ: a developer
    message is the system's, arguments come as an object or as JSON text (unparsable text kept, never refused), a tool
    result is named by its call, a tool's schema is kept as sent (its key order, keys no template reads), settings
    are recorded, and keys the proxy does not read are ignored."""
    schema = {"required": ["command"], "type": "object", "additionalProperties": False,
              "properties": {"command": {"type": "string", "description": "the command"}}}
    body = {
        "model": "policy", "temperature": 0.2, "seed": 9, "user": "me", "n": 1, "stop": [], "max_tokens": 99,
        "max_completion_tokens": 7, "stream": True, "stream_options": {"include_usage": 1}, "logprobs": 1,
        "return_token_ids": True, "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files."}]},
            {"role": "assistant", "content": None, "reasoning_content": "ls it", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
                {"id": 2, "function": {"name": "bash", "arguments": {"command": "pwd"}}},
                {"function": {"name": "bash", "arguments": "ls -la"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
            {"role": "tool", "tool_call_id": "2", "name": "shell", "content": "/"},
            {"role": "user", "content": None, "tool_calls": "only an assistant's are read"}],
        "tools": [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": schema,
                                                    "strict": True}},
                  {"function": {"name": "noop"}}]}
    asked = read_request(body)
    assert asked.messages == [
        Message(role="system", content="Be brief."), Message(role="user", content="List files."),
        Message(role="assistant", reasoning="ls it", tool_calls=[
            ToolCall("bash", {"command": "ls"}, "c1"), ToolCall("bash", {"command": "pwd"}, "2"),
            ToolCall("bash", {"__unparsed__": "ls -la"}, "")]),
        Message(role="tool", content="a.txt", name="bash", tool_call_id="c1"),
        Message(role="tool", content="/", name="shell", tool_call_id="2"), Message(role="user", content="")]
    assert asked.tools == [{"name": "bash", "description": "run", "parameters": schema}, {"name": "noop"}]
    assert list(asked.tools[0]["parameters"]) == ["required", "type", "additionalProperties", "properties"]
    assert (asked.max_tokens, asked.asked) == (7, {"model": "policy", "temperature": 0.2, "seed": 9})
    assert (asked.stream, asked.stream_usage, asked.tokens) == (True, True, TokensAsked(True, False, True))
    plain = read_request({"messages": [{"role": "user", "content": "hi"}], "tools": None, "stream_options": None,
                          "max_completion_tokens": None, "max_tokens": 5, "logprobs": False, "top_logprobs": 0})
    assert plain == ChatRequest([Message(role="user", content="hi")], [], None, {}, False, False, TokensAsked())
