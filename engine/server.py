"""``sandforge serve CHECKPOINT``: the embedded engine behind an OpenAI-compatible ``/v1/completions`` (the job's
fleet starts the engine, job/serve.py; this module is the HTTP side).

Prompts go in as token ids (or text, encoded with the checkpoint's tokenizer) and, with ``return_token_ids``,
completions come back as token ids too (``choices[i].token_ids`` and ``prompt_token_ids``, as vLLM spells them), so
``RemoteEngine`` and any OpenAI client can drive the same server. Differences from vLLM, each answered with a 400 rather
than ignored: no streaming, no echo, no stop strings (stop on ``stop_token_ids``), and only the
sampled token's logprob (``logprobs`` 0 or 1; ``top_logprobs`` is null). Extensions: ``session_id`` names an engine
session, so a multi-turn client that resends its growing sequence reuses the cache; the response's ``sandforge`` object
carries the policy version and, per choice, its cache use, the version behind each token and (from an MoE policy) the
experts each fed token was routed to, so routing replay works through the server. ``seed`` is the engine's per-request
seed: the same request samples the same tokens whatever else the server is batching (choice i draws from a generator
seeded from it).

New weights, as SGLang takes them: ``POST /update_weights_from_disk`` with ``model_path`` (a policy directory the
trainer wrote) and ``weight_version`` loads it once the running requests are done and answers ``success``, ``message``
and the ``weight_version`` now served; ``GET /get_weight_version`` and ``/v1/models`` report it too. Loading weights is
the one admin action, and it is closed unless the server was started with a weights directory (``sandforge serve
--weights-dir DIR``): then it takes only ``Authorization: Bearer <token>``, the token the server wrote at start to
``DIR/.sandforge-admin-token`` (mode 0600, read by the trainer that writes its weights there), and only a
``model_path`` inside ``DIR`` (links resolved). Everyone else gets 401 or 403 and the served weights stay.

A request is bounded: ``MAX_BODY`` bytes and ``MAX_CHOICES`` completions (prompts x ``n``). Its body is read by
pydantic models (``CompletionBody``, ``WeightUpdateBody``; a null is the key left out, a key they do not name is
ignored), and every mistake is answered with an OpenAI-style error that names the field.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import os
import secrets
import logging
import reprlib
import signal
import time
import uuid
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Annotated, Any, Callable

from aiohttp import web
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, Strict, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, WrapValidator, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from sandforge.types import GenerateRequest

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20  # token-id prompts of long contexts are large JSON (a 32k-token prompt is about 200 KB)
MAX_CHOICES = 64  # completions one request may ask for: prompts x n
ADMIN_TOKEN_FILE = ".sandforge-admin-token"  # in the weights directory: what the trainer sends to load weights
ROUTES = ("POST /v1/completions, GET /v1/models, GET /health, POST /update_weights_from_disk, "
          "GET /get_weight_version")
# Fields that would change the completion if honoured, with the values that mean "off".
UNSUPPORTED = {
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_tokens": (None, 0), "min_p": (None, 0),
    "prompt_logprobs": (None,), "stream_options": (None,),
}


class RequestError(Exception):
    """A client mistake: answered with ``status`` and an OpenAI-style error body naming ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


@dataclass(frozen=True)
class WeightUpdates:
    """Who may load weights into a server: a caller presenting ``token``, for a policy under ``directory``."""

    directory: Path
    token: str


def open_weight_updates(directory: str | Path) -> WeightUpdates:
    """Weight updates from ``directory`` (made if missing), with a new token written to its ``ADMIN_TOKEN_FILE``
    (mode 0600; a previous server's is replaced)."""
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    token, path = secrets.token_urlsafe(32), directory / ADMIN_TOKEN_FILE
    path.unlink(missing_ok=True)  # a file another user left there is not written through
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return WeightUpdates(directory, token)


