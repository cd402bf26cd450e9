"""A minimal agent harness, as a readable example of what runs behind the recording proxy: an OpenAI chat client
that offers one tool, ``bash``, runs each call and sends back its output, until the model answers without a call
or calls ``submit``. It knows nothing of sandforge beyond the OpenAI environment variables (OPENAI_BASE_URL,
OPENAI_API_KEY) and the instruction file; stdlib only, so any image with python3 runs it.

    python3 bash_loop.py INSTRUCTION_FILE [--max-steps N]
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in the working directory; returns its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Call when the task is done.",
        "parameters": {"type": "object", "properties": {}}}},
]
SYSTEM = "You are an agent in a Linux sandbox. Use the bash tool to do the task, then call submit."


def chat(messages: list) -> dict:
    body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode()
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def run(command: str) -> str:
    try:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "(timed out after 60 s)"
    return (done.stdout + done.stderr)[-4000:] + f"\n(exit code {done.returncode})"


def main() -> int:
    instruction = open(sys.argv[1]).read()
    max_steps = int(sys.argv[sys.argv.index("--max-steps") + 1]) if "--max-steps" in sys.argv else 30
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": instruction}]
    for _ in range(max_steps):
        try:
            reply = chat(messages)["choices"][0]["message"]
        except urllib.error.HTTPError as e:  # the proxy ends the episode with a 400 once its budget is spent
            print(f"the model server said {e.code}: {e.read().decode(errors='replace')[:300]}")
            return 0
        messages.append({k: v for k, v in reply.items() if k in ("role", "content", "tool_calls",
                                                                    "reasoning_content")})
        calls = reply.get("tool_calls") or []
        if not calls:
            return 0
        for call in calls:
            name = call["function"]["name"]
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError as e:
                output = f"Error: the arguments are not JSON ({e})"
            else:
                if name == "submit":
                    return 0
                output = run(str(args.get("command", ""))) if name == "bash" else f"Error: no tool named {name}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return 0


if __name__ == "__main__":
    sys.exit(main())
