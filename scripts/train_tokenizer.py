#!/usr/bin/env python
"""Train the built-in policy's byte-level BPE tokenizer and write ``models/assets/tokenizer.json``.

The corpus is what the policy reads and writes in the built-in environments, split the way ``ChatFormat`` encodes it:
task instructions and setup files, the tool declarations of the system prompt, reasoning and compact tool-call JSON,
and tool observations (produced by the real ``TerminalEnv`` tools over an in-memory stand-in for the sandbox, so their
wording is exact), plus synthetic English, shell and Python so an unseen environment does not fall back to bytes.
Train and held-out task splits are both in it; the compression check below uses held-out seeds the corpus never saw.

    .venv/bin/python scripts/train_tokenizer.py            # ~10 s; prints bytes per token against ByteTokenizer
"""

from __future__ import annotations

import argparse
import json
import posixpath
import random
import re
import shlex
import time
from pathlib import Path

from sandforge.sandbox.docker_sandbox import SandboxSpec
from sandforge.environments.terminal.env import TerminalEnv
from sandforge.environments.terminal.tasks import FAMILIES, SPLITS
from sandforge.environments.tools import tool_schemas
from sandforge.models.bpe import SHIPPED, BPETokenizer, train_bpe
from sandforge.models.chat import ChatFormat, tool_line
from sandforge.models.tokenizer import ByteTokenizer
from sandforge.types import ExecResult, Message, Task, ToolCall

CORPUS_SEEDS = {"train": range(0, 1200), "heldout": range(0, 300)}
EVAL_SEEDS = range(1_000_000, 1_000_200)  # held-out split, seeds the corpus never used
NO_TOOL_CALL = "No tool call found. Call one of the tools, or call submit() when the task is done."  # rollout/agent.py


