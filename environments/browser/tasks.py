"""Procedural browser tasks on the mock sites: buy in the shop, book a table, answer from the wiki.

Each family turns a seed into a Task: the site's content (``setup["site"]``, served by ``sites/server.py``), an
instruction naming the start URL, ``sql`` checks on the site's database, and a reference solution that acts through the
policy's own tools. Solutions name elements by the ids the driver gives them (document order of links, inputs and
buttons), so they follow the page layouts in ``sites/server.py`` (its comments list each page's ids).

Same (family, seed, split) -> same task. Guests, towns and rivers are fresh syllable words of the task's split
(environments/words.py), and a booking's dates and a wiki's facts are dates and numbers of its split (split by the
words' hash), so what a solution types can only be copied, and held-out tasks ask for values no training task uses.
Held-out products come from a pool the train split never uses.
"""

from __future__ import annotations

import random
import re
from datetime import date, timedelta
from itertools import islice
from typing import Callable

from sandforge.environments.browser.env import SITE_DB, SITE_URL
from sandforge.environments.recovery import stumble
from sandforge.environments.seeding import SPLITS, task_start  # noqa: F401 - SPLITS: the task module's
from sandforge.environments.words import distinct, split_of
from sandforge.types import Task, ToolCall

_PRODUCTS = {
    "train": ["Tea mug", "Desk lamp", "Wool socks", "Notebook", "Water bottle", "Pencil case", "Phone stand",
              "Rain hat", "Bath towel", "Cutting board"],
    "heldout": ["Coffee grinder", "Yoga mat", "Bike bell", "Candle", "Picture frame", "Plant pot", "Backpack"],
}
_REGIONS = ["northern", "southern", "eastern", "western", "central"]
_FIRST_DAY, _DAYS = date(2026, 1, 1), 4 * 365  # booking dates of both splits fall in these four years
_TIMES = ["17:30", "18:00", "18:30", "19:00", "19:30", "20:00", "20:30", "21:00"]


def _start(family: str, seed: int, split: str) -> tuple[random.Random, str]:
    return task_start("browser", family, seed, split)


def _names(rng: random.Random, split: str, n: int, words: int = 1) -> list[str]:
    """``n`` different capitalised names of ``words`` fresh syllable words each: guests, towns, rivers."""
    taken: set[str] = set()
    return [" ".join(w.capitalize() for w in distinct(rng, split, words, taken)) for _ in range(n)]


def _number(rng: random.Random, split: str, lo: int, hi: int) -> int:
    """A number in [lo, hi] of ``split`` (split by the words' hash of its digits)."""
    while True:
        n = rng.randint(lo, hi)
        if split_of(str(n)) == split:
            return n


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _sql(query: str, expect: list[list]) -> dict:
    return {"verifier": "sql", "db": SITE_DB, "query": query, "expect": expect}


def shop_task(seed: int, split: str = "train") -> Task:
    rng, task_id = _start("shop", seed, split)
    names = rng.sample(_PRODUCTS[split], rng.randint(4, 6))
    products = [
        {"slug": _slug(n), "name": n, "price_cents": rng.randint(3, 60) * 100 + rng.choice([0, 49, 99]),
         "description": f"A good {n.lower()}, sold by the Corner Shop."}
        for n in names
    ]
    target = rng.randrange(len(products))
    product, quantity = products[target]["name"], rng.randint(2, 5)
    url = f"{SITE_URL}/shop/"
    return Task(
        id=task_id,
        env="browser",
        family="shop",
        seed=seed,
        split=split,
        instruction=f'Buy {quantity} of "{product}" in the shop at {url} and place the order.',
        setup={"site": {"shop": {"name": "Corner Shop", "products": products}}},
        checks=[_sql("SELECT product, quantity FROM order_items", [[product, quantity]])],
        solution=[
            ToolCall("goto", {"url": url}),
            ToolCall("click", {"id": 3 + target}),  # catalog: [1] Cart, [2] All products, then the products
            ToolCall("type", {"id": 3, "text": str(quantity)}),  # product page: [3] Quantity, [4] Add to cart
            ToolCall("click", {"id": 4}),
            ToolCall("click", {"id": 3}),  # cart: [3] Place order
            ToolCall("submit"),
        ],
    )


def booking_task(seed: int, split: str = "train") -> Task:
    rng, task_id = _start("booking", seed, split)
    first, n = _FIRST_DAY + timedelta(days=rng.randrange(_DAYS)), rng.randint(4, 7)
    days = ((first + timedelta(days=d)).isoformat() for d in range(_DAYS))
    dates = list(islice((d for d in days if split_of(d) == split), n))  # it takes bookings on its split's days
    times = sorted(rng.sample(_TIMES, rng.randint(3, 5)))
    (name,) = _names(rng, split, 1, words=2)
    day, time, party = rng.choice(dates), rng.choice(times), rng.randint(2, 8)
    url = f"{SITE_URL}/booking/"
    return Task(
        id=task_id,
        env="browser",
        family="booking",
        seed=seed,
        split=split,
        instruction=f"Book a table at {url} for {name} on {day} at {time}, party of {party}.",
        setup={"site": {"booking": {"name": "Harbor Kitchen", "dates": dates, "times": times}}},
        checks=[_sql("SELECT name, date, time, party_size FROM bookings", [[name, day, time, party]])],
        solution=_booking_solution(task_id, url, name, day, time, party),
    )


