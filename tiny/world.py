"""The embedded tiny world: a made-up encyclopedia, its questions and a scripted teacher.

docs/design.md §5. Everything is invented (people, cities, countries), so no model can answer from
memory: searching is necessary, which makes the effect of RL visible on a laptop.

    world = generate_world(WorldConfig(seed=0))
    world.corpus[0]    # {"id": "p0", "contents": '"Tavi Morek"\\nTavi Morek was born in the
                       #  city of Velor.', "url": "https://tinypedia.org/wiki/Tavi_Morek", ...}
    world.corpus[-1]   # a contradicting passage on an unreliable domain (config unreliable_frac):
                       # {"id": "u120", "contents": '"Noke"\\nSome say Noke is a city in the
                       #  country of Topus.', "domain": "rumormill.net", ...}
    world.questions["val"][0]
                       # {"id": "val-1hop-0", "question": "Where was Tavi Morek born?",
                       #  "golden_answers": ["Velor"], "metadata": {"type": "1hop",
                       #  "gold_ids": ["p17"], ...}}

Question types (`world.question_types`; tiny/questions.py, one function and one line each):
  1hop     "Where was P born?"                    -> the city    (one search: "P born")
  2hop     "In which country was P born?"         -> the country (two searches in sequence: "P born", "C country")
  compare  "Were P and Q born in the same city?"  -> yes / no    (two independent searches: "P born", "Q born")

The teacher (`teacher_segments`) writes Search-R1-format trajectories and is deliberately
imperfect (docs/design.md §5): on a 2-hop question it often guesses the country after the first hop,
and it sometimes answers without searching. RL has to discover that the second search pays.

The questions of each split are about disjoint sets of people, so validation and test ask
about entities the SFT data never asked about (their passages are in the corpus, as always).

Build the world, tokenizer and SFT warm start (cached under cache/): `python -m tiny.sft
--config configs/tiny.yaml`; train.py does this for you when the cache is missing.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from tiny.questions import QUESTION_TYPES, Split, question_record, stream
from trainer.config import Config, WorldConfig, check_question_types
from trainer.precision import resolve as resolve_precision

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


@dataclass
class World:
    corpus: list[dict]
    questions: dict[str, list[dict]]  # split -> FlashRAG records
    people: dict[str, str] = field(default_factory=dict)  # person -> birth city
    city_country: dict[str, str] = field(default_factory=dict)
    countries: list[str] = field(default_factory=list)


def _names(rng: random.Random, n: int, syllables: tuple[int, int], taken: set[str]) -> list[str]:
    """n unique pronounceable names like 'Velor' that are not in `taken` (which is updated)."""
    out = []
    while len(out) < n:
        k = rng.randint(*syllables)
        name = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(k))
        name = name + rng.choice(CONSONANTS) if rng.random() < 0.5 else name
        name = name.capitalize()
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


RELIABLE_DOMAIN = "tinypedia.org"
UNRELIABLE_DOMAINS = ("rumormill.net", "gossipwiki.com", "fastfacts.biz")


def _passage(pid: str, title: str, text: str, rng: random.Random, domain: str = RELIABLE_DOMAIN) -> dict:
    slug = title.replace(" ", "_")
    year = rng.randint(2005, 2024)
    path = "wiki/" if domain == RELIABLE_DOMAIN else ""
    return {
        "id": pid,
        "contents": f'"{title}"\n{text}',
        "url": f"https://{domain}/{path}{slug}",
        "domain": domain,
        "date": f"{year}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
    }


def _unreliable_passages(cfg: WorldConfig, people: dict[str, str], city_country: dict[str, str]) -> list[dict]:
    """Contradicting passages on unreliable domains: "Some say P was born in the city of X."

    A separate rng, so the reliable world and the questions do not depend on unreliable_frac.
    The extra words make these passages longer, so BM25 ranks the reliable one first on an
    exact query; with top-3 both show up, and only the source tells them apart.
    """
    rng = random.Random(cfg.seed + 7919)
    cities, countries = list(city_country), sorted(set(city_country.values()))
    out = []
    for person in rng.sample(list(people), round(cfg.unreliable_frac * len(people))):
        wrong = rng.choice([c for c in cities if c != people[person]])
        text = f"Some say {person} was born in the city of {wrong}."
        out.append(_passage(f"u{len(out)}", person, text, rng, rng.choice(UNRELIABLE_DOMAINS)))
    for city in rng.sample(cities, round(cfg.unreliable_frac * len(cities))):
        wrong = rng.choice([k for k in countries if k != city_country[city]] or countries)
        text = f"Some say {city} is a city in the country of {wrong}."
        out.append(_passage(f"u{len(out)}", city, text, rng, rng.choice(UNRELIABLE_DOMAINS)))
    return out


def generate_world(cfg: WorldConfig) -> World:
    """A seeded encyclopedia: the same config gives the same world, byte for byte."""
    check_question_types(cfg.question_types)
    rng = random.Random(cfg.seed)
    taken: set[str] = set()
    countries = _names(rng, cfg.n_countries, (2, 3), taken)
    cities = _names(rng, cfg.n_cities, (2, 3), taken)
    first = _names(rng, max(50, cfg.n_people // 20), (1, 2), taken)
    last = _names(rng, max(100, cfg.n_people // 10), (2, 3), taken)
    city_country = {c: rng.choice(countries) for c in cities}
    people: dict[str, str] = {}
    while len(people) < cfg.n_people:
        person = f"{rng.choice(first)} {rng.choice(last)}"
        people.setdefault(person, rng.choice(cities))

    corpus = []
    for i, (person, city) in enumerate(people.items()):
        corpus.append(_passage(f"p{i}", person, f"{person} was born in the city of {city}.", rng))
    for i, (city, country) in enumerate(city_country.items()):
        corpus.append(_passage(f"c{i}", city, f"{city} is a city in the country of {country}.", rng))
    for i, country in enumerate(countries):
        corpus.append(_passage(f"k{i}", country, f"{country} is a country.", rng))
    corpus += _unreliable_passages(cfg, people, city_country)
    misinfo = _misinfo_people(cfg, people)
    corpus += [_misinfo_passage(f"m{i}", person, wrong, misinfo_rng) for i, (person, wrong, misinfo_rng) in
               enumerate(_with_rng(cfg, misinfo, people, list(city_country)))]  # fmt: skip

    person_id = {p: f"p{i}" for i, p in enumerate(people)}
    city_id = {c: f"c{i}" for i, c in enumerate(city_country)}
    order = list(people)
    rng.shuffle(order)
    n_held = cfg.n_val + cfg.n_test
    pools = {
        "val": order[: cfg.n_val],
        "test": order[cfg.n_val : n_held],
        "train": order[n_held:],
    }
    questions: dict[str, list[dict]] = {}
    ghost_rng = random.Random(cfg.seed + 104729)  # its own stream: the rest of the world is unchanged
    taken_people = set(people)
    # each type draws from a stream of its own (stream()), so a type added to a world moves no other draw
    kinds = {kind: stream(cfg.seed, "question_type", kind) for kind in cfg.question_types}
    for split, persons in pools.items():
        records = []
        split_world = Split(people, city_country, person_id, city_id, misinfo, persons)
        for person in persons:
            for kind, kind_rng in kinds.items():
                records.append(QUESTION_TYPES[kind](f"{split}-{kind}-{len(records)}", person, split_world, kind_rng))
        if cfg.unanswerable_frac > 0:  # people the corpus never mentions (BAPO: the answer is "I don't know")
            for _ in range(round(cfg.unanswerable_frac * len(persons))):
                ghost = f"{ghost_rng.choice(first)} {ghost_rng.choice(last)}"
                while ghost in taken_people:
                    ghost = f"{ghost_rng.choice(first)} {ghost_rng.choice(last)}"
                # names no passage uses: the search finds no namesake. The corpus-name draw above stays
                # so that ghost_rng, and with it every ghost's city, is the same in both modes.
                if cfg.unanswerable_novel_names:
                    ghost = f"{_names(ghost_rng, 1, (1, 2), taken)[0]} {_names(ghost_rng, 1, (2, 3), taken)[0]}"
                taken_people.add(ghost)
                city = ghost_rng.choice(cities)
                for kind, answer in (("1hop", city), ("2hop", city_country[city])):
                    records.append(question_record(f"{split}-{kind}-{len(records)}", kind, ghost, city, answer, [],
                                             "unanswerable"))  # fmt: skip
        if cfg.unanswerable_frac > 0 or cfg.misinfo_frac > 0:
            ghost_rng.shuffle(records)  # a max_questions prefix of the split then holds every category
        questions[split] = records
    return World(corpus, questions, people, city_country, countries)


def _misinfo_people(cfg: WorldConfig, people: dict[str, str]) -> set[str]:
    rng = random.Random(cfg.seed + 15485863)
    return set(rng.sample(sorted(people), round(cfg.misinfo_frac * len(people)))) if cfg.misinfo_frac > 0 else set()


def _with_rng(cfg: WorldConfig, misinfo: set[str], people: dict[str, str], cities: list[str]):
    """(person, wrong city, rng) for each misinformed person, in a fixed order."""
    rng = random.Random(cfg.seed + 32452843)
    for person in sorted(misinfo):
        yield person, rng.choice([c for c in cities if c != people[person]]), rng


def _misinfo_passage(pid: str, person: str, wrong: str, rng: random.Random) -> dict:
    """A wrong fact on an unreliable domain, worded to outrank the reliable passage on "P born"
    (the name and "born" repeated, BM25's term frequency). Only site:tinypedia.org avoids it."""
    text = f"{person} born in {wrong}. Fans of {person} say {person} was born in the city of {wrong}."
    return _passage(pid, f"{person} born", text, rng, rng.choice(UNRELIABLE_DOMAINS))


def hinted_confidence(rng: random.Random, right: bool, p_hint: float, drawn: int) -> int:
    """The teacher's stated confidence: `drawn` (uniform 1-10), except with probability p_hint
    one from the half that matches its own correctness (5-10 if right, 1-4 if wrong; ζ = 5).

    >>> hinted_confidence(random.Random(0), True, 0.0, 3)  # no hint: the random draw, rng untouched
    3
    >>> hinted_confidence(random.Random(0), False, 1.0, 9) < 5
    True
    """
    if p_hint and rng.random() < p_hint:
        return rng.randint(5, 10) if right else rng.randint(1, 4)
    return drawn


def parity_confidence(rng: random.Random, guessed: bool) -> int:
    """The evidence world's teacher confidence (sft.confidence: parity): even after a guess, odd
    after a fact it read.

    A uniform digit (sft.confidence: random) ties the confidence to nothing, so eq. 6 can only push
    it as a whole (towards "unsure"). Here P(c >= 5) = 3/5 on both sides, so eq. 5 scores the start
    no better than a constant, but where the digit is written it already carries guess-or-fact:
    the feature a pretrained model brings and RL can then calibrate on.

    >>> rng = random.Random(0)
    >>> sorted({parity_confidence(rng, True) for _ in range(200)})
    [2, 4, 6, 8, 10]
    >>> sorted({parity_confidence(rng, False) for _ in range(200)})
    [1, 3, 5, 7, 9]
    """
    return rng.choice((2, 4, 6, 8, 10) if guessed else (1, 3, 5, 7, 9))


@dataclass
class Habits:
    """The teacher's imperfections that the papers' RL fixes (all off for configs/tiny.yaml).

    p_site: restrict the source with site:tinypedia.org (WebFilter: "uses site: rarely").
    p_unfaithful_think: the think after the information ignores it (VERITAS).
    cites_source: the think restates the whole sentence it took a fact from, attribution and all
    ("Fans of P say P was born in the city of C."), and the answer's think restates the whole
    chain; the evidence a confidence should weigh then sits in the think just before it.
    admits_guess: where a search found nothing, the think says so and that it guesses (the evidence
    world): not a flaw, the cue a confidence can be tied to.
    The other two are applied to the finished trajectory (sft.teacher_examples): a random
    confidence (Deliberative Searcher) and a random "I don't know" (BAPO: never when it should).
    """

    p_site: float = 0.0
    p_unfaithful_think: float = 0.0
    cites_source: bool = False
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    admits_guess: bool = False  # after "No results.": "Nothing names P, so I guess X." (sft.admits_guess)


UNFAITHFUL_THINK = "I know the answer."  # names nothing it read: the rule judge's 0 (agent/judge.py)
_NAME = r"[A-Z]\w*(?: [A-Z]\w*)*"  # a person's capitalised names
_BORN = re.compile(rf"({_NAME}) was born in the city of (\w+)\.")
_CITED_BORN = re.compile(rf"(?:Fans of {_NAME} say )?" + _BORN.pattern)  # with its attribution
_IN_COUNTRY = re.compile(r"(\w+) is a city in the country of (\w+)\.")
GUESSED = re.compile(r"I guess|It is in the country of")  # an answer turn that guesses (all three ways)


def teacher_segments(
    question: dict,
    search,
    rng: random.Random,
    countries: list[str],
    cities: list[str],
    p_guess_second_hop: float,
    p_no_search: float,
    habits: Habits | None = None,
) -> list[tuple[str, str]]:
    """A scripted trajectory as (text, role) segments in Search-R1's format.

    `search(query) -> rendered hits` is the same tool the policy uses in rollouts, so the
    `<information>` blocks the student sees in SFT are exactly what it will see in RL.

    The think block restates the fact in the passage's own words, so reading it off the
    passage is plain induction (find the earlier "city of", copy what follows), the copy
    mechanism small transformers learn first.

    Example (2-hop, the teacher does the second search):
      <think>I need the country where P was born.</think><search>P born</search>
      \\n<information>Doc 1(Title: P) P was born in the city of C. ...</information>\\n
      <think>P was born in the city of C. I need the country of C.</think><search>C country</search>
      \\n<information>Doc 1(Title: C) C is a city in the country of K. ...</information>\\n
      <think>C is a city in the country of K.</think><answer>K</answer>

    On an unanswerable or misinformation question (world extensions) the teacher believes what
    it reads: another person's city, or the unreliable passage's wrong one (unless it happened
    to use site:). `habits` adds the papers' imperfections (Habits).
    """
    habits = habits or Habits()
    meta = question["metadata"]
    person, kind = meta["person"], meta["type"]
    if kind == "compare":  # its draws on a stream of its own: a world that adds it moves no other trajectory's
        return compare_segments(question, search, stream(person, question["id"], "teacher"), p_guess_second_hop,
                                p_no_search)  # fmt: skip
    if rng.random() < p_no_search:
        guess = rng.choice(countries if kind == "2hop" else cities)
        return [(f"<think> I guess {person} was born in {guess}.</think><answer> {guess}</answer>", "policy")]
    site = f" site:{RELIABLE_DOMAIN}" if habits.p_site and habits.rng.random() < habits.p_site else ""
    unfaithful = bool(habits.p_unfaithful_think) and habits.rng.random() < habits.p_unfaithful_think
    believes_passage = "category" in meta  # reads the fact off the hit instead of knowing it
    goal = "the country where" if kind == "2hop" else "where"
    segs = [(f"<think> I need {goal} {person} was born.</think><search> {person} born{site}</search>", "policy")]
    obs = search(f"{person} born{site}")
    segs.append((obs, "obs"))
    city = meta["city"]
    fact = f"{person} was born in the city of {city}."  # the passage's own words (see above)
    if believes_passage:
        m = (_CITED_BORN if habits.cites_source else _BORN).search(obs)
        city = m.group(2) if m else rng.choice(cities)  # nothing found: it guesses all the same
        fact = m.group(0) if m else f"{person} was born in the city of {city}."
        if not m and habits.admits_guess:  # ... and says so, and guesses the answer itself
            guess = rng.choice(countries) if kind == "2hop" else city
            segs.append((f"<think> Nothing names {person}, so I guess {guess}.</think><answer> {guess}</answer>",
                         "policy"))  # fmt: skip
            return segs

    def think(text: str) -> str:  # after information: restate it, or (unfaithful) ignore it
        return f"<think> {UNFAITHFUL_THINK if unfaithful else text}</think>"

    if kind == "1hop":
        segs.append((f"{think(fact)}<answer> {city}</answer>", "policy"))
        return segs
    if rng.random() < p_guess_second_hop:
        guess = rng.choice(countries)
        segs.append((f"<think> {fact} It is in the country of {guess}.</think><answer> {guess}</answer>", "policy"))
        return segs
    segs.append((f"{think(f'{fact} I need the country of {city}.')}<search> {city} country{site}</search>", "policy"))
    obs = search(f"{city} country{site}")
    segs.append((obs, "obs"))
    country = question["golden_answers"][0]
    if believes_passage:
        m = _IN_COUNTRY.search(obs)
        country = m.group(2) if m else rng.choice(countries)
    second = f"{city} is a city in the country of {country}."
    chain = f"{fact} {second}" if habits.cites_source else second
    segs.append((f"{think(chain)}<answer> {country}</answer>", "policy"))
    return segs


def born_city(text: str, person: str) -> str | None:
    """The city a passage in `text` says `person` was born in ("P was born in the city of C.")."""
    m = re.search(rf"{re.escape(person)} was born in the city of (\w+)\.", text)
    return m.group(1) if m else None


def compare_segments(question: dict, search, rng: random.Random, p_guess_second_hop: float,
                     p_no_search: float) -> list[tuple[str, str]]:  # fmt: skip
    """The Search-R1 teacher on "Were P and Q born in the same city?": search P, then Q, compare the
    cities it read. Its flaws as on 2-hop: no search at all, or a guess ("no") after the first hop.

      <think> I need where P and Q were born.</think><search> P born</search> <information>..</information>
      <think> P was born in the city of C. I need where Q was born.</think><search> Q born</search> <information>..
      <think> P was born in the city of C. Q was born in the city of D.</think><answer> no</answer>
    """
    meta = question["metadata"]
    p, q = meta["person"], meta["person2"]
    if rng.random() < p_no_search:
        guess = rng.choice(("yes", "no"))
        return [(f"<think> I guess the answer is {guess}.</think><answer> {guess}</answer>", "policy")]
    segs = [(f"<think> I need where {p} and {q} were born.</think><search> {p} born</search>", "policy")]
    segs.append((search(f"{p} born"), "obs"))
    fact = f"{p} was born in the city of {born_city(segs[-1][0], p) or meta['city']}."
    if rng.random() < p_guess_second_hop:
        return segs + [(f"<think> {fact} I guess {q} was born elsewhere.</think><answer> no</answer>", "policy")]
    segs.append((f"<think> {fact} I need where {q} was born.</think><search> {q} born</search>", "policy"))
    segs.append((search(f"{q} born"), "obs"))
    second = born_city(segs[-1][0], q) or meta["city2"]
    same = "yes" if second == (born_city(segs[1][0], p) or meta["city"]) else "no"
    return segs + [(f"<think> {fact} {q} was born in the city of {second}.</think><answer> {same}</answer>", "policy")]


def world_key(cfg: Config) -> str:
    """Cache key: everything that changes the built world, tokenizer or SFT policy. The precision
    keys count as this machine resolves them (a config read from YAML still says `auto`)."""
    cfg = resolve_precision(copy.deepcopy(cfg))
    parts = {
        # options added later are left out while unset, so older worlds keep their keys (FIRST_OPTIONS)
        "world": _keyed(cfg.world) | {"cache_dir": None},
        "model": vars(cfg.model),
        # probe_every is a diagnostic (it changes no weights)
        "sft": _keyed(cfg.sft) | {"probe_every": None},
        "topk": cfg.retriever.topk,
        "max_obs_tokens": cfg.rollout.max_obs_tokens,
        "prompt": cfg.rollout.prompt_template,
        **({"protocol": cfg.rollout.protocol} if cfg.rollout.protocol != "search_r1" else {}),  # tiny/teachers.py
        **({"confidence_after_answer": True} if cfg.rollout.confidence_after_answer else {}),  # the teachers
        "format": FORMAT_VERSION,
    }
    # The teacher's observations come from this index, searched in process or served. Where it is
    # served (retriever.url: a host and port) is not what it returns: a server of the world's
    # index returns what the same search does in process, so a run whose server moved to another
    # port, or is named localhost, finds its world and resumes. "url" stays, always empty, so the
    # keys of worlds built before keep their names.
    r = cfg.retriever
    if r.min_score:  # a floor changes what the teacher sees; absent while 0 (older worlds)
        parts["min_score"] = r.min_score
    if (r.method, r.index, r.model) != ("bm25", "", ""):
        parts["retriever"] = {"method": r.method, "index": r.index, "url": "", "model": r.model,
                              "index_factory": r.index_factory}  # fmt: skip
        if r.encoder_family:  # the query prefix and pooling change the hits; absent while unset (older worlds)
            parts["retriever"]["encoder_family"] = r.encoder_family
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


# The world and SFT keys the first worlds were keyed on, always in the key. Every option added since
# (sft.confidence, p_idk, .., a fork's new option) is keyed only while it differs from its default, so
# older worlds keep their keys and a new option needs no list: this one is closed, never added to.
FIRST_OPTIONS = frozenset({
    "seed", "n_people", "n_cities", "n_countries", "n_val", "n_test", "unreliable_frac", "cache_dir",  # world
    "steps", "batch_tokens", "lr", "warmup_steps", "decay_frac", "weight_decay", "train_on_observations",  # sft
    "probe_every", "bf16", "p_guess_second_hop", "p_no_search",
})  # fmt: skip


def _keyed(section) -> dict:
    """A config section's part of a cache key: its first options, and the later ones set away from their defaults."""
    defaults = type(section)()
    return {k: v for k, v in vars(section).items() if k in FIRST_OPTIONS or v != getattr(defaults, k)}


FORMAT_VERSION = 4  # bump when the generator, teacher, prompt or tokenizer changes what gets built (4: Qwen2 split)


def world_dir(cfg: Config) -> Path:
    """The tiny world's cache: its data, tokenizer and SFT policy, keyed on all of world_key."""
    return Path(cfg.world.cache_dir) / f"tiny-{world_key(cfg)}"


def data_key(cfg: Config) -> str:
    """Cache key of the world's corpus and questions alone: generate_world reads cfg.world only."""
    world = _keyed(cfg.world) | {"cache_dir": None}
    parts = {"world": world, "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def world_data_dir(cfg: Config) -> Path:
    """corpus.jsonl and {train,val,test}.jsonl of the world, whatever the model: what a run with
    its own `model.path` trains and evaluates on when `data.*` is empty (data.data_paths)."""
    return Path(cfg.world.cache_dir) / f"world-{data_key(cfg)}"


def write_jsonl(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ensure_world_data(cfg: Config, out: Path | None = None) -> Path:
    """Write corpus.jsonl and {train,val,test}.jsonl into `out` (default: the tiny world's cache
    dir) once. The files depend on cfg.world only, so every `out` of one world holds the same."""
    out = out or world_dir(cfg)
    if (out / "test.jsonl").exists():
        return out
    world = generate_world(cfg.world)
    write_jsonl(out / "corpus.jsonl", world.corpus)
    for split in ("train", "val", "test"):  # test.jsonl last: it marks the data as complete
        write_jsonl(out / f"{split}.jsonl", world.questions[split])
    return out
