"""Per-protocol scripted teachers: the tiny world's teacher writing any protocol, through the real
rollout loop.

world.teacher_segments writes Search-R1 trajectories as text. For the other protocols (BAPO's TIR
with \\boxed{} answers, Deliberative Searcher's search / read with a confidence per step,
WebFilter's JSON tool calls) the teacher is a *policy*: `next_turn` reads the transcript so far
(prompt, its own turns, the tools' observations as the protocol renders them) and writes the next
turn. `TeacherEngine` puts it behind the engine interface (trainer/engine.py), so rollout.rollout_batch
runs it with the protocol's own parser, tools and rendering, and the SFT data is exactly what a
rollout of that protocol looks like. The flaws are world.Habits' (site: rarely, a think that
ignores what it read), plus a random confidence and a random "I don't know" (SFTConfig).

Worked example, deliberative, 1-hop ("Where was Tavi Morek born?"), turn by turn:
    <think> I need where Tavi Morek was born.</think><confidence> 4</confidence><search> Tavi Morek born</search>
    <result>[p17] Tavi Morek ...</result>
    <think> The first source should say.</think><confidence> 8</confidence><read> p17</read>
    <result>[p17] Tavi Morek\\nTavi Morek was born in the city of Velor.</result>
    <think> Tavi Morek was born in the city of Velor.</think><confidence> 2</confidence><answer> Velor</answer>

    python -m tiny.teachers --config configs/reproduction/tiny_papers.yaml --set rollout.protocol=deliberative -n 3
"""

from __future__ import annotations

import argparse
import json
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agent import protocols
from agent.answers import OBSERVATIONS, exact_match, parse_response
from rollout import render_prompt, rollout_batch
from search.tools import make_search_fn
from tiny.questions import stream
from tiny.world import (
    _BORN,
    _IN_COUNTRY,
    RELIABLE_DOMAIN,
    UNFAITHFUL_THINK,
    born_city,
    ensure_world_data,
    generate_world,
    hinted_confidence,
    read_jsonl,
)
from trainer.config import load_config


@dataclass
class Flaws:
    """One trajectory's draws (fixed per question, so every turn agrees with the others)."""

    no_search: bool
    guess_second_hop: bool
    site: str
    unfaithful: bool
    idk: bool
    rng: random.Random  # guesses and confidences
    named: dict = field(default_factory=dict)  # NAMED_DRAWS' values, by name


# Draws added since the five above, each on a stream of its own (questions.stream: the seed, the question, the
# draw's name), so adding one moves no other draw. The first five keep sharing the question's one stream,
# in their order: moving them would change every cached protocol world's SFT data (the golden hashes in
# tests/test_fork_worlds.py pin it). A new draw is a line here: name -> (its stream, the SFT config) -> value.
NAMED_DRAWS: dict[str, Callable[[random.Random, object], object]] = {
    # a compare question's two searches in one call, where the protocol splits a search (query_sep)
    "parallel": lambda rng, sft: rng.random() < PARALLEL_SHARE,
}
PARALLEL_SHARE = 0.5  # the teacher of a parallel protocol asks both at once half the time: RL has both to weigh


def draw_flaws(question: dict, sft, seed: int) -> Flaws:
    rng = random.Random(zlib.crc32(f"{seed}|{question['id']}".encode()))
    return Flaws(
        no_search=rng.random() < sft.p_no_search,
        guess_second_hop=rng.random() < sft.p_guess_second_hop,
        site=f" site:{RELIABLE_DOMAIN}" if rng.random() < sft.p_site else "",
        unfaithful=rng.random() < sft.p_unfaithful_think,
        idk=rng.random() < sft.p_idk,
        rng=rng,
        named={name: draw(stream(seed, question["id"], name), sft) for name, draw in NAMED_DRAWS.items()},
    )


def render(protocol: str, think: str, action: str, arg: str, confidence: int | None, after: bool = False) -> str:
    """One turn in the protocol's format: think [confidence] then search / read / answer; with
    `after` (rollout.confidence_after_answer) an answer's confidence follows it instead. A protocol
    with its own `teach` (agent/protocols.py) writes its turns itself."""
    if protocols.get(protocol).teach is not None:
        return protocols.get(protocol).teach(think, action, arg, confidence, after)
    conf = f"<confidence> {confidence}</confidence>" if confidence is not None else ""
    if action == "answer":
        arg = f"\\boxed{{{arg}}}" if protocol == "bapo" and not arg.startswith("\\boxed") else arg
        if after:
            return f"<think> {think}</think><answer> {arg}</answer>{conf}"
        if protocol != "deliberative":  # Search-R1 style: the confidence sits before the answer
            return f"<think> {think}</think>{conf}<answer> {arg}</answer>"
    if action == "search" and protocol == "webfilter":
        call = json.dumps({"name": "search", "arguments": {"queries": [arg]}})
        return f"<think> {think}</think><tool_call>{call}</tool_call>"
    return f"<think> {think}</think>{conf if protocol == 'deliberative' else ''}<{action}> {arg}</{action}>"


