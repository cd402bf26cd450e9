"""The ``rubric`` check: a weighted composite of other checks, with partial credit.

    {"verifier": "rubric", "items": [
        {"weight": 2, "label": "builds", "check": {"verifier": "command", "command": "make"}},
        {"weight": 1, "check": {"verifier": "file_contains", "path": "README.md", "text": "Usage"}}]}

Score = sum(weight * item score) / sum(weights), so half the work earns half the reward where a plain check list
would demand everything for success. Each item is a full check (any verifier, a rubric too) with its own ``timeout``;
the rubric's default timeout is the sum of its items', so one slow item cannot starve the rest. An item that cannot
run (a broken sandbox, a bad argument, a hang) fails the whole episode, as a plain check would: a rubric never turns
a broken verifier into a low score.
"""

from __future__ import annotations

import math

from sandforge.types import Sandbox
from sandforge.verifiers.checks import VerifierError, check_timeout, run_check


def _items(args: dict) -> list[tuple[str, float, dict]]:
    """(label, weight, check) per item; VerifierError naming the item for any malformed one."""
    items = args.get("items")
    if set(args) - {"timeout"} != {"items"} or not isinstance(items, list) or not items:
        raise VerifierError(f"rubric takes items: a non-empty list of {{weight, check[, label]}}[, timeout]; "
                            f"got {sorted(args)}")
    parsed, labels = [], set()
    for j, item in enumerate(items):
        if not isinstance(item, dict) or "check" not in item or set(item) - {"weight", "check", "label"}:
            raise VerifierError(f"rubric item {j} must be {{weight, check[, label]}}, got {item!r}")
        weight, check = item.get("weight", 1), item["check"]
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise VerifierError(f"rubric item {j}: weight must be a number >= 0, got {weight!r}")
        if not isinstance(check, dict):
            raise VerifierError(f"rubric item {j}: check must be a mapping {{'verifier': name, ...}}, got {check!r}")
        label = str(item.get("label") or f"{j}:{check.get('verifier')}")
        if label in labels:
            raise VerifierError(f"rubric item {j}: label {label!r} is used twice")
        labels.add(label)
        parsed.append((label, float(weight), check))
    if sum(w for _, w, _ in parsed) <= 0:
        raise VerifierError("rubric: the weights sum to 0; give at least one item a positive weight")
    return parsed


def _default_timeout(args: dict) -> float:
    try:
        return sum(check_timeout(check) for _, _, check in _items(args))
    except VerifierError:
        return 1.0  # the rubric fails on its arguments straight away and says why


def rubric_verifier(sandbox: Sandbox, args: dict) -> tuple[float, str, dict[str, float]]:
    """The weighted mean of the items' scores; breakdown has each item's score under its label (and a nested
    rubric's items under "label/item")."""
    items = _items(args)
    scores: dict[str, float] = {}
    parts: dict[str, float] = {}
    reasons = []
    for j, (label, weight, check) in enumerate(items):
        result = run_check(sandbox, check, f"item {j}")
        scores[label] = result.score
        parts.update({f"{label}/{part}": s for part, s in result.breakdown.items()})  # a nested rubric's items
        reasons.append(f"{label} ({weight:g}): {result.score:.2f} {result.reason}")
    total = sum(weight for _, weight, _ in items)
    score = sum(weight * scores[label] for label, weight, _ in items) / total
    return min(1.0, score), f"rubric {score:.2f} [" + "; ".join(reasons) + "]", {**scores, **parts}


rubric_verifier.default_timeout = _default_timeout  # the sum of its items' timeouts
