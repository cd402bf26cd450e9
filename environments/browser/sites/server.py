"""The mock websites of the browser environment: a shop, a table booking form and a wiki, in one stdlib server.

Runs inside the sandbox as the ``site`` user: ``python3 server.py STATE_DIR PORT``. STATE_DIR (mode 0700, so the
policy's browser, running as ``sandbox``, can neither read nor write it) holds ``seed.json`` (the task's site content)
and ``site.db``, the server-side state verifiers read: ``orders``/``order_items``/``cart``, ``bookings``, ``answers``.
Each site lives under its own path (/shop/, /booking/, /wiki/); a site the task did not seed answers 404.

Pages are plain server-rendered HTML without scripts, so the element ids the browser driver assigns (document order of
interactive elements) are the same every time: task.solution can name them. Keep the order of links, inputs and
buttons in each page in step with the reference solutions in ``environments/browser/tasks.py``.
"""

from __future__ import annotations

import html
import json
import sqlite3
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

SCHEMA = """
CREATE TABLE IF NOT EXISTS cart (product TEXT PRIMARY KEY, quantity INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, total_cents INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS order_items (order_id INTEGER NOT NULL, product TEXT NOT NULL, quantity INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS bookings (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, date TEXT NOT NULL, time TEXT NOT NULL, party_size INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS answers (id INTEGER PRIMARY KEY, answer TEXT NOT NULL);
"""
MAX_QUANTITY = 99
MAX_PARTY = 12


class Reply(Exception):
    """Raised by a handler to answer at once: a page (status 200/400/404) or a redirect (303 + location)."""

    def __init__(self, status: int, body: str = "", location: str = ""):
        super().__init__(status)
        self.status, self.body, self.location = status, body, location