def read_admin_token(directory: str | Path) -> str | None:
    """The token a server started with ``--weights-dir directory`` wrote there, or None."""
    try:
        return (Path(directory) / ADMIN_TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def _authorised(request, updates: WeightUpdates | None, path: Path) -> None:
    """Raise RequestError (401, 403) unless ``request`` may load ``path``."""
    if updates is None:
        raise RequestError("this server loads no new weights: start it with `sandforge serve CHECKPOINT --weights-dir "
                           "DIR` (the directory the trainer writes its policy to)", status=403,
                           kind="permission_error")
    sent = request.headers.get("Authorization", "")
    if not hmac.compare_digest(sent.encode(), f"Bearer {updates.token}".encode()):
        raise RequestError(f"loading weights needs the admin token the server wrote to {updates.directory}/"
                           f"{ADMIN_TOKEN_FILE} (Authorization: Bearer ...)", status=401, kind="authentication_error")
    resolved = path.expanduser().resolve()
    if not resolved.is_relative_to(updates.directory):
        raise RequestError(f"model_path {path} is not inside the weights directory {updates.directory}", "model_path",
                           status=403, kind="permission_error")


@dataclass
class Served:
    # EngineCore, or anything with its ``async generate(GenerateRequest) -> list[Sample]``, ``stats()`` and
    # ``async load_weights(state_dict, version) -> int``
    engine: Any
    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None
    vocab_size: int
    max_len: int | None
    # name -> shape of every weight the engine serves: an update from disk must match it (a mismatched load would
    # leave the engine half-loaded)
    layout: dict[str, tuple[int, ...]] | None = None


def served_from(engine, model, tokenizer, name: str) -> Served:
    """Text codec of the built-in tokenizer (BOS prepended, as chat prompts start) or of a Hugging Face one."""
    config = model.config
    if hasattr(tokenizer, "bos_id"):
        encode, eos = (lambda text: [tokenizer.bos_id, *tokenizer.encode(text)]), tokenizer.eos_id
    else:
        encode, eos = tokenizer.encode, tokenizer.eos_token_id  # HF: adds the model's own special tokens
    layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return Served(engine, name, encode, tokenizer.decode, eos, int(config.vocab_size),
                  getattr(config, "max_seq_len", None), layout)


@dataclass
class Completion:
    prompts: list[list[int]]
    sampling: dict  # GenerateRequest's fields but prompt_ids
    n: int
    logprobs: int | None
    return_token_ids: bool
    tokens_as_ids: bool
    session_id: str | None


_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")  # pydantic's errors of a bound
PROMPT_KINDS = "a list of token ids, a list of such lists, a string, or a list of strings"


def _shown(value: Any) -> str:
    """``repr(value)``, shortened; never fails, however deep or odd the value."""
    try:
        return reprlib.repr(value)
    except (RecursionError, ValueError):
        return type(value).__name__


def _refused(message: str, param: str | None = None) -> PydanticCustomError:
    """A RequestError raised from inside a model (``_read`` makes it one); ``param``: the field, where the error's
    location does not say it."""
    return PydanticCustomError("request", message, None if param is None else {"param": param})


def _worded(kind: str, bounds: str | None = None) -> WrapValidator:
    """pydantic's error about a field in the words OpenAI clients read: "`key` must be <kind>, got <value>", or
    "`key` must be <bounds>, got <value>" when only its range is wrong."""

    def check(value: Any, handler, info):
        try:
            return handler(value)
        except ValidationError as e:
            wrong = bounds if bounds and all(err["type"] in _RANGE for err in e.errors()) else kind
            raise _refused(f"`{info.field_name}` must be {wrong}, got {_shown(value)}") from None

    return WrapValidator(check)


def _integer(low: int, high: int | None = None) -> Any:
    """An integer field of at least ``low`` (and at most ``high``); true and false are not integers."""
    bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
    return Annotated[StrictInt, Field(ge=low, le=high), _worded("an integer", bounds)]


def _number(low: float, high: float, low_open: bool = False) -> Any:
    """A field of a finite number in [``low``, ``high``] (``low_open``: (``low``, ``high``]), read as a float."""
    limits = Field(gt=low, le=high) if low_open else Field(ge=low, le=high)
    bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    return Annotated[float, Strict(), limits, Field(allow_inf_nan=False), _worded("a number", bounds)]


def _prompt_shape(value: Any, handler) -> Any:
    """A prompt of none of its shapes (``PROMPT_KINDS``), refused in words that say which shapes there are."""
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, list) and value:
            raise _refused("`prompt` must be a list of token ids (integers)") from None
        raise _refused(f"`prompt` is required: {PROMPT_KINDS} (got {type(value).__name__})") from None


TokenIds = list[StrictInt]
Prompt = Annotated[StrictStr | Annotated[list[StrictStr], Field(min_length=1)]
                   | Annotated[list[TokenIds], Field(min_length=1)] | Annotated[TokenIds, Field(min_length=1)],
                   WrapValidator(_prompt_shape)]


def _present(body: Any) -> dict:
    """A body's keys that are not null: a null is the key left out, as OpenAI servers read it."""
    if not isinstance(body, dict):
        raise _refused("the request body must be a JSON object")
    return {k: v for k, v in body.items() if v is not None}