# ---------------------------------------------------------------- a sandbox stand-in
class FakeSandbox:
    """In-memory files and a handful of shell commands, enough for TerminalEnv's tools to print real observations."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = dict(files)

    def write_file(self, path: str, content: str) -> None:
        self.files[self._abs(path)] = content

    def read_file(self, path: str) -> str | None:
        return self.files.get(self._abs(path))

    @staticmethod
    def _abs(path: str) -> str:
        return posixpath.normpath(posixpath.join("/workspace", path))

    def exec(self, command: str, timeout: float = 10.0) -> ExecResult:
        code, out, timed_out = self._shell(command)
        return ExecResult(code, out, timed_out, 0.01)

    def _shell(self, command: str) -> tuple[int, str, bool]:
        def words(path: str) -> int | None:
            text = self.read_file(path)
            return None if text is None else len(text.split())

        def missing(tool: str, path: str) -> tuple[int, str, bool]:
            return 1, f"{tool}: {path}: No such file or directory\n", False

        if m := re.fullmatch(r"wc -w < (\S+) > (\S+)", command):
            n = words(m[1])
            if n is None:
                return 1, f"bash: line 1: {m[1]}: No such file or directory\n", False
            self.write_file(m[2], f"{n}\n")
            return 0, "", False
        if m := re.fullmatch(r"(?:wc -w < (\S+)|cat (\S+) \| wc -w)", command):
            n = words(m[1] or m[2])
            return (0, f"{n}\n", False) if n is not None else missing("cat", m[1] or m[2])
        if m := re.fullmatch(r"wc (-[wlc]) (\S+)", command):
            text = self.read_file(m[2])
            if text is None:
                return missing("wc", m[2])
            n = {"-w": len(text.split()), "-l": text.count("\n"), "-c": len(text.encode())}[m[1]]
            return 0, f"{n} {m[2]}\n", False
        if m := re.fullmatch(r"cat (\S+)", command):
            text = self.read_file(m[1])
            return (0, text, False) if text is not None else missing("cat", m[1])
        if m := re.fullmatch(r"echo (.*) > (\S+)", command):
            self.write_file(m[2], " ".join(shlex.split(m[1])) + "\n")
            return 0, "", False
        if command in ("ls", "ls /workspace", "ls -1"):
            names = sorted(posixpath.relpath(p, "/workspace") for p in self.files)
            return 0, "".join(f"{n}\n" for n in names), False
        if command == "pwd":
            return 0, "/workspace\n", False
        if command.startswith("sleep"):
            return 124, "", True
        return 127, f"bash: line 1: {command.split()[0]}: command not found\n", False


# ---------------------------------------------------------------- task text
def _body(call: ToolCall) -> str:
    """A tool call as render_assistant writes it between <tool_call> and </tool_call>."""
    return json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False, separators=(",", ":"))


def _exploration(task: Task, rng: random.Random) -> list[ToolCall]:
    """Calls a policy plausibly makes before (or instead of) the reference solution, including mistakes."""
    paths = [*task.setup.get("files", {}), *(c["path"] for c in task.checks if "path" in c)]
    path = rng.choice(paths)
    pool = [
        ToolCall("bash", {"command": "ls"}),
        ToolCall("bash", {"command": f"cat {path}"}),
        ToolCall("bash", {"command": f"wc -w {path}"}),
        ToolCall("bash", {"command": f"wc -l {path}"}),
        ToolCall("bash", {"command": f"cat {path} | wc -w"}),
        ToolCall("bash", {"command": "pwd"}),
        ToolCall("bash", {"command": "sleep 30"}),
        ToolCall("bash", {"command": f"echo {rng.randint(1, 20)} > /workspace/answer.txt"}),
        ToolCall("bash", {"command": "python3 -c 'print(1)'"}),
        ToolCall("read_file", {"path": path}),
        ToolCall("read_file", {"path": "/workspace/answer.txt"}),
        ToolCall("write_file", {"path": path}),  # missing argument
        ToolCall("write_file", {"path": path, "content": rng.randint(0, 9)}),  # wrong type
        ToolCall("bash", {"cmd": "ls"}),  # unknown argument
        ToolCall(rng.choice(["run", "shell", "exec", "cat"]), {"command": "ls"}),  # unknown tool
    ]
    return rng.sample(pool, rng.randint(0, 3))


def _parse_errors(task: Task, chat: ChatFormat) -> list[str]:
    """The error observations the agent loop sends back for malformed replies."""
    sp, enc = chat.tokenizer.encode_special, chat.tokenizer.encode
    body = _body(task.solution[0])
    think = [sp("<think>"), *enc("I will"), sp("</think>")]
    replies = [
        [*think, sp("<tool_call>"), *enc(body[:-1]), sp("</tool_call>"), sp("<|end|>")],  # invalid JSON
        [sp("<think>"), *enc("I will use " + task.solution[0].name)],  # cut off
        [sp("<tool_call>"), *enc(json.dumps(task.solution[0].arguments)), sp("</tool_call>"), sp("<|end|>")],
        [sp("<think>"), *enc("ok"), sp("<tool_call>"), *enc(body), sp("<|end|>")],
        [sp("<think>"), *enc("done"), sp("</think>"), sp("<tool_call>"), *enc("[]"), sp("</tool_call>"), sp("<|end|>")],
    ]
    return [f"Error: {e}" for ids in replies for e in chat.parse_assistant(ids)[1]]


def _start(env: TerminalEnv, task: Task) -> dict[str, str]:
    """Point ``env`` at a fresh FakeSandbox holding ``task``'s setup files (what ``reset`` does with Docker)."""
    files = {posixpath.join("/workspace", p): c for p, c in task.setup.get("files", {}).items()}
    env._sandbox = FakeSandbox(files)  # noqa: SLF001 - the tools only need exec/read_file/write_file
    env._done = False  # noqa: SLF001
    return files


def _terminal_env(task: Task) -> TerminalEnv:
    return TerminalEnv(task, SandboxSpec(image="sandforge-terminal"), run_id="tokenizer-corpus")  # no container yet


def episode_texts(task: Task, env: TerminalEnv, chat: ChatFormat, rng: random.Random, system: str) -> list[str]:
    """Every text ChatFormat encodes in one plausible episode of ``task``, one string per ``encode`` call."""
    files = _start(env, task)
    texts = [system, task.instruction, *files.values()]
    calls = _exploration(task, rng) + list(task.solution)
    if rng.random() < 0.1:
        calls.append(ToolCall("bash", {"command": "ls"}))  # after submit: "the episode is over"
    for call in calls:
        texts += [f"I will use {call.name}.", "", _body(call)]
        observation = env.step(call)[0]
        texts.append(f"{call.name}\n{observation}")
    texts.append("done")
    if rng.random() < 0.2:
        texts.append(f"error\nError: {NO_TOOL_CALL}")
    if rng.random() < 0.2:
        texts += [f"error\n{e}" for e in _parse_errors(task, chat)]
    return [t for t in texts if t]