def page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;line-height:1.6;margin:2em;max-width:40em}</style></head>"
        f"<body>{body}</body></html>"
    )


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def money(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"


class Sites:
    """The seeded content plus the database; every method returns a page or raises Reply."""

    def __init__(self, state_dir: Path):
        self.seed = json.loads((state_dir / "seed.json").read_text())
        self.db_path = state_dir / "site.db"
        self.lock = threading.Lock()  # one writer at a time; the browser is the only client
        with self.connect() as db:
            db.executescript(SCHEMA)

    def connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.db_path, isolation_level=None)

    def site(self, name: str) -> dict:
        if name not in self.seed:
            raise Reply(404, page("Not found", f"<h1>Not found</h1><p>There is no {esc(name)} site here.</p>"))
        return self.seed[name]

    # --- shop ---------------------------------------------------------------------------------------------------

    def _shop_nav(self, db: sqlite3.Connection) -> str:
        count = db.execute("SELECT COALESCE(SUM(quantity), 0) FROM cart").fetchone()[0]
        return f"<nav><a href='/shop/cart'>Cart ({count})</a> <a href='/shop/'>All products</a></nav>"

    def shop(self, method: str, parts: list[str], form: dict[str, str]) -> str:
        shop = self.site("shop")
        products = {p["slug"]: p for p in shop["products"]}
        with self.lock, self.connect() as db:
            if method == "GET" and not parts:  # ids: [1] Cart, [2] All products, [3..] one link per product
                items = "".join(
                    f"<li><a href='/shop/product/{esc(p['slug'])}'>{esc(p['name'])}</a> {money(p['price_cents'])}</li>"
                    for p in shop["products"]
                )
                return page(shop["name"], f"<h1>{esc(shop['name'])}</h1>{self._shop_nav(db)}<h2>Products</h2>"
                                          f"<ul>{items}</ul>")
            if method == "GET" and len(parts) == 2 and parts[0] == "product":  # [3] Quantity, [4] Add to cart
                p = products.get(parts[1])
                if p is None:
                    raise Reply(404, page("Not found", "<h1>No such product</h1><a href='/shop/'>All products</a>"))
                return page(p["name"], (
                    f"<h1>{esc(shop['name'])}</h1>{self._shop_nav(db)}<h2>{esc(p['name'])}</h2>"
                    f"<p>{esc(p['description'])}</p><p>Price: {money(p['price_cents'])}</p>"
                    "<form method='post' action='/shop/cart'>"
                    f"<input type='hidden' name='product' value='{esc(p['slug'])}'>"
                    "<label for='quantity'>Quantity</label>"
                    " <input id='quantity' type='number' name='quantity' value='1'"
                    f" min='1' max='{MAX_QUANTITY}'> <button type='submit'>Add to cart</button></form>"
                ))
            if parts == ["cart"] and method == "POST":
                p = products.get(form.get("product", ""))
                quantity = _int(form.get("quantity", ""))
                if p is None or quantity is None or not 1 <= quantity <= MAX_QUANTITY:
                    raise Reply(400, page("Error", f"<h1>Cannot add that</h1><p>Quantity must be a whole number from 1 "
                                                   f"to {MAX_QUANTITY}.</p><a href='/shop/'>All products</a>"))
                db.execute("INSERT INTO cart VALUES (?, ?) ON CONFLICT(product) DO UPDATE SET quantity = quantity + ?",
                           (p["name"], quantity, quantity))
                raise Reply(303, location="/shop/cart")
            if parts == ["cart"]:  # ids: [3] Place order, [4] Empty cart (only with items)
                rows = db.execute("SELECT product, quantity FROM cart ORDER BY product").fetchall()
                if not rows:
                    body = "<p>Your cart is empty.</p>"
                else:
                    prices = {p["name"]: p["price_cents"] for p in shop["products"]}
                    lines = "".join(f"<tr><td>{esc(n)}</td><td>{q}</td><td>{money(prices[n] * q)}</td></tr>"
                                    for n, q in rows)
                    total = sum(prices[n] * q for n, q in rows)
                    body = (f"<table><tr><th>Product</th><th>Quantity</th><th>Price</th></tr>{lines}</table>"
                            f"<p>Total: {money(total)}</p>"
                            "<form method='post' action='/shop/checkout'>"
                            "<button type='submit'>Place order</button></form>"
                            "<form method='post' action='/shop/empty'><button type='submit'>Empty cart</button></form>")
                return page("Cart", f"<h1>{esc(shop['name'])}</h1>{self._shop_nav(db)}<h2>Cart</h2>{body}")
            if parts == ["empty"] and method == "POST":
                db.execute("DELETE FROM cart")
                raise Reply(303, location="/shop/cart")
            if parts == ["checkout"] and method == "POST":
                rows = db.execute("SELECT product, quantity FROM cart ORDER BY product").fetchall()
                if not rows:
                    raise Reply(400, page("Error", "<h1>Your cart is empty</h1><a href='/shop/'>All products</a>"))
                prices = {p["name"]: p["price_cents"] for p in shop["products"]}
                db.execute("BEGIN")
                order = db.execute("INSERT INTO orders (total_cents) VALUES (?)",
                                   (sum(prices[n] * q for n, q in rows),)).lastrowid
                db.executemany("INSERT INTO order_items VALUES (?, ?, ?)", [(order, n, q) for n, q in rows])
                db.execute("DELETE FROM cart")
                db.execute("COMMIT")
                raise Reply(303, location=f"/shop/order/{order}")
            if method == "GET" and len(parts) == 2 and parts[0] == "order":
                items = db.execute("SELECT product, quantity FROM order_items WHERE order_id = ?",
                                   (_int(parts[1]),)).fetchall()
                if not items:
                    raise Reply(404, page("Not found", "<h1>No such order</h1>"))
                lines = "".join(f"<li>{q} x {esc(n)}</li>" for n, q in items)
                return page("Order placed", f"<h1>{esc(shop['name'])}</h1>{self._shop_nav(db)}"
                                            f"<h2>Thank you! Order {esc(parts[1])} is placed.</h2><ul>{lines}</ul>")
        raise Reply(404, page("Not found", "<h1>Not found</h1><a href='/shop/'>All products</a>"))

    # --- booking ------------------------------------------------------------------------------------------------

    def booking(self, method: str, parts: list[str], form: dict[str, str]) -> str:
        site = self.site("booking")
        if method == "GET" and not parts:  # ids: [1] Name, [2] Date, [3] Time, [4] Party size, [5] Book table
            dates = "".join(f"<option value='{esc(d)}'>{esc(d)}</option>" for d in site["dates"])
            times = "".join(f"<option value='{esc(t)}'>{esc(t)}</option>" for t in site["times"])
            return page(site["name"], (
                f"<h1>{esc(site['name'])}</h1><p>Book a table. We confirm at once.</p>"
                "<form method='post' action='/booking/book'>"
                "<p><label for='name'>Name</label> <input id='name' name='name'></p>"
                f"<p><label for='date'>Date</label> <select id='date' name='date'>"
                f"<option value=''>Choose a date</option>{dates}</select></p>"
                f"<p><label for='time'>Time</label> <select id='time' name='time'>"
                f"<option value=''>Choose a time</option>{times}</select></p>"
                f"<p><label for='party'>Party size</label> <input id='party' type='number' name='party_size' value='2'"
                f" min='1' max='{MAX_PARTY}'></p>"
                "<p><button type='submit'>Book table</button></p></form>"
            ))
        if method == "POST" and parts == ["book"]:
            name = " ".join(form.get("name", "").split())
            party = _int(form.get("party_size", ""))
            problems = []
            if not name:
                problems.append("enter a name")
            if form.get("date") not in site["dates"]:
                problems.append("choose a date")
            if form.get("time") not in site["times"]:
                problems.append("choose a time")
            if party is None or not 1 <= party <= MAX_PARTY:
                problems.append(f"party size must be 1 to {MAX_PARTY}")
            if problems:
                raise Reply(400, page("Error", f"<h1>Booking not made</h1><p>Please {esc('; '.join(problems))}.</p>"
                                               "<a href='/booking/'>Back to the form</a>"))
            with self.lock, self.connect() as db:
                booking = db.execute("INSERT INTO bookings (name, date, time, party_size) VALUES (?, ?, ?, ?)",
                                     (name, form["date"], form["time"], party)).lastrowid
            raise Reply(303, location=f"/booking/confirmation/{booking}")
        if method == "GET" and len(parts) == 2 and parts[0] == "confirmation":
            with self.lock, self.connect() as db:
                row = db.execute("SELECT name, date, time, party_size FROM bookings WHERE id = ?",
                                 (_int(parts[1]),)).fetchone()
            if row is None:
                raise Reply(404, page("Not found", "<h1>No such booking</h1>"))
            return page("Booked", f"<h1>{esc(site['name'])}</h1><h2>Booked!</h2>"
                                  f"<p>A table for {row[3]} on {esc(row[1])}"
                                  f" at {esc(row[2])}, under the name {esc(row[0])}.</p>"
                                  "<a href='/booking/'>Make another booking</a>")
        raise Reply(404, page("Not found", "<h1>Not found</h1><a href='/booking/'>Book a table</a>"))

    # --- wiki ---------------------------------------------------------------------------------------------------

    def wiki(self, method: str, parts: list[str], form: dict[str, str]) -> str:
        wiki = self.site("wiki")
        articles = {a["slug"]: a for a in wiki["articles"]}
        nav = "<nav><a href='/wiki/'>Wiki home</a> <a href='/wiki/answer'>Submit an answer</a></nav>"
        if method == "GET" and not parts:  # ids: [1] Wiki home, [2] Submit an answer, [3..] one link per article
            items = "".join(f"<li><a href='/wiki/article/{esc(a['slug'])}'>{esc(a['title'])}</a></li>"
                            for a in wiki["articles"])
            return page(wiki["name"], f"<h1>{esc(wiki['name'])}</h1>{nav}<h2>Articles</h2><ul>{items}</ul>")
        if method == "GET" and len(parts) == 2 and parts[0] == "article":
            a = articles.get(parts[1])
            if a is None:
                raise Reply(404, page("Not found", f"<h1>No such article</h1>{nav}"))
            paragraphs = "".join(f"<p>{esc(p)}</p>" for p in a["paragraphs"])
            return page(a["title"], f"<h1>{esc(wiki['name'])}</h1>{nav}<h2>{esc(a['title'])}</h2>{paragraphs}")
        if method == "GET" and parts == ["answer"]:  # ids: [3] Answer, [4] Submit answer
            return page("Submit an answer", (
                f"<h1>{esc(wiki['name'])}</h1>{nav}<h2>Submit an answer</h2>"
                "<form method='post' action='/wiki/answer'><label for='answer'>Answer</label> "
                "<input id='answer' name='answer'> <button type='submit'>Submit answer</button></form>"
            ))
        if method == "POST" and parts == ["answer"]:
            answer = form.get("answer", "").strip()
            if not answer:
                raise Reply(400, page("Error", f"<h1>Empty answer</h1>{nav}<p>Type an answer first.</p>"))
            with self.lock, self.connect() as db:
                db.execute("INSERT INTO answers (answer) VALUES (?)", (answer,))
            raise Reply(303, location="/wiki/answer/thanks")  # a reload or back() never sends it twice
        if method == "GET" and parts == ["answer", "thanks"]:
            return page("Thanks", f"<h1>{esc(wiki['name'])}</h1>{nav}<h2>Thank you</h2><p>Your answer is recorded.</p>")
        raise Reply(404, page("Not found", f"<h1>Not found</h1>{nav}"))


