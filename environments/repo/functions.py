"""The functions generated repositories are made of, each with the bugs that can be injected into it.

A ``Function`` is the correct source of one small, plausible function, the modules it fits in, a way to draw inputs,
and per bug kind the one line that the bug replaces (``bugs[kind] = (correct line, buggy line)``). Expected values
are never written by hand: ``tasks.py`` runs the correct and the buggy source on the drawn inputs, so a test's
expectation is what the correct code returns and whether it exposes the bug is measured, not assumed.

A function's name is generated per task (``tasks.py``), so train and held-out repositories call the same logic by
names of their own split.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

OFF_BY_ONE, WRONG_OPERATOR, WRONG_CONDITION = "off_by_one", "wrong_operator", "wrong_condition"


@dataclass(frozen=True)
class Function:
    module: str  # which kind of module it belongs in: "numbers", "lists" or "text"
    source: str  # with {name} where the function's name goes
    inputs: Callable[[random.Random], tuple]  # one random argument tuple
    edges: tuple[tuple, ...] = ()  # argument tuples always tried: the cases a bug tends to hide in
    bugs: dict[str, tuple[str, str]] = field(default_factory=dict)

    def code(self, name: str, bug: str | None = None) -> str:
        text = self.source.format(name=name)
        if bug is not None:
            good, bad = self.bugs[bug]
            assert text.count(good) == 1, f"{name}: the bug line must occur once"
            text = text.replace(good, bad)
        return text


def _ints(rng: random.Random, lo: int = -9, hi: int = 20, n: tuple[int, int] = (0, 7)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


FUNCTIONS: list[Function] = [
    Function(
        module="numbers",
        source='''def {name}(value, low, high):
    """value limited to the range [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value
''',
        inputs=lambda r: (r.randint(-20, 30), r.randint(-5, 5), r.randint(6, 15)),
        edges=((-30, 0, 10), (40, 0, 10)),
        bugs={WRONG_CONDITION: ("    if value > high:", "    if value < high:")},
    ),
    Function(
        module="numbers",
        source='''def {name}(values):
    """Arithmetic mean of values; 0.0 for an empty list."""
    if not values:
        return 0.0
    return sum(values) / len(values)
''',
        inputs=lambda r: (_ints(r, n=(1, 6)),),
        edges=(([],), ([1, 2],), ([3, 4, 4],)),
        bugs={
            WRONG_OPERATOR: ("    return sum(values) / len(values)", "    return sum(values) // len(values)"),
            WRONG_CONDITION: ("    if not values:", "    if values is None:"),
        },
    ),
    Function(
        module="numbers",
        source='''def {name}(items, per_page):
    """How many pages `items` entries fill at `per_page` a page."""
    return (items + per_page - 1) // per_page
''',
        inputs=lambda r: (r.randint(0, 60), r.randint(1, 9)),
        edges=((10, 5), (11, 5), (0, 3)),
        bugs={
            OFF_BY_ONE: (
                "    return (items + per_page - 1) // per_page", "    return (items + per_page) // per_page"
            ),
            WRONG_OPERATOR: (
                "    return (items + per_page - 1) // per_page", "    return (items - per_page - 1) // per_page"
            ),
        },
    ),
    Function(
        module="numbers",
        source='''def {name}(n):
    """n! for n >= 0."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
''',
        inputs=lambda r: (r.randint(0, 9),),
        edges=((0,), (1,), (4,), (6,)),
        bugs={
            OFF_BY_ONE: ("    for k in range(2, n + 1):", "    for k in range(2, n):"),
            WRONG_OPERATOR: ("        result *= k", "        result += k"),
        },
    ),
    Function(
        module="numbers",
        source='''def {name}(year):
    """Whether `year` has a 29th of February."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
''',
        inputs=lambda r: (r.choice([1900, 2000, 2023, 2024, 2100, 1996, 2400, 2019]),),
        edges=((1900,), (2000,), (2024,), (2023,)),
        bugs={
            WRONG_CONDITION: (
                "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
                "    return year % 4 == 0 and (year % 100 != 0 and year % 400 == 0)",
            ),
        },
    ),
    Function(
        module="numbers",
        source='''def {name}(part, whole):
    """part as a percentage of whole, rounded to one decimal."""
    return round(100 * part / whole, 1)
''',
        inputs=lambda r: (r.randint(0, 50), r.randint(1, 80)),
        edges=((1, 4), (3, 3), (0, 7)),
        bugs={WRONG_OPERATOR: ("    return round(100 * part / whole, 1)", "    return round(100 * part * whole, 1)")},
    ),
    Function(
        module="lists",
        source='''def {name}(values, width):
    """Sum of every run of `width` consecutive values."""
    sums = []
    for start in range(len(values) - width + 1):
        sums.append(sum(values[start:start + width]))
    return sums
''',
        inputs=lambda r: (_ints(r, n=(2, 7)), r.randint(1, 3)),
        edges=(([1, 2, 3], 2), ([5, 5], 2), ([4], 1)),
        bugs={
            OFF_BY_ONE: (
                "    for start in range(len(values) - width + 1):", "    for start in range(len(values) - width):"
            ),
            WRONG_OPERATOR: (
                "        sums.append(sum(values[start:start + width]))",
                "        sums.append(sum(values[start:start - width]))",
            ),
        },
    ),
    Function(
        module="lists",
        source='''def {name}(items, n):
    """The last n items (all of them if there are fewer)."""
    if n <= 0:
        return []
    return items[-n:]
''',
        inputs=lambda r: (_ints(r, n=(1, 7)), r.randint(1, 4)),
        edges=(([1, 2, 3], 2), ([7], 1), ([1, 2], 0)),
        bugs={
            OFF_BY_ONE: ("    return items[-n:]", "    return items[-n + 1:]"),
            WRONG_CONDITION: ("    if n <= 0:", "    if n <= 1:"),
        },
    ),
    Function(
        module="lists",
        source='''def {name}(values, threshold):
    """How many values are strictly greater than threshold."""
    return sum(1 for v in values if v > threshold)
''',
        inputs=lambda r: (_ints(r, 0, 9, n=(1, 7)), r.randint(0, 9)),
        edges=(([3, 5, 5, 7], 5), ([1, 2], 2)),
        bugs={WRONG_CONDITION: (
            "    return sum(1 for v in values if v > threshold)", "    return sum(1 for v in values if v >= threshold)"
        )},
    ),
    Function(
        module="lists",
        source='''def {name}(items, size):
    """items split into lists of `size` (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
''',
        inputs=lambda r: (_ints(r, 0, 9, n=(1, 8)), r.randint(1, 3)),
        edges=(([1, 2, 3, 4], 2), ([1, 2, 3], 3)),
        bugs={OFF_BY_ONE: (
            "    return [items[i:i + size] for i in range(0, len(items), size)]",
            "    return [items[i:i + size - 1] for i in range(0, len(items), size)]",
        )},
    ),
    Function(
        module="lists",
        source='''def {name}(values):
    """Index of the largest value (the first one on ties); -1 for an empty list."""
    best = -1
    for i in range(len(values)):
        if best < 0 or values[i] > values[best]:
            best = i
    return best
''',
        inputs=lambda r: (_ints(r, 0, 9, n=(1, 6)),),
        edges=(([1, 5, 2],), ([1, 2, 9],), ([4, 4],), ([],)),
        bugs={
            OFF_BY_ONE: ("    for i in range(len(values)):", "    for i in range(len(values) - 1):"),
            WRONG_CONDITION: (
                "        if best < 0 or values[i] > values[best]:", "        if best < 0 or values[i] >= values[best]:"
            ),
        },
    ),
    Function(
        module="lists",
        source='''def {name}(values, factor):
    """Every value multiplied by factor."""
    return [v * factor for v in values]
''',
        inputs=lambda r: (_ints(r, n=(1, 5)), r.randint(2, 5)),
        edges=(([1, 2], 3),),
        bugs={WRONG_OPERATOR: ("    return [v * factor for v in values]", "    return [v + factor for v in values]")},
    ),
    Function(
        module="text",
        source='''def {name}(full_name):
    """Upper-case first letters of each word: "ada lovelace" -> "AL"."""
    return "".join(word[0].upper() for word in full_name.split())
''',
        inputs=lambda r: (" ".join(r.choice(["ada", "alan", "grace", "linus", "kay", "barbara", "ken"])
                                    for _ in range(r.randint(1, 3))),),
        edges=(("grace hopper",), ("ada",)),
        bugs={OFF_BY_ONE: (
            '    return "".join(word[0].upper() for word in full_name.split())',
            '    return "".join(word[1].upper() for word in full_name.split())',
        )},
    ),
    Function(
        module="text",
        source='''def {name}(text, limit):
    """text cut to at most `limit` characters, ending in "..." when cut."""
    if len(text) <= limit:
        return text
    return text[:limit - 3] + "..."
''',
        inputs=lambda r: ("".join(r.choice("abcdefgh") for _ in range(r.randint(2, 14))), r.randint(4, 10)),
        edges=(("abcdefgh", 8), ("abcdefghij", 6)),
        bugs={
            WRONG_CONDITION: ("    if len(text) <= limit:", "    if len(text) < limit:"),
            OFF_BY_ONE: ('    return text[:limit - 3] + "..."', '    return text[:limit - 2] + "..."'),
        },
    ),
    Function(
        module="text",
        source='''def {name}(text):
    """How many of the letters are vowels (a, e, i, o, u, either case)."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''',
        inputs=lambda r: ("".join(r.choice("abcdeiouxyz ") for _ in range(r.randint(0, 10))),),
        edges=(("Anna",), ("sky",)),
        bugs={WRONG_CONDITION: (
            '    return sum(1 for ch in text.lower() if ch in "aeiou")',
            '    return sum(1 for ch in text.lower() if ch not in "aeiou")',
        )},
    ),
    Function(
        module="text",
        source='''def {name}(word, times):
    """word repeated `times` times, separated by single spaces."""
    return " ".join([word] * times)
''',
        inputs=lambda r: (r.choice(["hey", "go", "ok", "la"]), r.randint(1, 4)),
        edges=(("hi", 3), ("yo", 0)),
        bugs={
            WRONG_OPERATOR: ('    return " ".join([word] * times)', '    return " ".join([word] + [word] * times)'),
            OFF_BY_ONE: ('    return " ".join([word] * times)', '    return " ".join([word] * (times - 1))'),
        },
    ),
]

MODULES = ("numbers", "lists", "text")
