"""The failure rule (#56) at the recording proxy: whatever a harness sends is the policy's doing, so no request, of any
shape, fails the episode. Faults drawn by hypothesis go to a real proxy over its Unix socket, the harness's side:
honest bodies of each surface (chat completions, Responses, Anthropic Messages) with a field corrupted, bytes that
are not JSON, a body cut short, a wrong path, method or token, and bytes that are not HTTP at all. After each the
episode has not failed and the proxy answered with no 5xx; after them all an honest request is still served (unless
the faults spent the episode's request budget, which ends it as a budget does, not as a failure). A fault of the
engine still fails the episode."""

from __future__ import annotations

import json
import random
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_proxy import TOKEN, ScriptedEngine, Served
from test_proxy_boundary import (
    CHAT_KEYS, HONEST_CHAT, HONEST_MESSAGES, HONEST_RESPONSES, MESSAGES_KEYS, RESPONSES_KEYS, json_value,
    one_field_corrupted)

SURFACES = {  # path -> (an honest body, the keys a corruption draws from)
    "/v1/chat/completions": (HONEST_CHAT, CHAT_KEYS),
    "/v1/responses": (HONEST_RESPONSES, RESPONSES_KEYS),
    "/v1/messages": (HONEST_MESSAGES, MESSAGES_KEYS),
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KINDS = ("corrupted", "random_json", "not_json", "cut_short", "wrong_path", "wrong_method", "wrong_token",
         "not_http")


def send(s: Served, kind: str, path: str, rng: random.Random) -> int | None:
    """One faulty request of ``kind`` to the proxy; its status (None where no HTTP answer is expected)."""
    honest, keys = SURFACES[path]
    if kind == "not_http" or kind == "cut_short":
        body = json.dumps(honest).encode()
        if kind == "cut_short":  # a Content-Length the body never reaches, then the connection goes
            head = (f"POST {path} HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            raw = head + body[:rng.randrange(len(body))]
        else:
            raw = rng.randbytes(rng.randrange(1, 400))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(s.socket)
            conn.sendall(raw)
        return None
    http = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket), timeout=30)
    url = f"http://proxy{path}"
    if kind in ("corrupted", "random_json"):  # NaN and Infinity too, as Python's json writes them
        value = one_field_corrupted(rng, honest, keys) if kind == "corrupted" else json_value(rng, keys)
        return http.post(url, content=json.dumps(value).encode(), headers={**AUTH, "Content-Type": "application/json"}
                         ).status_code
    if kind == "not_json":
        return http.post(url, content=rng.randbytes(rng.randrange(1, 400)), headers=AUTH).status_code
    if kind == "wrong_path":
        return http.post(f"http://proxy/v1/{rng.choice(['completions', 'embeddings', 'x', ''])}", json=honest,
                         headers=AUTH).status_code
    if kind == "wrong_method":
        return http.request(rng.choice(["GET", "PUT", "DELETE", "PATCH"]), url, headers=AUTH).status_code
    return http.post(url, json=honest, headers={"Authorization": f"Bearer {rng.choice(['none', 'x', TOKEN + 'x'])}"}
                     ).status_code


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(sorted(SURFACES))), min_size=1, max_size=5),
       seed=st.integers(0, 2**32 - 1))
def test_no_request_of_any_shape_fails_the_episode(tmp_path_factory, faults, seed):
    rng = random.Random(seed)
    s = Served(tmp_path_factory.mktemp("proxy"), ScriptedEngine([]))
    try:
        for kind, path in faults:
            status = send(s, kind, path, rng)
            assert status is None or status < 500, (kind, path, status)
            assert s.proxy.failure == "", (kind, path, s.proxy.failure)
        for path, (honest, _) in SURFACES.items():
            answer = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket), timeout=30).post(
                f"http://proxy{path}", json={**honest, "stream": False}, headers=AUTH)
            if s.proxy.ended is None:
                assert answer.status_code == 200, (path, answer.text)
            else:  # the faults and answers spent the budget: the episode ends as a budget ends it
                assert s.proxy.ended == "max_turns" and answer.status_code == 400, (s.proxy.ended, answer.text)
        assert s.proxy.failure == ""
    finally:
        s.close()


def test_a_body_that_never_arrives_whole_is_refused_and_counted(tmp_path):
    """A harness that sends a Content-Length its body never reaches and goes: a refusal against the episode's
    budget like any other (it raised ConnectionResetError in the handler before, a free request and a traceback)."""
    s = Served(tmp_path, ScriptedEngine([]))
    try:
        send(s, "cut_short", "/v1/chat/completions", random.Random(3))
        for _ in range(500):  # the handler sees the connection go after the client has
            if s.proxy.refused:
                break
            time.sleep(0.02)
        assert len(s.proxy.refused) == 1 and "never arrived" in s.proxy.refused[0], s.proxy.refused
        assert s.proxy.failure == "" and s.proxy.ended is None
    finally:
        s.close()


def test_a_fault_of_the_engine_still_fails_the_episode(tmp_path):
    s = Served(tmp_path, ScriptedEngine([], fail=True))
    try:
        answer = httpx.Client(transport=httpx.HTTPTransport(uds=s.socket), timeout=30).post(
            "http://proxy/v1/messages", json={**HONEST_MESSAGES, "stream": False}, headers=AUTH)
        assert answer.status_code == 503 and s.proxy.failure == "engine: gone" and s.proxy.ended == "engine"
    finally:
        s.close()
