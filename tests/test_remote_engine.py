"""Remote engines: ``sandforge serve`` answers OpenAI-style ``/v1/completions`` with what the embedded engine would
produce, ``RemoteEngine`` turns such answers back into engine results, and the official ``openai`` client works too.

One server (a subprocess on a tiny K3 checkpoint) serves the whole module.
"""

from __future__ import annotations

from dataclasses import replace

import asyncio
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from aiohttp import web

from serve_process import serve_process  # noqa: E402 - tests/ is on sys.path

from sandforge.types import GenerateRequest
from sandforge.config import ModelConfig
from sandforge.models.bpe import load_tokenizer
from sandforge.models.build import build_policy, load_policy, save_policy
from sandforge.engine.core import EngineCore
from sandforge.engine.remote import RemoteEngine, RemoteEngineError
from sandforge.engine.server import (ADMIN_TOKEN_FILE, Completion, RequestError, Served, _update_request, complete,
                                     load_checkpoint, parse_request, read_admin_token, served_from)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("bpe")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("serve") / "policy"
    save_policy(build_policy(ModelConfig(), len(tokenizer)), directory, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="module")
def embedded(checkpoint):
    """The in-process engine on the same checkpoint, its weights loaded as version 0 as `sandforge serve` loads them:
    what every remote answer is compared with."""
    policy = load_policy(checkpoint)
    engine, loop = EngineCore(policy, seed=0), asyncio.new_event_loop()  # the engine keeps one loop
    loop.run_until_complete(engine.load_weights(policy.state_dict(), 0))
    yield lambda request: loop.run_until_complete(engine.generate(request))
    loop.run_until_complete(engine.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    """The module server's ``--weights-dir``: the only place it loads new weights from."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(checkpoint, weights_dir, tmp_path_factory):
    """``sandforge serve CHECKPOINT --port 0 --weights-dir DIR`` in a subprocess; yields its base URL, stops it
    afterwards."""
    log = tmp_path_factory.mktemp("serve-log") / "out.txt"
    with serve_process(checkpoint, log, start_timeout=60, weights_dir=weights_dir) as (_, url):
        assert get(url + "/health")[0] == 200
        yield url


async def stub_server(completions) -> tuple[web.AppRunner, str]:
    """A local server whose ``POST /v1/completions`` is ``completions``: (its runner, to clean up; its base URL)."""
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def remote(url: str, *requests: dict) -> list[list[dict]]:
    async def run():
        async with RemoteEngine(url) as engine:
            return [await engine.generate(r) for r in requests]

    return asyncio.run(run())


def assert_same(got: dict, want: dict) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)


def prompt_of(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_id, *tokenizer.encode(text)]


def test_remote_engine_reproduces_the_embedded_engine(server, embedded, tokenizer):
    prompt = prompt_of(tokenizer, "ls -la /tmp && cat notes.txt")
    greedy = GenerateRequest(prompt_ids=prompt, max_tokens=10, temperature=0.0, stop_ids=[])
    want = embedded(greedy)[0]
    assert want.finish_reason == "length" and len(want.token_ids) == 10
    stop_at = want.token_ids[3]  # a stop id the greedy completion reaches: it must end there, stop id included
    first = want.token_ids.index(stop_at)
    stopping = replace(greedy, stop_ids=[stop_at], n=3)
    want_stop = embedded(stopping)
    assert want_stop[0].token_ids == want.token_ids[: first + 1] and want_stop[0].finish_reason == "stop"
    # top_k 1 and a tiny top_p sample the argmax at temperature 1: only right if both reach the server
    top_k = replace(greedy, temperature=1.0, top_k=1, n=2)
    top_p = replace(greedy, temperature=1.0, top_p=1e-6)

    got_greedy, got_stop, got_top_k, got_top_p = remote(server, greedy, stopping, top_k, top_p)
    assert len(got_greedy) == 1 and len(got_stop) == 3 and len(got_top_k) == 2 and len(got_top_p) == 1
    for got in got_greedy + got_top_k + got_top_p:
        assert_same(got, want)
    for got, expected in zip(got_stop, want_stop):
        assert_same(got, expected)
    # what routing replay needs crosses the wire: the experts of every token fed, and each token's weight version
    assert want.routed_experts and got_greedy[0].routed_experts == want.routed_experts
    assert got_greedy[0].version == want.version == 0
    assert got_greedy[0].token_versions == want.token_versions == [0] * 10


def test_a_seeded_request_samples_what_the_embedded_engine_samples(server, embedded, tokenizer):
    seeded = GenerateRequest(prompt_ids=prompt_of(tokenizer, "echo hi"), max_tokens=12, temperature=1.0, stop_ids=[],
              seed=7, n=2)
    want = embedded(seeded)
    [got] = remote(server, seeded)
    assert len(got) == 2 and want[0].token_ids != want[1].token_ids
    for g, w in zip(got, want):
        assert_same(g, w)


def test_a_session_reuses_the_cache_across_turns(server, embedded, tokenizer):
    turn1 = GenerateRequest(prompt_ids=prompt_of(tokenizer, "first turn"), max_tokens=6, temperature=0.0, stop_ids=[],
             session_id="episode-1")
    first = remote(server, turn1)[0][0]
    turn2 = replace(turn1, prompt_ids=turn1.prompt_ids + first.token_ids + tokenizer.encode(" observation"))
    second = remote(server, turn2)[0][0]
    assert_same(second, embedded(replace(turn2, session_id=None))[0])
    assert second.cached_tokens > 0 and second.prefill_tokens < len(turn2.prompt_ids)


def test_the_openai_client_gets_completions_from_token_ids_and_text(server, embedded, tokenizer, checkpoint):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [str(checkpoint)]
    prompt = prompt_of(tokenizer, "def main():")
    by_ids = client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                                       extra_body={"return_token_ids": True})
    by_text = client.completions.create(model=str(checkpoint), prompt="def main():", max_tokens=8, temperature=0,
                                        logprobs=1, extra_body={"return_token_ids": True})
    want = embedded(GenerateRequest(prompt_ids=prompt, max_tokens=8, temperature=0.0, stop_ids=[tokenizer.eos_id]))[0]
    for resp in (by_ids, by_text):
        choice = resp.choices[0]
        assert choice.model_extra["prompt_token_ids"] == prompt  # text prompts get BOS, as chat prompts start
        assert choice.model_extra["token_ids"] == want.token_ids
        assert choice.finish_reason == want.finish_reason
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
        shown = want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids
        assert choice.text == tokenizer.decode(shown)
        assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == len(want.token_ids)
    with pytest.raises(openai.BadRequestError, match="stop strings are not supported"):
        client.completions.create(model=str(checkpoint), prompt=prompt, max_tokens=4, stop=["\n"])


def test_bad_requests_get_a_400_that_says_why_and_the_server_keeps_serving(server, tokenizer):
    url = server + "/v1/completions"
    ok = {"prompt": [tokenizer.bos_id, 5, 6], "max_tokens": 2, "temperature": 0}
    cases = [
        (b"{not json", None, "not valid JSON"),
        ([1, 2], None, "JSON object"),
        ({"max_tokens": 2}, "prompt", "`prompt` is required"),
        ({**ok, "prompt": []}, "prompt", "`prompt` is required"),
        ({**ok, "prompt": [1, "a"]}, "prompt", "list of token ids"),
        ({**ok, "prompt": [10**9]}, "prompt", "outside the vocabulary"),
        ({**ok, "prompt": [[1, 2], []]}, "prompt", "prompt 1 is empty"),
        ({**ok, "max_tokens": 0}, "max_tokens", "at least 1"),
        ({**ok, "temperature": "hot"}, "temperature", "must be a number"),
        ({**ok, "top_p": 0}, "top_p", "(0, 1]"),
        ({**ok, "n": 0}, "n", "at least 1"),
        ({**ok, "logprobs": 5}, "logprobs", "between 0 and 1"),
        ({**ok, "stream": True}, "stream", "streaming is not supported"),
        ({**ok, "echo": True}, "echo", "`echo` is not supported"),
        ({**ok, "seed": -3}, "seed", "between 0 and"),
        ({**ok, "stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
        ({**ok, "session_id": "s", "prompt": [[1, 2], [3]]}, "session_id", "one prompt"),
    ]
    for body, param, message in cases:
        status, answer = post(url, body)
        assert status == 400, (body, answer)
        assert message in answer["error"]["message"] and answer["error"]["param"] == param, (body, answer)
        assert answer["error"]["type"] == "invalid_request_error"
    status, answer = post(url, {**ok, "model": "gpt-4"})
    assert status == 404 and "does not exist" in answer["error"]["message"]
    status, answer = post(server + "/v1/chat/completions", ok)
    assert status == 404 and "POST /v1/completions" in answer["error"]["message"]
    status, answer = post(url, {**ok, "prompt": [ok["prompt"], ok["prompt"]], "n": 2})
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert "token_ids" not in answer["choices"][0] and answer["choices"][0]["logprobs"] is None


def stub_served() -> Served:
    """What the server serves, without a model: "tiny", a 100-token vocabulary (EOS 2) and a 32-token context; text
    encodes to BOS (1) and one id a character."""
    return Served(engine=None, name="tiny", encode=lambda text: [1, *(3 + ord(c) % 90 for c in text)], decode=str,
                  eos_id=2, vocab_size=100, max_len=32)


def test_a_completions_body_is_read_as_vllm_reads_it():
    """engine/server.py ``parse_request`` on honest bodies: token ids, text or lists of either; a null is the key left
    out (its default), keys vLLM takes that change nothing are ignored, and the model's EOS is added to the stops."""
    served = stub_served()
    full = {"model": "tiny", "prompt": [1, 5], "max_tokens": 3, "temperature": 0, "top_p": 0.5, "top_k": -1,
            "stop_token_ids": [7], "seed": 4, "logprobs": 1, "return_token_ids": True, "session_id": "s", "n": 1,
            "best_of": 1, "stream": False, "echo": False, "stop": [], "min_p": 0, "user": "me", "suffix": None}
    assert parse_request(full, served) == Completion(
        [[1, 5]], {"session_id": "s", "max_tokens": 3, "temperature": 0.0, "top_p": 0.5, "top_k": 0, "stop_ids": [7, 2],
                   "n": 1, "seed": 4}, 1, 1, True, False, "s")
    texts = parse_request({"prompt": ["ab", "c"], "n": 2, "best_of": 2, "ignore_eos": True, "temperature": None,
                           "return_tokens_as_token_ids": 1}, served)
    assert texts.prompts == [[1, 3 + ord("a") % 90, 3 + ord("b") % 90], [1, 3 + ord("c") % 90]]
    assert texts.sampling == {"session_id": None, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                              "stop_ids": [], "n": 2, "seed": None}
    assert (texts.n, texts.logprobs, texts.return_token_ids, texts.tokens_as_ids) == (2, None, False, True)
    assert parse_request({"prompt": [[3], [4, 5]], "stop_token_ids": 0}, served).prompts == [[3], [4, 5]]
    assert type(parse_request({"prompt": "x", "temperature": 1}, served).sampling["temperature"]) is float
    assert _update_request({"model_path": "/w/v1", "weight_version": "07", "flush_cache": True}) == (Path("/w/v1"), 7)
    assert _update_request({"model_path": "/w/v1", "weight_version": None}) == (Path("/w/v1"), None)


@pytest.mark.parametrize("body, param, says", [
    ([1, 2], None, "the request body must be a JSON object"),
    ({"prompt": [1], "model": "gpt-4", "n": "x"}, "model",  # the model first, whatever else is wrong
     "The model `gpt-4` does not exist; this server serves `tiny`"),
    ({}, "prompt", "`prompt` is required: a list of token ids, a list of such lists, a string, or a list of strings"),
    ({"prompt": 5}, "prompt", "`prompt` is required: a list of token ids, a list of such lists, a string, or a list"),
    ({"prompt": []}, "prompt", "`prompt` is required"),
    ({"prompt": [1, True]}, "prompt", "`prompt` must be a list of token ids (integers)"),
    ({"prompt": [[1], [2, 1.5]]}, "prompt", "`prompt` must be a list of token ids (integers)"),
    ({"prompt": [100]}, "prompt", "`prompt` holds token id 100, outside the vocabulary (0..99)"),
    ({"prompt": [[1], []]}, "prompt", "prompt 1 is empty"),
    ({"prompt": [1] * 32}, "prompt", "prompt 0 has 32 tokens; the model's context is 32"),
    ({"prompt": [1], "n": True}, "n", "`n` must be an integer, got True"),
    ({"prompt": [1], "n": 0}, "n", "`n` must be at least 1, got 0"),
    ({"prompt": [1], "n": 65}, "n", "1 prompt(s) x n=65 asks for 65 completions; a request takes at most 64"),
    ({"prompt": [[1]] * 33, "n": 2}, "prompt", "33 prompt(s) x n=2 asks for 66 completions"),
    ({"prompt": [1], "n": 2, "best_of": 3}, "best_of", "`best_of` is not supported by sandforge serve"),
    ({"prompt": [1], "logprobs": 2}, "logprobs", "`logprobs` must be between 0 and 1, got 2"),
    ({"prompt": [1], "temperature": "hot"}, "temperature", "`temperature` must be a number, got 'hot'"),
    ({"prompt": [1], "temperature": float("nan")}, "temperature", "`temperature` must be a number, got nan"),
    ({"prompt": [1], "temperature": 10**400}, "temperature", "`temperature` must be a number"),
    ({"prompt": [1], "temperature": 101}, "temperature", "`temperature` must be in [0, 100], got 101"),
    ({"prompt": [1], "top_p": 0}, "top_p", "`top_p` must be in (0, 1], got 0"),
    ({"prompt": [1], "top_k": -2}, "top_k", "`top_k` must be at least -1, got -2"),
    ({"prompt": [1], "max_tokens": [[[[]]]]}, "max_tokens", "`max_tokens` must be an integer, got [[[[]]]]"),
    ({"prompt": [1], "seed": 2**63}, "seed", "`seed` must be between 0 and 9223372036854775807"),
    ({"prompt": [1], "session_id": ""}, "session_id", "`session_id` must be a non-empty string"),
    ({"prompt": [[1], [2]], "session_id": "s"}, "session_id", "a `session_id` goes with one prompt"),
    ({"prompt": [1], "stop_token_ids": "5"}, "stop_token_ids", "`stop_token_ids` must be a list of token ids"),
    ({"prompt": [1], "stop_token_ids": [100]}, "stop_token_ids", "`stop_token_ids` holds token id 100, outside"),
    ({"prompt": [1], "stream": True}, "stream", "streaming is not supported by sandforge serve"),
    ({"prompt": [1], "echo": 1}, "echo", "`echo` is not supported"),
    ({"prompt": [1], "stop": "\n"}, "stop", "stop strings are not supported"),
    ({"prompt": [1], "min_p": 0.1}, "min_p", "`min_p` is not supported by sandforge serve (leave it out)"),
])
def test_a_malformed_completions_body_is_a_request_error_that_names_the_field(body, param, says):
    with pytest.raises(RequestError) as refused:
        parse_request(body, stub_served())
    error = refused.value
    assert error.message.startswith(says) and error.param == param, (error.message, error.param)
    unknown_model = (404, "not_found_error")
    assert (error.status, error.kind) == (unknown_model if param == "model" else (400, "invalid_request_error"))


@pytest.mark.parametrize("body, param, says", [
    ([], None, "the request body must be a JSON object"),
    ({"weight_version": 3}, "model_path", "`model_path` is required: the policy directory to load (config.json and"),
    ({"model_path": 5}, "model_path", "`model_path` must be a path: the policy directory to load, got 5"),
    ({"model_path": "/w/a", "weight_version": -1}, "weight_version", "must be a non-negative integer, got -1"),
    ({"model_path": "/w/a", "weight_version": "\u00b9"}, "weight_version", "`weight_version` must be a non-negative "
                                                                           "integer (or its digits), got '\u00b9'"),
    ({"model_path": "/w/a", "weight_version": False}, "weight_version", "(or its digits), got False"),
])
def test_a_malformed_weight_update_is_a_request_error_that_names_the_field(body, param, says):
    with pytest.raises(RequestError) as refused:
        _update_request(body)
    assert says in refused.value.message and refused.value.param == param, refused.value.message


def test_remote_engine_errors_say_what_is_missing_and_where():
    """Against a stub server: no token ids, an HTTP error, and no server at all."""

    async def completions(request):
        body = await request.json()
        if body["prompt"] == [1]:
            return web.json_response({"error": {"message": "prompt too long for this stub"}}, status=400)
        choice = {"index": 0, "text": "hi", "finish_reason": "length",
                  "logprobs": {"tokens": ["h", "i"], "token_logprobs": [-0.5, -0.25]}}
        return web.json_response({"id": "x", "object": "text_completion", "choices": [choice], "usage": {}})

    async def run():
        runner, url = await stub_server(completions)
        try:
            async with RemoteEngine(url + "/v1", model="stub") as engine:
                with pytest.raises(RemoteEngineError, match=r"no token ids .*return_token_ids"):
                    await engine.generate(GenerateRequest(prompt_ids=[5, 6], max_tokens=2))
                with pytest.raises(RemoteEngineError, match=re.escape(f"{url}/v1/completions -> HTTP 400: prompt too")):
                    await engine.generate(GenerateRequest(prompt_ids=[1], max_tokens=2))
                with pytest.raises(NotImplementedError, match="takes weights from disk"):
                    await engine.load_weights({}, 1)
        finally:
            await runner.cleanup()
        async with RemoteEngine(url, model="stub", timeout=5, retries=1) as engine:  # the stub is gone now
            with pytest.raises(RemoteEngineError, match=r"cannot reach the server .*\(2 attempts\)"):
                await engine.generate(GenerateRequest(prompt_ids=[5], max_tokens=2))

    asyncio.run(run())


def test_a_server_that_answers_5xx_is_asked_again_a_bounded_number_of_times():
    """5xx and unreachable: asked again ``retries`` times, then one line naming the URL and the status; a 4xx (the
    request is wrong) is not asked again."""
    calls = []

    async def completions(request):
        body = await request.json()
        calls.append(body["prompt"])
        if body["prompt"] == [7] and len(calls) < 3:  # two failures, then an answer
            return web.Response(status=503, text="warming up")
        if body["prompt"] == [8]:
            return web.json_response({"error": {"message": "engine crashed"}}, status=500)
        if body["prompt"] == [9]:
            return web.json_response({"error": {"message": "bad prompt"}}, status=400)
        choice = {"index": 0, "text": "", "finish_reason": "length", "token_ids": [3],
                  "logprobs": {"tokens": ["x"], "token_logprobs": [-0.5]}}
        return web.json_response({"choices": [choice], "usage": {}})

    async def run():
        runner, url = await stub_server(completions)
        try:
            async with RemoteEngine(url, model="stub", retries=2) as engine:
                [got] = await engine.generate(GenerateRequest(prompt_ids=[7], max_tokens=1))
                assert got.token_ids == [3] and len(calls) == 3
                assert got.version == -1  # a server that reports no version: the one pushed last (none yet)
                engine.version = 4
                assert (await engine.generate(GenerateRequest(prompt_ids=[7], max_tokens=1)))[0].version == 4
                calls.clear()
                with pytest.raises(RemoteEngineError) as crashed:
                    await engine.generate(GenerateRequest(prompt_ids=[8], max_tokens=1))
                assert len(calls) == 3 and "\n" not in str(crashed.value)
                assert str(crashed.value) == f"POST {url}/v1/completions -> HTTP 500: engine crashed (3 attempts)"
                calls.clear()
                with pytest.raises(RemoteEngineError, match="HTTP 400: bad prompt$"):
                    await engine.generate(GenerateRequest(prompt_ids=[9], max_tokens=1))
                assert len(calls) == 1
        finally:
            await runner.cleanup()

    asyncio.run(run())


def test_serve_names_a_missing_checkpoint_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sandforge.job.cli", "serve", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope is not a policy checkpoint" in lines[0], proc.stderr


def test_a_hugging_face_checkpoint_serves_text_with_its_own_tokenizer(tmp_path):
    from test_hf import save_tiny_qwen3_moe

    model, tokenizer = load_checkpoint(save_tiny_qwen3_moe(tmp_path / "hf"))

    async def run():
        engine = EngineCore(model, seed=0)
        served = served_from(engine, model, tokenizer, "tiny")
        body = {"prompt": "def main():", "max_tokens": 6, "temperature": 0, "logprobs": 0, "return_token_ids": True}
        answer = await complete(served, parse_request(body, served))
        want = (await engine.generate(GenerateRequest(prompt_ids=tokenizer.encode("def main():"), max_tokens=6,
                                       temperature=0.0, stop_ids=[tokenizer.eos_token_id])))[0]
        await engine.shutdown()
        return answer["choices"][0], want

    choice, want = asyncio.run(run())
    assert choice["prompt_token_ids"] == tokenizer.encode("def main():") and choice["token_ids"] == want.token_ids
    shown = want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids
    assert choice["text"] == tokenizer.decode(shown) and choice["logprobs"]["token_logprobs"] == want.logprobs


def test_serve_loads_new_weights_from_disk_and_reports_their_version(server, checkpoint, tokenizer, weights_dir):
    """``POST /update_weights_from_disk`` (SGLang's request) swaps the served weights: the answer, /v1/models,
    /get_weight_version and every token report the new version, and generation is the new policy's. A directory
    that is no policy, or another model's, is refused in one line and the old weights keep serving. (Last in the file:
    it puts the module server's first weights back at the end.)"""
    torch.manual_seed(1)
    token = read_admin_token(weights_dir)  # what the trainer sends: the server wrote it there at start
    assert token and (weights_dir / ADMIN_TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    other = weights_dir / "other"
    save_policy(build_policy(ModelConfig(), len(tokenizer)), other, tokenizer=tokenizer)
    bigger = weights_dir / "bigger"  # another shape: what the server serves cannot take it
    save_policy(build_policy(ModelConfig(k3={"d_model": 96}), len(tokenizer)), bigger, tokenizer=tokenizer)
    greedy = GenerateRequest(prompt_ids=prompt_of(tokenizer, "cat notes.txt"), max_tokens=8, temperature=0.0, stop_ids=[])
    policy = load_policy(other)
    want = asyncio.run(_generate_with(policy, greedy))

    async def run():
        async with RemoteEngine(server) as engine:
            before = (await engine.generate(greedy))[0]
            assert await engine.update_weights(str(other), 5, "sandforge", token) == 5
            after = (await engine.generate(greedy))[0]
            refused = r"update_weights_from_disk -> HTTP 400: could not load .*nope: no config.json there"
            with pytest.raises(RemoteEngineError, match=refused):
                await engine.update_weights(str(weights_dir / "nope"), 6, "sandforge", token)
            with pytest.raises(RemoteEngineError, match=r"HTTP 400: could not load .*bigger: .*size mismatch"):
                await engine.update_weights(str(bigger), 6, "sandforge", token)
            still = (await engine.generate(greedy))[0]
            return before, after, still

    try:
        before, after, still = asyncio.run(run())
        assert before.version == 0 and after.version == 5 and after.token_versions == [5] * 8
        assert_same(after, want) and after.token_ids != before.token_ids
        assert still.version == 5 and still.token_ids == after.token_ids
        assert get(server + "/get_weight_version") == (200, {"weight_version": "5"})
        assert get(server + "/v1/models")[1]["data"][0]["weight_version"] == "5"
        admin = {"Authorization": f"Bearer {token}"}
        status, answer = post(server + "/update_weights_from_disk", {"weight_version": 7}, admin)
        assert status == 400 and "`model_path` is required" in answer["error"]["message"]
    finally:
        first = weights_dir / "first"
        shutil.copytree(checkpoint, first, dirs_exist_ok=True)
        status, answer = post(server + "/update_weights_from_disk", {"model_path": str(first), "weight_version": "0"},
                              {"Authorization": f"Bearer {token}"})
    assert status == 200 and answer == {"success": True, "num_paused_requests": 0, "weight_version": "0",
                                        "message": f"loaded {first} as weight version 0"}


async def _generate_with(policy, request: dict) -> dict:
    engine = EngineCore(policy, seed=0)
    await engine.load_weights(policy.state_dict(), 5)
    try:
        return (await engine.generate(request))[0]
    finally:
        await engine.shutdown()