def _booking_solution(task_id: str, url: str, name: str, day: str, time: str, party: int) -> list[ToolCall]:
    """Fill the form and book; about half stumble first (environments/recovery.py): the time selected into the date
    field or the date into the time field, rejected with the field's options listed, then made right."""
    how = stumble(task_id, ("time_into_date", "date_into_time"))
    selects = [ToolCall("select", {"id": 2, "option": day}), ToolCall("select", {"id": 3, "option": time})]
    if how == "time_into_date":
        selects.insert(0, ToolCall("select", {"id": 2, "option": time}))
    elif how == "date_into_time":
        selects.insert(1, ToolCall("select", {"id": 3, "option": day}))
    return [
        ToolCall("goto", {"url": url}),
        ToolCall("type", {"id": 1, "text": name}),  # form: [1] Name, [2] Date, [3] Time, [4] Party size, [5] Book
        *selects,
        ToolCall("type", {"id": 4, "text": str(party)}),
        ToolCall("click", {"id": 5}),
        ToolCall("submit"),
    ]


def wiki_task(seed: int, split: str = "train") -> Task:
    rng, task_id = _start("wiki", seed, split)
    n = rng.randint(4, 6)
    names = _names(rng, split, n + 3)  # the towns and three rivers, no two alike
    towns, rivers = names[:n], names[n:]
    articles, facts = [], []
    for town in towns:
        # the answers are numbers of the task's split; the hall's year is the distractor
        founded, hall = _number(rng, split, 1150, 1850), rng.randint(1860, 1990)
        population, river = _number(rng, split, 1200, 98000), rng.choice(rivers)
        facts.append({"founded": str(founded), "population": str(population), "river": river})
        articles.append({"slug": _slug(town), "title": town, "paragraphs": [
            f"{town} is a town in the {rng.choice(_REGIONS)} region, on the river {river}.",
            f"It was founded in {founded}. The town hall was built in {hall}.",
            f"Today {town} has a population of {population}.",
            *_town_life(rng, town, river),
        ]})
    target = rng.randrange(len(towns))
    kind = rng.choice(["founded", "population", "river"])
    question = {
        "founded": f"the year {towns[target]} was founded",
        "population": f"the population of {towns[target]} (digits only)",
        "river": f"the river {towns[target]} is on",
    }[kind]
    answer = facts[target][kind]
    url = f"{SITE_URL}/wiki/"
    return Task(
        id=task_id,
        env="browser",
        family="wiki",
        seed=seed,
        split=split,
        instruction=f"Using the wiki at {url}, find {question} and send it with the wiki's answer form.",
        setup={"site": {"wiki": {"name": "Atlas Wiki", "articles": articles}}},
        checks=[_sql("SELECT answer FROM answers", [[answer]])],
        solution=[
            ToolCall("goto", {"url": url}),
            ToolCall("click", {"id": 3 + target}),  # index: [1] Wiki home, [2] Submit an answer, then the articles
            ToolCall("click", {"id": 2}),
            ToolCall("type", {"id": 3, "text": answer}),  # answer page: [3] Answer, [4] Submit answer
            ToolCall("click", {"id": 4}),
            ToolCall("submit"),
        ],
    )


def _town_life(rng: random.Random, town: str, river: str) -> list[str]:
    """Filler paragraphs with numbers of their own: the fact has to be read, not guessed from the only number, and
    an article is taller than the browser's window, so reaching its end takes scrolling."""
    lines = [
        f"The old bridge over the {river} was rebuilt in {rng.randint(1700, 1990)}.",
        f"A market is held in the main square every {rng.choice(['Monday', 'Wednesday', 'Friday', 'Saturday'])}.",
        f"The town school teaches {rng.randint(80, 900)} pupils.",
        f"The railway station opened in {rng.randint(1840, 1930)} and has {rng.randint(2, 6)} platforms.",
        f"The church tower of {town} is {rng.randint(20, 95)} metres tall.",
        f"Most people in {town} work in farming, trade or the {rng.choice(['mills', 'harbour', 'quarries'])}.",
        f"The town museum holds {rng.randint(300, 9000)} objects.",
        f"Every summer {town} holds a music festival on the banks of the {river}.",
    ]
    return rng.sample(lines, rng.randint(5, 8))


FAMILIES: dict[str, Callable[[int, str], Task]] = {
    "shop": shop_task,
    "booking": booking_task,
    "wiki": wiki_task,
}