class CompletionBody(BaseModel):
    """A ``/v1/completions`` body as vLLM reads one, less what sandforge serve refuses (the module's docstring);
    keys it does not name are ignored. The checks that need the model served (its name, vocabulary and context) are
    ``parse_request``'s."""

    model_config = ConfigDict(extra="ignore")

    n: _integer(low=1) = 1
    best_of: Any = None  # 1 or n: as many candidates as choices
    logprobs: _integer(0, 1) | None = None
    session_id: Annotated[StrictStr, Field(min_length=1), _worded("a non-empty string")] | None = None
    prompt: Prompt = Field(description=PROMPT_KINDS)
    stop_token_ids: Annotated[TokenIds, BeforeValidator(lambda v: v or []),
                              _worded("a list of token ids (integers)")] = []
    ignore_eos: Any = False  # truthy: the model's EOS does not end a completion
    top_k: _integer(low=-1) = 0  # -1 and 0 both mean off
    max_tokens: _integer(low=1) = 16
    temperature: _number(0.0, 100.0) = 1.0
    top_p: _number(0.0, 1.0, low_open=True) = 1.0
    seed: _integer(0, 2**63 - 1) | None = None
    return_token_ids: Any = False  # truthy: the completions' (and prompts') token ids too
    return_tokens_as_token_ids: Any = False

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: Any) -> dict:
        body = _present(body)
        if body.get("stream"):
            raise _refused("streaming is not supported by sandforge serve; send `stream: false` (or leave it out)",
                           "stream")
        if body.get("echo"):
            raise _refused("`echo` is not supported: the prompt is yours already (see `prompt_token_ids`)", "echo")
        if body.get("stop") not in (None, "", []):
            raise _refused("stop strings are not supported; stop on token ids with `stop_token_ids`", "stop")
        for key, off in UNSUPPORTED.items():
            if body.get(key) not in off:
                raise _refused(f"`{key}` is not supported by sandforge serve (leave it out)", key)
        return body

    @field_validator("best_of")
    @classmethod
    def _one_candidate_per_choice(cls, best_of: Any, info: ValidationInfo) -> Any:
        if best_of not in (None, 1, info.data.get("n")):
            raise _refused("`best_of` is not supported by sandforge serve (leave it out)")
        return best_of


def _read(model: type[BaseModel], body: Any) -> Any:
    """``body`` validated by ``model``; its first error as a RequestError naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = str(err["loc"][0]) if err["loc"] else (err.get("ctx") or {}).get("param")
        if err["type"] == "missing":
            raise RequestError(f"`{param}` is required: {model.model_fields[param].description}", param) from None
        raise RequestError(err["msg"], param) from None


def _in_vocabulary(ids: list[int], key: str, served: Served) -> list[int]:
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise RequestError(f"`{key}` holds token id {_shown(bad[0])}, outside the vocabulary "
                           f"(0..{served.vocab_size - 1})", key)
    return ids


def _prompts(prompt: str | list, served: Served) -> list[list[int]]:
    """A read ``prompt`` as token-id prompts: text encoded, token ids inside the vocabulary, none empty or as long as
    the model's context."""
    if isinstance(prompt, str):
        prompts = [served.encode(prompt)]
    elif isinstance(prompt[0], str):
        prompts = [served.encode(p) for p in prompt]
    else:
        prompts = [_in_vocabulary(p, "prompt", served) for p in (prompt if isinstance(prompt[0], list) else [prompt])]
    for i, p in enumerate(prompts):
        if not p:
            raise RequestError(f"prompt {i} is empty", "prompt")
        if served.max_len is not None and len(p) >= served.max_len:
            raise RequestError(f"prompt {i} has {len(p)} tokens; the model's context is {served.max_len}", "prompt")
    return prompts


def parse_request(body: Any, served: Served) -> Completion:
    """Validate a ``/v1/completions`` body (``CompletionBody``, then what depends on the model served); every mistake
    is a ``RequestError`` naming the field."""
    model = body.get("model") if isinstance(body, dict) else None
    if model not in (None, served.name):  # first: a client of another server hears so, whatever else it sent
        raise RequestError(f"The model `{model if isinstance(model, str) else _shown(model)}` does not exist; this "
                           f"server serves `{served.name}`", "model", 404, "not_found_error")
    asked: CompletionBody = _read(CompletionBody, body)
    n, prompts = asked.n, _prompts(asked.prompt, served)
    if len(prompts) * n > MAX_CHOICES:
        raise RequestError(f"{len(prompts)} prompt(s) x n={n} asks for {len(prompts) * n} completions; a request takes "
                           f"at most {MAX_CHOICES}", "n" if len(prompts) == 1 else "prompt")
    if asked.session_id is not None and len(prompts) > 1:
        raise RequestError("a `session_id` goes with one prompt (one growing sequence), not a list", "session_id")
    stops = list(_in_vocabulary(asked.stop_token_ids, "stop_token_ids", served))
    if not asked.ignore_eos and served.eos_id is not None and served.eos_id not in stops:
        stops.append(served.eos_id)  # like vLLM: the model's EOS ends a completion unless ignore_eos
    sampling = {
        "session_id": asked.session_id,
        "max_tokens": asked.max_tokens,
        "temperature": asked.temperature,
        "top_p": asked.top_p,
        "top_k": max(asked.top_k, 0),  # -1 and 0 both mean off
        "stop_ids": stops,
        "n": n,
        "seed": asked.seed,
    }
    return Completion(prompts, sampling, n, asked.logprobs, bool(asked.return_token_ids),
                      bool(asked.return_tokens_as_token_ids), asked.session_id)


