"""`sandforge serve`'s control plane (#32, item 6): loading weights is an admin action. An unauthenticated
`POST /update_weights_from_disk` swapped the served weights for any directory a local caller named. Now a server loads
weights only when started with `--weights-dir DIR`, only for the token it wrote to DIR (mode 0600), and only from a
policy inside DIR (links resolved); requests are bounded (`MAX_CHOICES` completions, `MAX_BODY` bytes)."""

from __future__ import annotations

import json
import os
import random
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from serve_process import serve_process  # noqa: E402 - tests/ is on sys.path
from test_proxy_boundary import PYDANTIC_WORDS, json_value, one_field_corrupted

from sandforge.config import ModelConfig
from sandforge.engine.server import (ADMIN_TOKEN_FILE, MAX_BODY, MAX_CHOICES, RequestError, Served, WeightUpdates,
                                     _authorised, _update_request, parse_request, read_admin_token)
from sandforge.models.bpe import load_tokenizer
from sandforge.models.build import build_policy, save_policy

pytestmark = pytest.mark.timeout(180)


def call(url: str, body, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def version(url: str) -> str:
    with urllib.request.urlopen(url + "/get_weight_version", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """(the served checkpoint, the weights directory, an attacker's policy outside it)."""
    tokenizer = load_tokenizer("bpe")
    root = tmp_path_factory.mktemp("control")
    torch.manual_seed(0)
    save_policy(build_policy(ModelConfig(), len(tokenizer)), root / "served", tokenizer=tokenizer)
    torch.manual_seed(1)
    save_policy(build_policy(ModelConfig(), len(tokenizer)), root / "attacker", tokenizer=tokenizer)
    (root / "weights").mkdir()
    return root / "served", root / "weights", root / "attacker"


def test_weight_updates_are_refused_without_the_token_or_outside_the_directory(policies, tmp_path):
    served, weights, attacker = policies
    with serve_process(served, tmp_path / "serve.log", weights_dir=weights) as (_, url):
        token = read_admin_token(weights)
        assert token and os.stat(weights / ADMIN_TOKEN_FILE).st_mode & 0o777 == 0o600
        update = url + "/update_weights_from_disk"
        (weights / "inside").symlink_to(attacker, target_is_directory=True)  # a link out of the directory
        attempts = [
            (None, {"model_path": str(attacker), "weight_version": 9}, 401),  # the attack as it was: no credential
            ("guessed", {"model_path": str(attacker), "weight_version": 9}, 401),
            (token[:-1], {"model_path": str(attacker), "weight_version": 9}, 401),
            (token, {"model_path": str(attacker), "weight_version": 9}, 403),  # the token, another directory
            (token, {"model_path": str(weights / ".." / "attacker"), "weight_version": 9}, 403),
            (token, {"model_path": str(weights / "inside"), "weight_version": 9}, 403),
        ]
        for sent, body, status in attempts:
            got, answer = call(update, body, sent)
            assert got == status, (sent, body, answer)
            assert version(url) == "0"  # the served weights never changed
        assert "admin token" in call(update, attempts[0][1])[1]["error"]["message"]
        pushed = weights / "version_1"
        tokenizer = load_tokenizer("bpe")
        save_policy(build_policy(ModelConfig(), len(tokenizer)), pushed, tokenizer=tokenizer)
        assert call(update, {"model_path": str(pushed), "weight_version": 1}, token)[0] == 200
        assert version(url) == "1"  # the trainer, with the token, from the directory: loaded
        n = call(url + "/v1/completions", {"prompt": [[1, 2]], "max_tokens": 1, "n": MAX_CHOICES + 1})
        many = call(url + "/v1/completions", {"prompt": [[1, 2]] * (MAX_CHOICES + 1), "max_tokens": 1})
        assert n[0] == many[0] == 400 and "at most 64" in n[1]["error"]["message"], (n, many)
        big = call(url + "/v1/completions", b'{"prompt": "' + b"x" * (MAX_BODY + 1) + b'"}')
        assert big[0] == 413, big


def test_a_server_without_a_weights_directory_loads_nothing():
    request = SimpleNamespace(headers={"Authorization": "Bearer anything"})
    with pytest.raises(RequestError) as refused:
        _authorised(request, None, Path("/tmp/x"))
    assert refused.value.status == 403 and "--weights-dir" in refused.value.message
    with pytest.raises(RequestError) as wrong:
        _authorised(request, WeightUpdates(Path("/w"), "right"), Path("/w/a"))
    assert wrong.value.status == 401


COMPLETION_KEYS = ("prompt", "model", "n", "best_of", "logprobs", "session_id", "stop_token_ids", "ignore_eos",
                   "top_k", "max_tokens", "temperature", "top_p", "seed", "stream", "echo", "stop", "min_p",
                   "model_path", "weight_version", "tiny")


def test_no_body_of_any_shape_is_answered_with_anything_but_a_request_error():
    """A few thousand ``/v1/completions`` and ``/update_weights_from_disk`` bodies: random JSON values, and honest
    bodies with one field corrupted. Each is read or refused with a RequestError that names a field the body holds
    (or the one it lacks) in the server's own words, never a 500 from a TypeError, an OverflowError or pydantic."""
    served = Served(engine=None, name="tiny", encode=lambda text: [1, *(3 + ord(c) % 90 for c in text)], decode=str,
                    eos_id=2, vocab_size=100, max_len=32)
    honest = {"model": "tiny", "prompt": [[1, 5], [6]], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
              "n": 2, "logprobs": 1, "stop_token_ids": [7], "seed": 3, "return_token_ids": True}
    update = {"model_path": "/weights/step_3", "weight_version": "3", "flush_cache": True}
    rng, outcomes = random.Random(57), {"read": 0, "refused": 0}
    for i in range(3000):
        for parse, body in ((lambda b: parse_request(b, served), honest), (_update_request, update)):
            sent = json_value(rng, COMPLETION_KEYS) if i % 10 == 0 else one_field_corrupted(rng, body, COMPLETION_KEYS)
            try:
                parse(sent)
                outcomes["read"] += 1
            except RequestError as e:
                outcomes["refused"] += 1
                assert e.param is None or e.param in sent or e.param in ("prompt", "model_path"), (sent, e.param)
                assert not any(words in e.message for words in PYDANTIC_WORDS), (sent, e.message)
    assert outcomes["read"] > 1000 and outcomes["refused"] > 1000, outcomes
