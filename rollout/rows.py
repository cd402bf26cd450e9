"""How the recording proxy turns a harness's requests into training rows, token for token.

A harness sends its whole conversation with every request. When that conversation is the previous request's plus
the reply the proxy gave, word for word, and then only user or tool messages, the request *extends* the row: its
prompt is the row's recorded tokens (the previous prompt and the engine's own generated ids, never re-tokenized) plus
the rendered new messages. Anything else (a summary in place of old turns, reasoning dropped from an echoed reply, an
edited message, other tools) is a rewrite: the row closes and a new one starts from the conversation as sent, rendered
with the policy's chat template. Each row's loss mask is 1 on exactly the tokens the engine generated into it, so the
rows together hold every generated token once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandforge.rollout.chat_api import BadRequest, ChatRequest
from sandforge.types import Message, Sample, TokenRow, Turn


def render_conversation(chat, tools: list[dict], messages: list[Message]) -> list[int]:
    """The prompt of a fresh row: ``messages`` (system and user first, then assistant turns each followed by the user
    or tool messages that answer it) through the chat format, ending with the assistant header."""
    return conversation_tokens(chat, tools, messages)[0]


def conversation_tokens(chat, tools: list[dict], messages: list[Message]) -> tuple[list[int], list[int]]:
    """``render_conversation``'s ids and, beside them, 1 on each assistant message's tokens (the policy's own) and 0
    on the rest: what an SFT row of the conversation learns (job/sft_data.py). BadRequest for two assistant messages
    in a row or a system message after the start."""
    lead = 0
    while lead < len(messages) and messages[lead].role in ("system", "user"):
        lead += 1
    ids = chat.render_prompt(tools, messages[:lead])
    mask = [0] * len(ids)
    i = lead
    while i < len(messages):
        m = messages[i]
        if m.role == "assistant":
            if i + 1 < len(messages) and messages[i + 1].role == "assistant":
                raise BadRequest(f"messages[{i + 1}]: two assistant messages in a row")
            reply = chat.render_assistant(m)
            ids, mask = ids + reply, mask + [1] * len(reply)
            i += 1
            continue
        run = i
        while i < len(messages) and messages[i].role in ("user", "tool"):
            i += 1
        if i < len(messages) and messages[i].role == "system":
            raise BadRequest(f"messages[{i}]: a system message after the conversation started is not supported")
        observed = chat.render_observations(messages[run:i], closed=True)
        ids, mask = ids + observed, mask + [0] * len(observed)
    return ids, mask


@dataclass(frozen=True)
class Pending:
    """A request's prompt, before its generation: whether it extends the current row."""

    prompt_ids: list[int]
    extends: bool
    messages: list[Message]
    tools: list[dict]


class RowRecorder:
    """One episode's rows as its requests come: ``prompt(request)``, generate, then ``record(pending, sample, reply)``.
    ``rows`` is every row so far, oldest first; ``turns`` one ``Turn`` per request (spans index into that request's
    row)."""

    def __init__(self, chat) -> None:
        self.chat = chat
        self.rows: list[TokenRow] = []
        self.turns: list[Turn] = []
        self.history: list[Message] = []  # the current row's conversation: the last request's and the reply
        self.tools: list[dict] | None = None

    def prompt(self, request: ChatRequest) -> Pending:
        n = len(self.history)
        new = request.messages[n:]
        extends = (self.rows and request.tools == self.tools and len(request.messages) > n
                   and request.messages[:n] == self.history and all(m.role in ("user", "tool") for m in new))
        if extends:
            row = self.rows[-1]
            closed = bool(row.token_ids) and row.token_ids[-1] == self.chat.end_of_turn
            ids = row.token_ids + self.chat.render_observations(new, closed=closed)
        else:
            ids = render_conversation(self.chat, request.tools, request.messages)
        return Pending(ids, bool(extends), list(request.messages), list(request.tools))

    def record(self, pending: Pending, sample: Sample, reply: Message, seconds: float = 0.0) -> Turn:
        """Append the request's new prompt tokens and the engine's ``sample`` to the current row (a new one unless
        the request extended it); ``reply`` is the message the harness was given, which its next request must echo
        for the row to go on."""
        if pending.extends:
            row = self.rows[-1]
        else:
            row = TokenRow()
            self.rows.append(row)
        start = len(row.token_ids)
        appended = pending.prompt_ids[start:]
        ids = [int(i) for i in sample.token_ids]
        versions = sample.token_versions if isinstance(sample.token_versions, list) and \
            len(sample.token_versions) == len(ids) else [int(sample.version)] * len(ids)
        row.token_ids += appended + ids
        row.loss_mask += [0] * len(appended) + [1] * len(ids)
        row.logprobs += [0.0] * len(appended) + [float(x) for x in sample.logprobs]
        row.token_versions += [-1] * len(appended) + [int(v) for v in versions]
        _place_routing(row, len(pending.prompt_ids), sample)
        self.history = [*pending.messages, reply]
        self.tools = pending.tools
        turn = Turn(index=len(self.turns), prompt_tokens=len(pending.prompt_ids), generated_tokens=len(ids),
                    observation_tokens=0, finish_reason=sample.finish_reason, version=int(sample.version),
                    cached_tokens=int(sample.cached_tokens), prefill_tokens=int(sample.prefill_tokens),
                    seconds_generate=seconds)
        if self.turns and pending.extends:
            self.turns[-1].observation_tokens = len(appended)
        self.turns.append(turn)
        return turn


def _place_routing(row: TokenRow, prompt_len: int, sample: Sample) -> None:
    """Routing of the tokens this request fed, ``prompt[cached:] + generated[:-1]``, at their positions in ``row``
    (as the agent loop places it); a misaligned report is dropped rather than replayed on the wrong tokens."""
    routing = sample.routed_experts
    if routing is None:
        if row.routed_experts is not None:
            row.routed_experts += [None] * (len(row.token_ids) - len(row.routed_experts))
        return
    start = int(sample.cached_tokens or 0)
    fed = prompt_len - start + max(0, len(sample.token_ids) - 1)
    if row.routed_experts is None:
        row.routed_experts = [None] * len(row.token_ids)
    row.routed_experts += [None] * (len(row.token_ids) - len(row.routed_experts))
    if isinstance(routing, list) and len(routing) == fed and start >= 0:
        row.routed_experts[start : start + fed] = routing