def _logprobs(ids: list[int], logprobs: list[float], served: Served, as_ids: bool) -> dict:
    pieces = [served.decode([t]) for t in ids]
    offsets = list(accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else []
    tokens = [f"token_id:{t}" for t in ids] if as_ids else pieces
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


async def complete(served: Served, req: Completion) -> dict:
    """Run every prompt through the engine at once (it batches them) and answer in OpenAI's completions shape."""
    try:
        outs = await asyncio.gather(*(served.engine.generate(GenerateRequest(prompt_ids=p, **req.sampling))
                                      for p in req.prompts))
    except ValueError as e:  # the engine's word on a request it cannot run (too long for the context, ...)
        raise RequestError(str(e)) from None
    choices, mine = [], []
    for i, (prompt, results) in enumerate(zip(req.prompts, outs)):
        for j, r in enumerate(results):
            ids, stopped = r.token_ids, r.finish_reason == "stop"
            choice = {
                "index": i * req.n + j,
                "text": served.decode(ids[:-1] if stopped and ids else ids),  # the stop token is not text
                "logprobs": None if req.logprobs is None else _logprobs(ids, r.logprobs, served, req.tokens_as_ids),
                "finish_reason": r.finish_reason,
                "stop_reason": ids[-1] if stopped and ids else None,
            }
            if req.return_token_ids:
                choice["token_ids"], choice["prompt_token_ids"] = ids, prompt
            choices.append(choice)
            mine.append({k: getattr(r, k) for k in ("version", "cached_tokens", "prefill_tokens", "token_versions",
                                                    "routed_experts") if getattr(r, k) is not None})
    prompt_tokens = sum(len(p) for p in req.prompts)
    completion_tokens = sum(len(r.token_ids) for results in outs for r in results)
    cached = sum(min(r.cached_tokens for r in results) for results in outs)  # what the cache held before the call
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
        "sandforge": {"version": min(m["version"] for m in mine), "session_id": req.session_id, "choices": mine},
    }


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    """Client mistakes become OpenAI-style error bodies; a server fault is a 500 whose body says what broke."""
    try:
        return await handler(request)
    except RequestError as e:
        return _error(e.status, e.message, e.param, e.kind)
    except web.HTTPNotFound:
        return _error(404, f"no route {request.method} {request.path}; this server answers {ROUTES}", None,
                      "not_found_error")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.text or e.reason)
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"the engine failed: {type(e).__name__}: {e}", None, "server_error")


async def engine_stats(served: Served) -> dict:
    stats = served.engine.stats()
    return await stats if inspect.isawaitable(stats) else stats


def _digits(version: Any) -> Any:
    """A weight version sent as its digits (SGLang's is text) reads as the integer."""
    return int(version) if isinstance(version, str) and version.isascii() and version.isdigit() else version


class WeightUpdateBody(BaseModel):
    """An ``/update_weights_from_disk`` body: ``model_path`` and ``weight_version`` (a null is the key left out).
    SGLang's other fields, such as ``flush_cache`` or ``abort_all_requests``, change nothing here: a load always waits
    for the running requests and empties the cache."""

    model_config = ConfigDict(extra="ignore")

    model_path: Annotated[StrictStr, Field(min_length=1), _worded("a path: the policy directory to load")] = Field(
        description="the policy directory to load (config.json and weights)")
    weight_version: Annotated[StrictInt, Field(ge=0), BeforeValidator(_digits),
                              _worded("a non-negative integer (or its digits)", "a non-negative integer")] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, body: Any) -> dict:
        return _present(body)


def _update_request(body: Any) -> tuple[Path, int | None]:
    """``model_path`` and ``weight_version`` of an ``/update_weights_from_disk`` body (``WeightUpdateBody``)."""
    asked: WeightUpdateBody = _read(WeightUpdateBody, body)
    return Path(asked.model_path), asked.weight_version