def _int(text: str) -> int | None:
    try:
        return int(text.strip())
    except (ValueError, AttributeError):
        return None


class Handler(BaseHTTPRequestHandler):
    sites: Sites  # set by serve()
    protocol_version = "HTTP/1.0"  # one request per connection: nothing to keep alive in a single-user mock

    def do_GET(self) -> None:
        self._answer("GET", {})

    def do_POST(self) -> None:
        length = min(int(self.headers.get("Content-Length") or 0), 1 << 16)
        body = self.rfile.read(length).decode(errors="replace")
        self._answer("POST", {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()})

    def _answer(self, method: str, form: dict[str, str]) -> None:
        path = urlsplit(self.path).path
        parts = [p for p in path.split("/") if p]
        try:
            if not parts:
                links = "".join(f"<li><a href='/{name}/'>{name}</a></li>" for name in self.sites.seed)
                raise Reply(200, page("Sites", f"<h1>Sites</h1><ul>{links}</ul>"))
            handler = {"shop": self.sites.shop, "booking": self.sites.booking, "wiki": self.sites.wiki}.get(parts[0])
            if handler is None:
                raise Reply(404, page("Not found", "<h1>Not found</h1><a href='/'>All sites</a>"))
            if path in (f"/{parts[0]}", ) and method == "GET":
                raise Reply(303, location=f"/{parts[0]}/")
            raise Reply(200, handler(method, parts[1:], form))
        except Reply as r:
            self.send_response(r.status)
            if r.location:
                self.send_header("Location", r.location)
            data = r.body.encode()
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        sys.stderr.write(f"{self.command} {self.path} -> {args[1] if len(args) > 1 else ''}\n")


def serve(state_dir: Path, port: int) -> None:
    Handler.sites = Sites(state_dir)
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"sites: serving {', '.join(Handler.sites.seed)} on http://127.0.0.1:{port}/", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: server.py STATE_DIR PORT")
    serve(Path(sys.argv[1]), int(sys.argv[2]))
