"""Write ``chat.jsonl``: short multi-turn conversations that a tiny model can learn on a CPU.

    python examples/data/make_chat_data.py            # rewrites examples/data/chat.jsonl

One conversation per line, ``{"messages": [{"role": ..., "content": ...}, ...]}``, roles ``system``
(some conversations), ``user`` and ``assistant``. Five kinds of task, each answered in a fixed
pattern: arithmetic (with follow-ups on the previous result), unit conversion, capital cities,
word reversal and counting letters. The same seed writes the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("chat.jsonl")
CONVERSATIONS = 600
SEED = 0

SYSTEM = ["You are a helpful assistant.", "Answer briefly.", "You are a concise assistant."]
CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Portugal": "Lisbon",
    "Greece": "Athens", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen", "Egypt": "Cairo", "Japan": "Tokyo",
    "China": "Beijing", "India": "New Delhi", "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago",
    "Canada": "Ottawa", "Mexico": "Mexico City", "Cuba": "Havana", "Turkey": "Ankara", "Russia": "Moscow",
    "Hungary": "Budapest", "Belgium": "Brussels", "Netherlands": "Amsterdam", "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
}  # fmt: skip
UNITS = [  # (from, to, factor, question word)
    ("km", "m", 1000, "meters"),
    ("m", "cm", 100, "centimeters"),
    ("kg", "g", 1000, "grams"),
    ("h", "min", 60, "minutes"),
    ("min", "s", 60, "seconds"),
]
WORDS = (
    "apple river stone cloud garden window bridge harbour candle forest mirror silver pocket lantern "
    "violin pepper tiger rabbit ladder button castle rocket planet winter summer yellow purple orange"
).split()


def arithmetic(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    op = rng.choice("+-*") if a <= 12 or b <= 12 else rng.choice("+-")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    messages = [
        {"role": "user", "content": f"What is {a} {op} {b}?"},
        {"role": "assistant", "content": f"{a} {op} {b} = {value}."},
    ]
    for _ in range(rng.randint(0, 2)):  # follow-ups on the previous result
        c = rng.randint(1, 20)
        op = rng.choice("+-")
        new = value + c if op == "+" else value - c
        verb = "Add" if op == "+" else "Subtract"
        word = "to" if op == "+" else "from"
        messages += [
            {"role": "user", "content": f"{verb} {c} {word} that."},
            {"role": "assistant", "content": f"{value} {op} {c} = {new}."},
        ]
        value = new
    return messages


def conversion(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    for _ in range(rng.randint(1, 2)):
        source, target, factor, word = rng.choice(UNITS)
        n = rng.randint(1, 12)
        messages += [
            {"role": "user", "content": f"How many {word} are in {n} {source}?"},
            {"role": "assistant", "content": f"{n} {source} = {n * factor} {target}."},
        ]
    return messages


def capital(rng: random.Random) -> list[dict[str, str]]:
    countries = rng.sample(sorted(CAPITALS), rng.randint(1, 3))
    messages = [
        {"role": "user", "content": f"What is the capital of {countries[0]}?"},
        {"role": "assistant", "content": f"The capital of {countries[0]} is {CAPITALS[countries[0]]}."},
    ]
    for country in countries[1:]:
        messages += [
            {"role": "user", "content": f"And of {country}?"},
            {"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."},
        ]
    return messages


def reversal(rng: random.Random) -> list[dict[str, str]]:
    word = rng.choice(WORDS)
    return [
        {"role": "user", "content": f"Reverse the word {word}."},
        {"role": "assistant", "content": f"{word} reversed is {word[::-1]}."},
    ]


def letters(rng: random.Random) -> list[dict[str, str]]:
    word = rng.choice(WORDS)
    return [
        {"role": "user", "content": f"How many letters are in {word}?"},
        {"role": "assistant", "content": f"{word} has {len(word)} letters."},
    ]


TASKS = (arithmetic, arithmetic, conversion, capital, capital, reversal, letters)


def conversations(n: int = CONVERSATIONS, seed: int = SEED) -> list[dict[str, list[dict[str, str]]]]:
    """``n`` conversations from ``seed``, always the same ones."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = rng.choice(TASKS)(rng)
        if rng.random() < 0.3:
            messages = [{"role": "system", "content": rng.choice(SYSTEM)}, *messages]
        out.append({"messages": messages})
    return out


def main() -> None:
    OUT.write_text("".join(json.dumps(c, ensure_ascii=True) + "\n" for c in conversations()))
    print(f"wrote {CONVERSATIONS} conversations to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
