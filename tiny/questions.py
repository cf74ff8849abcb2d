"""The tiny world's question types: a table of functions, one a type (`world.question_types` picks them).

    1hop     "Where was P born?"                       -> the city    (one search: "P born")
    2hop     "In which country was P born?"            -> the country (two searches in sequence: "P born",
                                                                        then "C country" for the city C it read)
    compare  "Were P and Q born in the same city?"     -> yes / no    (two independent searches: "P born",
                                                                        "Q born"; both can go in one parallel call)

A type is a function (question id, person, the split, its own random stream) -> one question record
about that person, and one line in QUESTION_TYPES. tiny/world.generate_world asks each person of a
split the world's types in order; each type draws from `stream(seed, "question_type", name)`, so a
type added to the table, or to a world, moves no other draw, and a world that keeps the default
(1hop, 2hop) keeps its key and its data byte for byte (tests/test_fork_worlds.py). The teachers
answer a type by its metadata.type (world.teacher_segments, teachers.next_turn).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.config import QUESTION_TYPES as TYPE_TABLE


def stream(seed: int | str, *names: object) -> random.Random:
    """A random stream of its own for one named feature (a question type, a teacher's draw): seeded by
    (seed, names) alone, so a draw added elsewhere never moves it.

    >>> stream(0, "question_type", "compare").random() == stream(0, "question_type", "compare").random()
    True
    """
    key = "|".join(str(x) for x in (seed, *names)).encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


@dataclass
class Split:
    """What a question type reads: the world's facts and the people of the split it asks about."""

    people: dict[str, str]  # person -> birth city
    city_country: dict[str, str]
    person_id: dict[str, str]  # person -> passage id
    city_id: dict[str, str]
    misinfo: set[str]  # people with a misinformation passage (world.misinfo_frac)
    persons: list[str]  # this split's people, in order

    born_in: dict[str, list[str]] = field(init=False)  # city -> this split's people born there

    def __post_init__(self) -> None:
        self.born_in = {}
        for p in self.persons:
            self.born_in.setdefault(self.people[p], []).append(p)

    def category(self, person: str) -> str | None:
        return "misinfo" if person in self.misinfo else None


def one_hop(qid: str, person: str, w: Split, rng: random.Random) -> dict:
    city = w.people[person]
    return question_record(qid, "1hop", person, city, city, [w.person_id[person]], w.category(person))


def two_hop(qid: str, person: str, w: Split, rng: random.Random) -> dict:
    city = w.people[person]  # gold: the passages that answer it, in hop order
    return question_record(qid, "2hop", person, city, w.city_country[city], [w.person_id[person], w.city_id[city]],
                     w.category(person))  # fmt: skip


def compare(qid: str, person: str, w: Split, rng: random.Random) -> dict:
    """"Were P and Q born in the same city?" -> yes / no. The two hops are independent (neither query needs
    the other's answer), so one parallel call can ask both. Q is of the same split; where anyone else
    there shares P's city, Q does half the time (else "no" would be right almost always)."""
    city = w.people[person]
    same = [p for p in w.born_in[city] if p != person]
    if same and rng.random() < 0.5:
        other = rng.choice(same)
    else:  # anyone of the split born elsewhere
        other = rng.choice(w.persons)
        while w.people[other] == city:
            other = rng.choice(w.persons)
    record = question_record(qid, "compare", person, city, "yes" if w.people[other] == city else "no",
                       [w.person_id[person], w.person_id[other]], w.category(person))  # fmt: skip
    record["question"] = f"Were {person} and {other} born in the same city?"
    record["metadata"] |= {"person2": other, "city2": w.people[other]}
    return record


# A question type: (id, person, the split, the type's own random stream) -> one question record about that
# person. world.question_types names the ones a world asks, in this order per person.
# The dict trainer/config.py checks world.question_types against.
QUESTION_TYPES: dict[str, Callable[[str, str, Split, random.Random], dict]] = TYPE_TABLE
QUESTION_TYPES |= {
    "1hop": one_hop,
    "2hop": two_hop,
    "compare": compare,
}


def question_record(qid: str, kind: str, person: str, city: str, answer: str, gold_ids: list[str],
              category: str | None = None) -> dict:  # fmt: skip
    text = f"Where was {person} born?" if kind == "1hop" else f"In which country was {person} born?"
    meta = {"type": kind, "person": person, "city": city, "gold_ids": gold_ids, "data_source": "tiny"}
    if category:  # "unanswerable" or "misinfo"; plain questions have none (their records are unchanged)
        meta["category"] = category
    return {"id": qid, "question": text, "golden_answers": [answer], "metadata": meta}
