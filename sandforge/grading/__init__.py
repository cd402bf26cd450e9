"""Grading's own room: what a grader's command in a policy's sandbox starts with (``startup``: root's imports first,
offline uv, safe git, from the shell and Python files in ``files/``) and the modules the policy planted that are set
aside before it runs (``shadows``). The verifiers and the Harbor grader use it; nothing here imports Docker or knows
an episode."""