def next_turn(protocol: str, question: dict, response: str, flaws: Flaws, countries: list[str],
              cities: list[str], confidence: bool, confidence_hint: float = 0.0,
              confidence_after: bool = False) -> str:  # fmt: skip
    """The teacher's next turn given the response so far (everything after the prompt)."""
    meta, rng = question["metadata"], flaws.rng
    person, two_hop = meta["person"], meta["type"] == "2hop"
    blocks = parse_response(response).blocks
    observations = [b for k, b in blocks if k in OBSERVATIONS]
    step_conf = rng.randint(1, 10) if protocol == "deliberative" else None
    final_conf = rng.randint(1, 10) if confidence or protocol == "deliberative" else None

    def answer(think: str, value: str) -> str:
        value = protocols.get(protocol).idk_answer if flaws.idk else value
        right = exact_match(value, question["golden_answers"]) == 1.0
        conf = None if final_conf is None else hinted_confidence(rng, right, confidence_hint, final_conf)
        return render(protocol, think, "answer", value, conf, confidence_after)

    compare = meta["type"] == "compare"
    if flaws.no_search:
        guess = rng.choice(("yes", "no") if compare else countries if two_hop else cities)
        return answer(f"I guess the answer is {guess}." if compare else f"I guess {person} was born in {guess}.", guess)
    actions = [k for k, _ in blocks if k in ("search", "tool_call", "read")]
    searches = sum(k != "read" for k in actions)
    last = observations[-1] if observations else ""
    if protocol == "deliberative" and actions and actions[-1] == "search":  # a list of sources: read the first
        first = re.search(r"\[([^\]\s]+)\]", last)
        if first:
            return render(protocol, "The first source should say.", "read", first.group(1), step_conf)

    def said(fact: str) -> str:  # after reading: restate it, or (unfaithful) ignore it
        return UNFAITHFUL_THINK if flaws.unfaithful else fact

    if compare:
        return compare_turn(protocol, meta, searches, " ".join(observations), flaws, cities, step_conf, answer, said)
    if not searches:
        goal = "the country where" if two_hop else "where"
        return render(protocol, f"I need {goal} {person} was born.", "search", f"{person} born{flaws.site}", step_conf)
    if searches >= 2:  # the second hop's result: the city's country
        m = _IN_COUNTRY.search(last)
        country = m.group(2) if m else rng.choice(countries)
        return answer(said(m.group(0) if m else "I could not find the country."), country)
    m = _BORN.search(last)  # the first hop: believes what it reads (a rumour, another person)
    city = m.group(2) if m else rng.choice(cities)
    fact = m.group(0) if m else f"{person} was born in the city of {city}."
    if not two_hop:
        return answer(said(fact), city)
    if flaws.guess_second_hop:
        guess = rng.choice(countries)
        return answer(f"{fact} It is in the country of {guess}.", guess)
    return render(protocol, said(f"{fact} I need the country of {city}."), "search", f"{city} country{flaws.site}",
                  step_conf)  # fmt: skip


def compare_turn(protocol: str, meta: dict, searches: int, read: str, flaws: Flaws, cities: list[str],
                 step_conf: int | None, answer: Callable, said: Callable) -> str:  # fmt: skip
    """A compare question's next turn ("Were P and Q born in the same city?"): search P, then Q, or both in
    one call where the protocol splits a search into queries (query_sep) and the draw "parallel" says so;
    then answer whether the cities it read agree. After the first of two searches it may guess "no"
    (the 2-hop teacher's guess_second_hop)."""
    p, q, sep = meta["person"], meta["person2"], protocols.get(protocol).query_sep
    both = bool(sep) and bool(flaws.named.get("parallel"))
    if not searches:
        queries = f"{p} born{flaws.site}" + (f" {sep.strip()} {q} born{flaws.site}" if both else "")
        return render(protocol, f"I need where {p} and {q} were born.", "search", queries, step_conf)
    first = born_city(read, p) or flaws.rng.choice(cities)  # believes what it read; found nothing: guesses
    fact = f"{p} was born in the city of {first}."
    if searches == 1 and not both:
        if flaws.guess_second_hop:
            return answer(f"{fact} I guess {q} was born elsewhere.", "no")
        return render(protocol, said(f"{fact} I need where {q} was born."), "search", f"{q} born{flaws.site}",
                      step_conf)  # fmt: skip
    second = born_city(read, q) or flaws.rng.choice(cities)
    return answer(said(f"{fact} {q} was born in the city of {second}."), "yes" if first == second else "no")