def _policy_weights(path: Path, layout: dict[str, tuple[int, ...]] | None) -> dict:
    """The state dict of the policy in ``path``; ValueError says why it cannot be loaded, or why it is not a policy
    of the ``layout`` served."""
    from sandforge.models.build import load_policy

    if not (path / "config.json").is_file():
        raise ValueError("no config.json there: not a policy directory (is it on a filesystem this server sees?)")
    try:
        state_dict = {k: v.detach() for k, v in load_policy(path).state_dict().items()}
    except Exception as e:  # noqa: BLE001 - whatever the loader says, in one line
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if layout is not None:
        missing, unknown = sorted(layout.keys() - state_dict.keys()), sorted(state_dict.keys() - layout.keys())
        if missing or unknown:
            raise ValueError(f"another model: {len(missing)} weight(s) missing (first: {(missing or ['-'])[0]}), "
                             f"{len(unknown)} this server does not have (first: {(unknown or ['-'])[0]})")
        for name, shape in layout.items():
            if tuple(state_dict[name].shape) != shape:
                raise ValueError(f"another model: size mismatch for {name}: {list(state_dict[name].shape)} in the "
                                 f"files, {list(shape)} served")
    return state_dict


def build_app(served: Served, announce: Callable[[str], Any] | None = None,
              updates: WeightUpdates | None = None) -> web.Application:
    """The server's routes; ``announce`` hears one line per weight update; ``updates``: who may load weights from
    where (None: nobody)."""
    loading = asyncio.Lock()  # one weight update at a time

    async def completions(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python reads
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        return web.json_response(await complete(served, parse_request(body, served)))

    async def models(request: web.Request) -> web.Response:
        card = {"id": served.name, "object": "model", "created": int(time.time()), "owned_by": "sandforge",
                "root": served.name, "max_model_len": served.max_len,
                "weight_version": str((await engine_stats(served))["version"])}
        return web.json_response({"object": "list", "data": [card]})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **(await engine_stats(served))})

    async def update_weights(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        path, version = _update_request(body)
        _authorised(request, updates, path)
        async with loading:
            if version is None:
                version = int((await engine_stats(served))["version"]) + 1
            try:
                state_dict = await asyncio.to_thread(_policy_weights, path, served.layout)
                served_version = await served.engine.load_weights(state_dict, version)
            except (ValueError, RuntimeError) as e:  # the wrong model for this server, unreadable files
                message = f"could not load {path}: {' '.join(str(e).split())[:1000]}"
                if announce is not None:
                    announce(message)
                return web.json_response({"success": False, "message": message, "num_paused_requests": 0}, status=400)
        message = f"loaded {path} as weight version {served_version}"
        if announce is not None:
            announce(message)
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0,
                                  "weight_version": str(served_version)})

    async def weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str((await engine_stats(served))["version"])})

    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/update_weights_from_disk", update_weights)
    app.router.add_get("/get_weight_version", weight_version)
    return app


def load_checkpoint(directory: str | Path):
    """(model, tokenizer) of a ``save_policy`` directory or a Hugging Face model directory; ValueError says why not."""
    from sandforge.config import ModelConfig
    from sandforge.models.build import load_chat, load_policy

    path = Path(directory)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a policy checkpoint (no config.json there); pass a directory written by "
                         "training (<output_dir>/checkpoints/step_N/policy) or a Hugging Face model directory")
    try:
        hf = "model_type" in json.loads(config_file.read_text())
        model = load_policy(path).eval()
        chat = load_chat(ModelConfig(arch="hf", path=str(path)) if hf else ModelConfig(init_from=path))
    except Exception as e:  # whatever the loaders say (bad JSON, missing weights or tokenizer): one line, not a trace
        raise ValueError(f"cannot load the checkpoint in {directory}: {e}") from None
    return model, chat.tokenizer


async def serve(served: Served, host: str = "127.0.0.1", port: int = 8000,
                announce: Callable[[str], Any] = print, updates: WeightUpdates | None = None) -> None:
    """Listen on ``host:port`` (0: any free port) and answer with ``served`` until SIGINT/SIGTERM; weights load as
    ``updates`` allows."""
    runner = web.AppRunner(build_app(served, announce, updates), access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as e:  # the port is taken, or the host is no address of this machine
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        announce(f"serving {served.name} at http://{shown}:{bound}/v1 ({ROUTES}); Ctrl-C stops")
        announce(f"weight updates: from {updates.directory}, with the token in {updates.directory}/{ADMIN_TOKEN_FILE}"
                 if updates else "weight updates: off (--weights-dir DIR turns them on)")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