def task_corpus(seeds: dict[str, range]) -> list[str]:
    tasks = [FAMILIES[f](seed, split) for split in SPLITS for seed in seeds.get(split, ()) for f in FAMILIES]
    env = _terminal_env(tasks[0])
    system = "\n".join(["# Tools", *(tool_line(t) for t in tool_schemas(env))])
    chat = ChatFormat(ByteTokenizer())
    rng = random.Random(0)
    return [text for task in tasks for text in episode_texts(task, env, chat, rng, system)]


# ---------------------------------------------------------------- generic text
_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A user asked the assistant to fix a failing test in the repository.
Read the error message carefully before you change any code. The function returns the number of lines in the file.
Please write a short summary of the meeting notes and post it in the team channel. Open the page, find the search box,
type the query and press enter. The build failed because a dependency was missing; install it and run the tests again.
Each worker runs many episodes at once, and every episode gets a fresh sandbox that is removed when it ends.
If the command prints nothing, check the exit code. Move the configuration file into the config directory and update
the path in the script. The server listens on port 8080 and writes its logs to /var/log/app.log.
We should rename the variable so that its name says what it holds. Add a docstring that explains why, not what.
Create a new branch, commit your changes with a clear message, and open a pull request for review.
Sort the rows by date, remove duplicates, and save the result as a CSV file with a header line.
The table has three columns: name, email and status. Only active users should receive the weekly report.
Schedule the meeting for Tuesday at 10 am and invite everyone on the project. Reply to the thread when you are done.
It is important to handle errors gracefully: a missing file should produce a helpful message, not a crash.
Download links, images and scripts are not available offline, so the page must work without them.
The answer is 42. There are 7 files in the directory and 3 of them are empty. The total is 1,250 dollars.
Thank you for your help! Could you also check whether the output matches the expected format?
First, list the files. Then, read the one that looks relevant. Finally, write the answer and submit it.
"""

_CODE = '''\
def count_words(path: str) -> int:
    """Number of whitespace-separated words in the file at ``path``."""
    with open(path, encoding="utf-8") as f:
        return len(f.read().split())


class Config:
    def __init__(self, name, values=None):
        self.name = name
        self.values = values or {}

    def get(self, key, default=None):
        return self.values.get(key, default)


for i, line in enumerate(lines):
    if not line.strip():
        continue
    print(f"{i}: {line}")

import os
import sys
import json
from pathlib import Path

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

Traceback (most recent call last):
  File "/workspace/main.py", line 12, in <module>
    result = compute(data)
KeyError: 'value'
'''

_SHELL = """\
ls -la /workspace
cd /workspace && git status
grep -rn "TODO" src/ | head -20
find . -name "*.py" -type f | xargs wc -l
cat config.yaml | grep port
mkdir -p build && cp *.txt build/
echo "hello world" > output.txt
python3 -m pytest tests/ -q
sed -i 's/foo/bar/g' file.txt
tail -n 50 /var/log/syslog
sort data.csv | uniq -c | sort -rn
chmod +x run.sh && ./run.sh
total 12
drwxr-xr-x 2 sandbox sandbox 4096 Jan  1 00:00 .
-rw-r--r-- 1 sandbox sandbox   42 Jan  1 00:00 notes.txt
On branch main
nothing to commit, working tree clean
3 passed in 0.12s
Permission denied
No such file or directory
command not found
"""

_NOUNS = (
    "file directory folder line word number name list report table user page message test error value path output "
    "input result command script function class module config branch commit server request response record column"
).split()
_VERBS = "create write read count list find move copy rename delete sort print append replace check open save".split()
_ADJECTIVES = "new old first last empty large small hidden current final main temporary sorted unique total".split()


def generic_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Hand-written English, shell and Python, plus templated instructions over words the tasks do not use."""
    rng = random.Random(seed)
    texts = [*_ENGLISH.splitlines(), *_CODE.split("\n\n"), *_SHELL.splitlines()] * 3
    for _ in range(n):
        noun, other = rng.sample(_NOUNS, 2)
        path = f"/{rng.choice(['home/user', 'tmp', 'workspace/src', 'var/data', 'etc'])}/{other}_{rng.randint(1, 99)}"
        path += rng.choice([".txt", ".py", ".json", ".csv", ".md", ".log", ".yaml", ""])
        templates = [
            f"{rng.choice(_VERBS).capitalize()} the {rng.choice(_ADJECTIVES)} {noun} in {path}.",
            f"{rng.choice(_VERBS).capitalize()} every {noun} that contains the {other} {rng.randint(0, 1000)}.",
            f'{{"{noun}": "{other}", "count": {rng.randint(0, 500)}, "ok": {rng.choice(["true", "false", "null"])}}}',
            f"{noun}_{other} = {rng.choice(['[]', '{}', 'None', str(rng.randint(0, 99)), repr(other)])}",
            f"$ {rng.choice(['cat', 'ls', 'wc -l', 'head', 'rm', 'touch'])} {path}",
        ]
        texts.append(rng.choice(templates))
    return texts