class CharTokenizer:
    """Just enough of a tokenizer for rollout.py to run the teacher before the real tokenizer
    exists (tiny/sft.py trains it on the teacher's text): one id per character."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))


@dataclass
class _Out:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


class TeacherEngine:
    """trainer/engine.py's interface, answered by `next_turn` for the question named in the prompt."""

    def __init__(self, protocol: str, questions: list[dict], sft, seed: int, countries: list[str], cities: list[str],
                 confidence: bool, confidence_after: bool = False):  # fmt: skip
        self.protocol, self.countries, self.cities, self.confidence = protocol, countries, cities, confidence
        self.confidence_hint, self.confidence_after = sft.p_confidence_hint, confidence_after
        self.held: dict[str, str] = {}  # question id -> the rest of a turn cut at a stop string
        self.by_text = {q["question"].strip(): q for q in questions}
        self.flaws = {q["id"]: draw_flaws(q, sft, seed) for q in questions}
        self.tok = CharTokenizer()

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None) -> list[_Out]:
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            head, _, response = text.partition("\n")  # the plain prompt is one line ending in the question
            question = self.by_text[head.rsplit("Question: ", 1)[1].strip()]
            turn = self.held.pop(question["id"], "") or next_turn(
                self.protocol, question, response, self.flaws[question["id"]], self.countries, self.cities,
                self.confidence, self.confidence_hint, self.confidence_after)  # fmt: skip
            # as a real engine: stop after the first stop string; the rest is the next call's
            # (rollout.confidence_after_answer asks for what follows </answer>)
            ends = [turn.find(s) + len(s) for s in stop if s in turn]
            if ends:
                turn, self.held[question["id"]] = turn[: min(ends)], turn[min(ends) :]
            out.append(_Out(self.tok.encode(turn), [0.0] * len(turn)))
        return out


def teacher_rollouts(cfg, questions: list[dict], tools, countries: list[str], cities: list[str]) -> list[dict]:
    """One rollout record per question, the teacher writing cfg.rollout.protocol through
    rollout.rollout_batch (the protocol's parser, tools and observation rendering)."""
    engine = TeacherEngine(cfg.rollout.protocol, questions, cfg.sft, cfg.world.seed, countries, cities,
                           cfg.sft.confidence == "random", cfg.rollout.confidence_after_answer)  # fmt: skip
    # lengths count characters here: no budget cuts the teacher (the tiny world's observations are
    # far below max_obs_tokens real tokens); max_turns is the config's, so the RL rollouts match
    rcfg = replace(cfg.rollout, max_model_len=10**6, max_obs_tokens=10**6, max_tokens_per_turn=10**6)
    return rollout_batch(engine, engine.tok, questions, 1, tools, rcfg, greedy=True)


def protocol_trajectories(cfg, questions: list[dict], tools, countries: list[str], cities: list[str]) -> list:
    """teacher_rollouts as SFT trajectories: (text, role) segments, the prompt first."""
    out = []
    for q, r in zip(questions, teacher_rollouts(cfg, questions, tools, countries, cities)):
        prompt = render_prompt(q["question"], cfg.rollout.prompt_template, cfg.rollout)
        out.append([(prompt, "prompt")] + [(c["text"], "policy" if c["role"] == "policy" else "tool")
                                          for c in r["chunks"]])  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="a tiny-world config, e.g. configs/reproduction/tiny_papers.yaml")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. rollout.protocol=deliberative")  # fmt: skip
    parser.add_argument("-n", type=int, default=3, help="trajectories to print")
    args = parser.parse_args()
    cfg = load_config(args.config, args.set)
    path = ensure_world_data(cfg)
    world = generate_world(cfg.world)
    qs = read_jsonl(path / "train.jsonl")[: args.n]
    tools = make_search_fn(cfg, path / "corpus.jsonl", {})
    for t in protocol_trajectories(cfg, qs, tools, world.countries, list(world.city_country)):
        print("".join(text for text, _ in t), end="\n\n")


if __name__ == "__main__":
    main()
