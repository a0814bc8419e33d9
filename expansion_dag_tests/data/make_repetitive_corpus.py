"""A seeded corpus of legitimate answers with heavy repetition, and of looping answers.

The loop detector (``expansion_dag.servers.loops.degeneration``) must never stop the first and
must stop every one of the second early. The legitimate answers repeat a shape the way real answers do:

- ``table``: markdown tables (multiplication tables, timetables full of "Off" and "-", feature
  matrices of check marks, sparse tables with empty cells);
- ``list``: numbered procedures, checklists, nested bullet lists from a small vocabulary;
- ``code``: unit tests of one function, SQL inserts, HTML lists, C defines, YAML blocks, switch
  statements, and short runs of identical lines (``pass``, separators, ``x += 1``);
- ``arithmetic``: long additions, repeated subtraction, Collatz sequences, compound interest year by
  year, factorials, Fibonacci, long division, counting;
- ``derivation``: worked arithmetic of several thousand tokens whose lines share a shape while
  their numbers change without counting: running sums, long multiplication digit by digit,
  recurrences, tables of values, amortization schedules (as tables and as sentences), conversion
  to another base by repeated division;
- ``reasoning``: thinking that checks case after case with the same sentence frame;
- ``lyrics``: songs whose chorus is sung two or three times back to back.

The looping answers start like a legitimate answer and then repeat one span (a sentence, a
paragraph of thinking, a line of code, a table row, a phrase, a newline) until a cap.

Run ``python -m expansion_dag_tests.data.make_repetitive_corpus`` to rebuild the file beside it
(``repetitive_answers.jsonl.gz``, which the tests read through ``expansion_dag_tests.helpers``); a
test checks that the file is what this module generates.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

SEED = 14
#: Answers per kind of legitimate repetition.
PER_KIND = 400
CORPUS_PATH = Path(__file__).with_name("repetitive_answers.jsonl.gz")

_WORDS = (
    "apple river stone cloud garden window market engine paper signal forest bridge harbor lamp "
    "copper meadow orbit pencil quartz rocket silver tunnel velvet wagon yellow zebra anchor "
    "basket candle dragon falcon glacier hammer island jacket kettle ladder mirror needle"
).split()
_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Niaj Olivia Peggy Rupert Sybil".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()


def _table(rng: random.Random) -> str:
    style = rng.randrange(4)
    if style == 0:
        n, m = rng.randint(10, 30), rng.randint(6, 12)
        head = "| x | " + " | ".join(str(j) for j in range(1, m + 1)) + " |"
        rule = "|" + "---|" * (m + 1)
        rows = [f"| {i} | " + " | ".join(str(i * j) for j in range(1, m + 1)) + " |" for i in range(1, n + 1)]
        return f"Here is the multiplication table up to {n} x {m}:\n\n" + "\n".join([head, rule, *rows])
    if style == 1:
        people = rng.sample(_NAMES, rng.randint(4, 10))
        weeks = rng.randint(2, 6)
        lines = ["| Week | Day | " + " | ".join(people) + " |", "|" + "---|" * (len(people) + 2)]
        for w in range(1, weeks + 1):
            for d in _DAYS:
                cells = [rng.choice(["Off", "Off", "Off", "-", "Early", "Late"]) for _ in people]
                lines.append(f"| {w} | {d} | " + " | ".join(cells) + " |")
        return "The rota:\n\n" + "\n".join(lines) + "\n\nEveryone gets at least one day off per week."
    if style == 2:
        features = rng.sample(_WORDS, rng.randint(12, 30))
        products = [f"Plan {c}" for c in "ABCDEF"[: rng.randint(3, 6)]]
        lines = ["| Feature | " + " | ".join(products) + " |", "|" + "---|" * (len(products) + 1)]
        for f in features:
            cells = [rng.choice(["✓", "✓", "✓", "✗"]) for _ in products]
            lines.append(f"| {f.capitalize()} support | " + " | ".join(cells) + " |")
        return "Comparison of the plans:\n\n" + "\n".join(lines)
    n = rng.randint(20, 60)
    lines = ["| ID | Name | Notes | Score |", "|---|---|---|---|"]
    for i in range(1, n + 1):
        notes = rng.choice(["", "", "", "late", "n/a"])
        score = rng.choice(["", "", str(rng.randint(50, 100))])
        lines.append(f"| {1000 + i} | {rng.choice(_NAMES)} | {notes} | {score} |")
    return "The filled-in sheet (empty cells were left blank):\n\n" + "\n".join(lines)


def _list(rng: random.Random) -> str:
    style = rng.randrange(3)
    n = rng.randint(15, 60)
    if style == 0:
        verb = rng.choice(["Check", "Tighten", "Inspect", "Clean", "Label"])
        items = [f"{i}. {verb} the {rng.choice(_WORDS)} and the {rng.choice(_WORDS)}." for i in range(1, n + 1)]
        return f"Follow these {n} steps in order:\n\n" + "\n".join(items)
    if style == 1:
        items = [f"- [ ] Review {rng.choice(_WORDS)} item {i}" for i in range(1, n + 1)]
        return "Checklist:\n\n" + "\n".join(items)
    out = ["Packing list by day:\n"]
    for d in _DAYS[: rng.randint(3, 7)]:
        out.append(f"- {d}")
        out.extend(f"  - {rng.choice(['1 x', '2 x'])} {w}" for w in rng.sample(_WORDS, rng.randint(3, 8)))
    return "\n".join(out)


def _code(rng: random.Random) -> str:
    style = rng.randrange(7)
    n = rng.randint(10, 50)
    if style == 0:
        f = rng.choice(["square", "double", "negate"])
        op, value = {"square": ("x * x", lambda x: x * x), "double": ("2 * x", lambda x: 2 * x), "negate": ("-x", lambda x: -x)}[f]
        tests = "\n".join(f"    assert {f}({i}) == {value(i)}" for i in range(n))
        return f"```python\ndef {f}(x):\n    return {op}\n\n\ndef test_{f}():\n{tests}\n```"
    if style == 1:
        rows = "\n".join(
            f"INSERT INTO items (id, name, qty) VALUES ({i}, '{rng.choice(_WORDS)}', {rng.randint(0, 9)});"
            for i in range(1, n + 1)
        )
        return f"```sql\n{rows}\n```"
    if style == 2:
        lis = "\n".join(f"  <li>{rng.choice(_WORDS).capitalize()}</li>" for _ in range(n))
        return f"```html\n<ul>\n{lis}\n</ul>\n```"
    if style == 3:
        defs = "\n".join(f"#define REG_{w.upper()}_{i} 0x{i * 4:04X}" for i, w in enumerate(rng.choices(_WORDS, k=n)))
        return f"```c\n{defs}\n```"
    if style == 4:
        blocks = "\n".join(
            f"  - name: {w}\n    replicas: {rng.randint(1, 3)}\n    image: registry/{w}:latest\n    restart: always"
            for w in rng.sample(_WORDS, min(n, len(_WORDS)))
        )
        return f"```yaml\nservices:\n{blocks}\n```"
    if style == 5:
        cases = "\n".join(f"    case {i}:\n        return \"{rng.choice(_WORDS)}\";" for i in range(n))
        return f"```java\nswitch (code) {{\n{cases}\n    default:\n        return \"unknown\";\n}}\n```"
    repeated = rng.choice(["    pass", "x += 1", 'print("-" * 40)', "    time.sleep(0.1)", "// TODO"])
    run = "\n".join([repeated] * rng.randint(2, 5))
    return f"```python\nfor step in range({n}):\n{run}\nprint('done')\n```"


def _arithmetic(rng: random.Random) -> str:
    style = rng.randrange(8)
    if style == 0:
        nums = [rng.randint(10, 999) for _ in range(rng.randint(20, 60))]
        total, lines = 0, []
        for x in nums:
            lines.append(f"{total} + {x} = {total + x}")
            total += x
        return "Adding them one at a time:\n\n" + "\n".join(lines) + f"\n\nThe sum is {total}."
    if style == 1:
        start, step = rng.randint(200, 900), rng.randint(3, 9)
        lines, x = [], start
        while x - step >= 0:
            lines.append(f"{x} - {step} = {x - step}")
            x -= step
        return f"Subtracting {step} repeatedly from {start}:\n\n" + "\n".join(lines) + f"\n\nRemainder: {x}."
    if style == 2:
        x = rng.randint(27, 9999)
        lines = []
        while x != 1:
            nxt = x // 2 if x % 2 == 0 else 3 * x + 1
            lines.append(f"{x} is {'even' if x % 2 == 0 else 'odd'}, so the next term is {nxt}.")
            x = nxt
        return "The Collatz sequence:\n\n" + "\n".join(lines) + "\n\nIt reaches 1."
    if style == 3:
        balance, rate = rng.randint(1000, 9000), rng.choice([3, 4, 5, 7])
        lines = []
        for year in range(1, rng.randint(15, 40)):
            interest = round(balance * rate / 100, 2)
            lines.append(f"Year {year}: {balance:.2f} x {rate}% = {interest:.2f} interest, balance {balance + interest:.2f}")
            balance = round(balance + interest, 2)
        return "\n".join(lines)
    if style == 4:
        acc, lines = 1, []
        for i in range(1, rng.randint(15, 30)):
            lines.append(f"{i}! = {acc} x {i} = {acc * i}")
            acc *= i
        return "\n".join(lines)
    if style == 5:
        a, b, lines = 0, 1, []
        for i in range(2, rng.randint(20, 60)):
            lines.append(f"F({i}) = F({i - 1}) + F({i - 2}) = {b} + {a} = {a + b}")
            a, b = b, a + b
        return "\n".join(lines)
    if style == 6:
        dividend, divisor = rng.randint(10**12, 10**18), rng.randint(3, 97)
        lines, rem = [], 0
        for digit in str(dividend):
            cur = rem * 10 + int(digit)
            lines.append(f"Bring down {digit}: {cur} ÷ {divisor} = {cur // divisor} remainder {cur % divisor}")
            rem = cur % divisor
        return "Long division:\n\n" + "\n".join(lines) + f"\n\nQuotient {dividend // divisor}, remainder {rem}."
    n = rng.randint(100, 400)
    return "Counting: " + ", ".join(str(i) for i in range(1, n + 1)) + "."


def _derivation(rng: random.Random) -> str:
    style = rng.randrange(6)
    if style == 0:
        total, lines = rng.randint(0, 999), []
        frame = rng.choice(["{t} + {x} = {s}", "Adding {x}: {t} + {x} = {s}", "Step {k}: {t} + {x} = {s}.", "{t} + {x} = {s}, carried forward."])
        for k in range(1, rng.randint(250, 700)):
            x = rng.randint(1, 9999)
            lines.append(frame.format(k=k, t=total, x=x, s=total + x))
            total += x
        return "Adding the numbers one by one:\n\n" + "\n".join(lines) + f"\n\nThe total is {total}."
    if style == 1:
        a, b = rng.randint(10**14, 10**22), rng.randint(10**8, 10**14)
        lines = [f"Multiply {a} by {b}, one digit of {b} at a time, from the right."]
        for place, digit in enumerate(reversed(str(b))):
            d, carry, digits = int(digit), 0, []
            lines.append(f"\nDigit {d} (times 10^{place}):")
            for x in reversed(str(a)):
                p = int(x) * d
                lines.append(f"{x} × {d} = {p}, plus carry {carry} makes {p + carry}: write {(p + carry) % 10}, carry {(p + carry) // 10}.")
                carry = (p + carry) // 10
            lines.append(f"Partial product: {a * d}, shifted: {a * d * 10**place}.")
        return "\n".join(lines) + f"\n\nAdding the partial products gives {a * b}."
    if style == 2:
        # A full period (Hull-Dobell: mult - 1 divisible by 4 and 5, inc prime to 10): no value comes twice.
        m, mult, inc = rng.choice([1000, 65536]), 20 * rng.randint(1, 60) + 1, 10 * rng.randint(0, 1234) + rng.choice([1, 3, 7, 9])
        x, lines = rng.randint(1, m - 1), []
        for n in range(1, rng.randint(200, 500)):
            nxt = (mult * x + inc) % m
            lines.append(f"x({n}) = ({mult} × {x} + {inc}) mod {m} = {mult * x + inc} mod {m} = {nxt}")
            x = nxt
        return "Iterating the recurrence:\n\n" + "\n".join(lines)
    if style == 3:
        c2, c1, c0 = rng.randint(1, 9), rng.randint(1, 20), rng.randint(1, 99)
        step, x0 = rng.choice([0.1, 0.25, 0.5, 1]), rng.randint(-20, 0)
        lines = [f"A table of values of f(x) = {c2}x^2 - {c1}x + {c0}:", "", "| x | f(x) |", "|---|---|"]
        for i in range(rng.randint(200, 500)):
            x = round(x0 + i * step, 2)
            w = f"{x:g}" if x >= 0 else f"({x:g})"
            lines.append(f"| {x:g} | {c2} × {w}^2 - {c1} × {w} + {c0} = {c2 * x * x - c1 * x + c0:.4f} |")
        return "\n".join(lines)
    if style == 4:
        balance, rate, months = rng.randint(5000, 90000), rng.choice([0.25, 0.4, 0.5, 0.75]), rng.choice([120, 180, 240, 360])
        payment = round(balance * (rate / 100) / (1 - (1 + rate / 100) ** -months), 2)
        table = rng.random() < 0.5
        lines = [f"Loan {balance}.00 at {rate}% a month over {months} months: payment {payment:.2f}.", ""]
        if table:
            lines += ["| Month | Interest | Principal | Balance |", "|---|---|---|---|"]
        for m in range(1, months + 1):
            interest = round(balance * rate / 100, 2)
            principal = round(min(payment - interest, balance), 2)
            new = round(balance - principal, 2)
            if table:
                lines.append(f"| {m} | {interest:.2f} | {principal:.2f} | {new:.2f} |")
            else:
                lines.append(f"Month {m}: interest {balance:.2f} × {rate}% = {interest:.2f}, principal {payment:.2f} - {interest:.2f} = {principal:.2f}, balance {new:.2f}.")
            balance = new
        return "\n".join(lines)
    x, lines = rng.randint(10**40, 10**60), []
    base = rng.choice([2, 3, 7, 16])
    while x:
        lines.append(f"{x} ÷ {base} = {x // base} remainder {x % base}")
        x //= base
    return f"Converting to base {base} by repeated division:\n\n" + "\n".join(lines) + "\n\nReading the remainders from the bottom up gives the digits."


def _reasoning(rng: random.Random) -> str:
    target = rng.randint(50, 500)
    lines = [f"We need a pair that sums to {target}. Let me check each candidate."]
    for _ in range(rng.randint(20, 60)):
        a, b = rng.randint(1, target), rng.randint(1, target)
        verdict = "That works." if a + b == target else "No, that is not it."
        lines.append(f"Let me check {a} + {b}: {a} + {b} = {a + b}. {verdict}")
    lines.append(f"So one pair is {target // 2} and {target - target // 2}.")
    return "\n".join(lines)


def _lyrics(rng: random.Random) -> str:
    chorus = "\n".join(
        f"Oh the {rng.choice(_WORDS)}, the {rng.choice(_WORDS)}, carry me home" for _ in range(rng.randint(2, 4))
    )
    verses = []
    for v in range(rng.randint(2, 4)):
        verse = "\n".join(f"I walked past the {rng.choice(_WORDS)} by the {rng.choice(_WORDS)}" for _ in range(4))
        verses.append(f"[Verse {v + 1}]\n{verse}\n\n[Chorus]\n" + "\n".join([chorus] * rng.randint(2, 3)))
    return "\n\n".join(verses)


KINDS: dict[str, Callable[[random.Random], str]] = {
    "table": _table,
    "list": _list,
    "code": _code,
    "arithmetic": _arithmetic,
    "reasoning": _reasoning,
    "lyrics": _lyrics,
    "derivation": _derivation,
}


def legitimate_answers(seed: int = SEED, per_kind: int = PER_KIND) -> Iterator[dict[str, str]]:
    """``per_kind`` answers of each kind: ``{"id", "kind", "text"}``."""
    rng = random.Random(seed)
    for kind, make in KINDS.items():
        for i in range(per_kind):
            yield {"id": f"{kind}-{i:04d}", "kind": kind, "text": make(rng)}


_LOOP_SPANS = (
    "Wait, let me reconsider the problem from the start. ",
    "So the answer is 42. But let me double-check that.\n",
    "Hmm, I think I made an error. Let me recompute the sum: 3 + 4 = 7, and 7 + 5 = 12.\n\n",
    "    result = compute(result)\n",
    "| 0 | 0 | 0 | 0 |\n",
    "the the ",
    "\n",
    "Therefore, we can conclude that the function is increasing on the interval. However, we need to "
    "verify this claim carefully by examining the derivative at each point of the interval, which "
    "requires us to revisit the earlier computation of the derivative and to make sure that every "
    "step is correct before we move on to the next part of the problem.\n\n",
)


def looping_answers(seed: int = SEED, count: int = 240, cap_chars: int = 32000) -> Iterator[dict[str, object]]:
    """Answers that start like a legitimate one and then repeat one span until ``cap_chars``.

    ``loop_starts_at`` is where the repetition begins, so a test can say how early it was stopped.
    """
    rng = random.Random(seed + 1)
    makers = list(KINDS.values())
    for i in range(count):
        prefix = rng.choice(makers)(rng)[: rng.randint(0, 3000)] + "\n"
        span = _LOOP_SPANS[i % len(_LOOP_SPANS)]
        repeats = (cap_chars - len(prefix)) // len(span) + 1
        yield {
            "id": f"loop-{i:04d}",
            "kind": "loop",
            "text": (prefix + span * repeats)[:cap_chars],
            "loop_starts_at": len(prefix),
        }


def corpus_bytes(seed: int = SEED, per_kind: int = PER_KIND) -> bytes:
    """The gzipped JSONL of :func:`legitimate_answers`, byte for byte reproducible (mtime 0)."""
    raw = "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in legitimate_answers(seed, per_kind))
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(raw.encode())
    return buffer.getvalue()


def main() -> None:
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    data = corpus_bytes()
    CORPUS_PATH.write_bytes(data)
    print(f"wrote {CORPUS_PATH} ({len(data):,} bytes, {PER_KIND * len(KINDS):,} answers)", file=sys.stderr)


if __name__ == "__main__":
    main()