# ---------------------------------------------------------------- evaluation
def heldout_sample() -> list[str]:
    """Held-out task text the corpus never saw: instructions and reference solutions as the policy emits them."""
    texts = []
    for seed in EVAL_SEEDS:
        for family in FAMILIES:
            task = FAMILIES[family](seed, "heldout")
            texts.append(task.instruction)
            texts += [t for call in task.solution for t in (f"I will use {call.name}.", _body(call))]
    return texts


def scripted_episode(task: Task, env: TerminalEnv, chat: ChatFormat) -> list[int]:
    """The full token sequence of an episode that replays ``task``'s reference solution, as the agent loop builds it."""
    _start(env, task)
    ids = chat.render_prompt(env.tools, [Message("user", task.instruction)])
    for call in task.solution:
        ids += chat.render_assistant(Message("assistant", reasoning=f"I will use {call.name}.", tool_calls=[call]))
        observation = env.step(call)[0]
        ids += chat.render_observations([Message("tool", observation, name=call.name)], closed=True)
    return ids


def bytes_per_token(tok, texts: list[str]) -> float:
    return sum(len(t.encode()) for t in texts) / max(1, sum(len(tok.encode(t)) for t in texts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=1024, help="full vocabulary, control tokens included")
    parser.add_argument("--out", type=Path, default=SHIPPED, help="where to write tokenizer.json")
    args = parser.parse_args()

    start = time.perf_counter()
    tasks, generic = task_corpus(CORPUS_SEEDS), generic_corpus()
    corpus = tasks + generic
    size = sum(len(t.encode()) for t in corpus)
    print(f"corpus: {len(tasks)} task texts + {len(generic)} generic texts, {size:,} bytes")
    tok = train_bpe(corpus, vocab_size=args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    assert BPETokenizer.load(args.out).to_dict() == tok.to_dict()
    print(f"trained in {time.perf_counter() - start:.1f}s: {tok.n_text} BPE ids + 12 control tokens, "
          f"vocab_size {tok.vocab_size} -> {args.out}")

    byte_tok = ByteTokenizer()
    samples = {
        "held-out task text": heldout_sample(),
        "unseen source (models/tokenizer.py)": [Path(__file__).parents[1].joinpath("models/tokenizer.py").read_text()],
    }
    for name, texts in samples.items():
        bpe, base = bytes_per_token(tok, texts), bytes_per_token(byte_tok, texts)
        print(f"{name}: BPE {bpe:.2f} bytes/token, bytes {base:.2f} bytes/token -> {bpe / base:.2f}x fewer tokens")
    tasks = [FAMILIES[f](seed, "heldout") for seed in EVAL_SEEDS for f in FAMILIES]
    env = _terminal_env(tasks[0])
    lengths = {}
    for name, t in (("BPE", tok), ("bytes", byte_tok)):
        chat = ChatFormat(t)
        lengths[name] = sum(len(scripted_episode(task, env, chat)) for task in tasks) / len(tasks)
    print(f"scripted held-out episode (prompt, solution, observations): {lengths['BPE']:.0f} tokens with BPE, "
          f"{lengths['bytes']:.0f} with bytes -> {lengths['bytes'] / lengths['BPE']:.2f}x shorter")


if __name__ == "__main__":
    main()
