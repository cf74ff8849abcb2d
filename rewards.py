"""Rewards of the five papers and of the search step: rollout record -> components -> reward.

The contract. A reward is a function

    def my_reward(record: dict, my_param: float = 0.5, **_) -> dict:
        return {"reward": ..., "my_component": ..., "turn_rewards": [...]}   # turn_rewards optional

- `record` is a rollout record (rollout.py; docs/design.md §2). Read its *response* (policy text
  plus tool outputs, never the prompt, whose example "<answer> Paris </answer>" would otherwise
  score; §7) through the one parser, `answers.parsed(record)`. Malformed text never raises: it is
  a format failure.
- Keyword arguments: every `train.reward_params` key (all of them, to every reward of a sum) and
  what the trainer gives every reward: `judge` (train.judge, or None), `passage` (id -> corpus
  text, or None), `answer_logprob` (the policy's scorer for IG-Search, or None). So end the
  signature with `**_`: train.py refuses a reward that cannot take them, in one line, before any
  engine starts (trainer/reward_spec.check_reward).
- It returns a dict with a numeric "reward" (the outcome, one scalar per rollout); every other
  key is a component, a number (a bool counts as 0/1), logged as `reward/<name>` (in a weighted
  sum, `<term>/<name>`). Numbers are Python's or numpy's, finite, stored as floats.
- `turn_rewards` (optional): one value per action turn of the record (its policy chunks, in order;
  None for a turn it does not score). They land on that turn's tokens (trainer/turns.py: GRPO adds
  train.turn_coef x their group-normalised value, PPO puts them at the turn's last token) and are
  logged per turn index (turn_reward/<k>). A per-turn reward of this table returns "reward" 0, so
  that "em + turn_hit" keeps EM as the outcome.
- Signs: a penalty may be negative, and is welcome inside a weighted sum ("em - 0.1*my_penalty",
  or a function returning -1); a table reward outside [0, 1] says its range on the function,
  `my_reward.range = (-1.0, 1.0)` (RANGES reads it), held by a property test.
- A group reward (one that sees all G rollouts of a question, as BAPO's) takes the group's list
  and returns one dict per rollout; mark it with `my_reward.group = True`.
- Two ways in: a line in REWARDS (its range, `.range`, checked by tests/test_rewards_properties.py
  on adversarial output), or `train.reward: my_module:my_reward` for a reward kept in your
  fork (README "Fork a reward"), checked the same way before the run starts.

    >>> search_r1_em({"response": "<think>x</think><answer> the Velor. </answer>", "golden_answers": ["Velor"]})
    {'em': 1.0, 'f1': 1.0, 'format_ok': 1.0, 'reward': 1.0}

The table (`REWARDS`), by paper, with the equation each implements:

  search_r1_em       Search-R1 §3.4: EM of the final answer, SQuAD normalisation
  search_r1_subem    substring EM (released code's `subem_check`)
  search_r1_format   format-aware EM (released code `qa_em_format.py`; follow-up study 2505.15117):
                     EM & valid -> 1; EM & invalid -> 1 - lambda_s; wrong/none & valid -> lambda_s
                     (+ lambda_r if a gold answer is in a retrieved block); wrong & invalid ->
                     lambda_f (0.1); no answer & invalid -> 0
  deliberative       Deliberative Searcher eq. 5-6: r_format * (0.1 r_format + 0.9 r_acc +
                     lambda r_reliab), r_reliab = (acc and c >= zeta) or (not acc and c < zeta);
                     coin=True: r_reliab against a fair coin instead of acc (the shuffled control)
  webfilter          WebFilter eq. 6-8: -1 bad format; f = 0.4 z + 0.2 c + 0.4 R_f1 if non-zero;
                     else 0.1 if a query used an advanced operator (R_src, eq. 2-4); else 0
  bapo               BAPO eq. 3, 5, 6 (group-level): R_correct = char-F1 if valid format else -1;
                     R_IDK = 0.5 [IDK] if no rollout of the group has R_correct > 0, gated by the
                     adaptive modulator (§4.2)
  veritas            VERITAS eq. 1: 0.9 EM + 0.05 info-think + 0.02 think-answer
  and the components on their own: em, subem, f1, char_f1, format, idk, confidence,
  reliability, source_restricting, think_answer, info_think, think_search.

Per search step (turn_rewards; agent/steps.py holds their pieces):

  turn_hit           1 for a search whose results hold a golden answer, 0 for one whose do not
  stepsearch         StepSearch (arXiv 2505.15107): information gain over the gold documents
                     minus the share of documents seen before, per search
  ig_search          IG-Search (arXiv 2604.15148): the policy's log-probability of the gold answer
                     after the search's results, minus after another rollout's results (a group
                     reward; the policy scores it, about one forward pass per search and swap)

Composition: a config names a reward ("deliberative") or a weighted sum of table entries
("0.9*em + 0.1*think_answer"); parameters go in `train.reward_params`. `check_reward` checks both
before a run starts (trainer/reward_spec.py: the grammar, and a misspelt parameter names itself),
and a reward that raises or comes out NaN, infinite or not a number stops the step before the
optimizer, naming the reward and the record (TrainingFault; agent/scoring.py). Offline audit:

    python rewards.py --reward bapo --input rollouts.jsonl --output scores.jsonl

One file on purpose (about 550 lines, the contract above included): the papers' rewards side by
side in one table is what a reader compares and a fork edits; the parsing and the judge they
share live in agent/, and so do BAPO's machinery around its reward (agent/bapo.py) and the
per-step measures (agent/steps.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import zlib

from agent import scoring
from agent.answers import (
    ACTIONS,
    OBSERVATIONS,
    char_f1,
    exact_match,
    f1_score,
    golden_of,
    normalize_answer,
    parsed,
    substring_match,
)
from agent.bapo import bapo_correct, bapo_solved
from agent.judge import asked_at_once, make_judge
from agent.steps import gold_documents, ig_search_steps, retrieval_hits, stepsearch_steps
from search.web import SOURCE_OPERATORS
from trainer import reward_spec
from trainer.config import TrainingFault

# --------------------------------------------------------------------------------------------
# Components (each one a reward on its own) and the papers' rewards.


def subem(record: dict, **_) -> dict:
    return {"reward": substring_match(parsed(record).answer, golden_of(record))}


def f1(record: dict, **_) -> dict:
    return {"reward": f1_score(parsed(record).answer, golden_of(record))}


def char_f1_reward(record: dict, **_) -> dict:
    return {"reward": char_f1(parsed(record).answer, golden_of(record))}


def format_reward(record: dict, **_) -> dict:
    return {"reward": float(parsed(record).format_ok)}


def idk(record: dict, **_) -> dict:
    return {"reward": float(parsed(record).idk)}


def confidence(record: dict, **_) -> dict:
    """The stated confidence scaled to [0, 1] (0 when absent)."""
    c = parsed(record).confidence
    return {"reward": (c or 0) / 10}


def search_r1_em(record: dict, **_) -> dict:
    """Search-R1 outcome reward (§3.4): EM of the last answer block; 0 without one."""
    p, golden = parsed(record), golden_of(record)
    ok = float(p.answer is not None)
    e = exact_match(p.answer, golden)
    return {"em": e, "f1": f1_score(p.answer, golden), "format_ok": ok, "reward": e}


def search_r1_subem(record: dict, **_) -> dict:
    p = parsed(record)
    s = substring_match(p.answer, golden_of(record))
    return {"subem": s, "em": exact_match(p.answer, golden_of(record)), "reward": s}


def retrieval_hit(record: dict) -> bool:
    """A normalised golden answer occurs in some retrieved block (Search-R1's retrieval score)."""
    golden = [normalize_answer(g) for g in golden_of(record) if normalize_answer(g)]
    return any(g in normalize_answer(b) for k, b in parsed(record).blocks if k in OBSERVATIONS for g in golden)


def search_r1_format(record: dict, lambda_s: float = 0.2, lambda_r: float = 0.0, lambda_f: float = 0.1,
                     **_) -> dict:  # fmt: skip
    """Format-aware EM. lambda_s: structure (the code's structure_format_score), lambda_r:
    retrieval (retrieval_score), lambda_f: final format (final_format_score); defaults are the
    released v0.3 scripts' 0.2 / 0 / 0.1."""
    p = parsed(record)
    valid = p.structure_ok and p.tags_balanced
    e = exact_match(p.answer, golden_of(record))
    hit = valid and retrieval_hit(record)
    if e:
        r = 1.0 if valid else 1.0 - lambda_s
    elif valid:
        r = lambda_s + (lambda_r if hit else 0.0)
    else:
        r = lambda_f if p.answer is not None else 0.0
    return {"em": e, "structure_ok": float(valid), "retrieval_hit": float(hit), "reward": r}


def reliability(record: dict, zeta: float = 5, acc: float | None = None, **_) -> dict:
    """Deliberative Searcher eq. 5: confident and right, or unsure and wrong, where the
    confidence is the final answer's (answers.final_answer_confidence). No confidence: 0.

    It is computed whatever the format: eq. 6 already zeroes the reward of a malformed output
    (r_format multiplies everything), and U, the constrained statistic, is the reliability of
    the answers the policy gives, as Table 1 measures it (metrics.deliberative_metrics counts
    the same rollouts), so the batch mean of this component equals ds_reliability."""
    c = parsed(record).confidence
    a = exact_match(parsed(record).answer, golden_of(record)) if acc is None else acc
    r = 0.0 if c is None else float((a >= 1 and c >= zeta) or (a < 1 and c < zeta))
    return {"reward": r}


def fair_coin(record: dict) -> float:
    """0.0 or 1.0, a fair coin fixed by the rollout (its question, sample and text), so a resumed
    run draws the same.

    >>> fair_coin({"question_id": "q1", "sample": 0, "response_text": "x"}) in (0.0, 1.0)
    True
    """
    key = f"{record.get('question_id')}|{record.get('sample')}|{record.get('response_text', '')}"
    return float(zlib.crc32(key.encode()) & 1)


def deliberative(record: dict, lam: float = 0.0, zeta: float = 5, acc_metric: str = "em", judge=None,
                 coin: bool = False, **_) -> dict:  # fmt: skip
    """Deliberative Searcher eq. 6: r_format (0.1 r_format + 0.9 r_acc + lambda r_reliab).

    lambda comes from the trainer's dual update (0 during the warm-up quarter). r_acc is EM,
    F1 >= 0.5, or a judge's verdict (the paper uses a frozen LLM verifier) by `acc_metric`.
    The format requires a confidence 1..10 besides the structure.
    coin: the shuffled-reliability control. r_reliab is scored against a fair coin drawn per
    rollout instead of r_acc: the same reward variance on the digit, no information about
    correctness (configs/reproduction/tiny_deliberative_shuffled.yaml). r_acc is unchanged.
    """
    p, golden = parsed(record), golden_of(record)
    r_format = float(p.format_ok and p.confidence is not None)
    if acc_metric == "judge":
        r_acc = answer_verdict(record, judge)
    elif acc_metric == "f1":
        r_acc = float(f1_score(p.answer, golden) >= 0.5)
    else:
        r_acc = exact_match(p.answer, golden)
    r_rel = reliability(record, zeta, fair_coin(record) if coin else r_acc)["reward"]
    final = r_format * (0.1 * r_format + 0.9 * r_acc + lam * r_rel)
    return {"format": r_format, "acc": r_acc, "reliability": r_rel, "confidence": float(p.confidence or 0),
            "lambda": lam, "reward": final}  # fmt: skip


def source_restricting(record: dict, **_) -> dict:
    """1 if any extracted query uses an advanced operator (WebFilter R_src)."""
    return {"reward": float(any(SOURCE_OPERATORS.search(q) for q in parsed(record).queries))}


def webfilter(record: dict, alpha: float = 0.4, beta: float = 0.2, judge=None, **_) -> dict:
    """WebFilter eq. 6-8. z (answer correct) and c (the operators helped) come from the judge;
    without one, z = EM and c = 0, and the components say so ("judged": 0)."""
    p, golden = parsed(record), golden_of(record)
    src = source_restricting(record)["reward"]
    r_f1 = f1_score(p.answer, golden)
    if not p.format_ok:
        return {"format": 0.0, "src": src, "f1": r_f1, "z": 0.0, "c": 0.0, "judged": 0.0, "reward": -1.0}
    if judge is not None:
        z, c, judged = answer_verdict(record, judge), syntax_verdict(record, judge), 1.0
    else:
        z, c, judged = exact_match(p.answer, golden), 0.0, 0.0
    agg = alpha * z + beta * c + (1 - alpha - beta) * r_f1
    reward = agg if agg != 0 else (0.1 if src else 0.0)
    return {"format": 1.0, "src": src, "f1": r_f1, "z": z, "c": c, "judged": judged, "reward": reward}


def think_answer(record: dict, **_) -> dict:
    """VERITAS think-answer faithfulness: the answer's normalised text occurs, as whole words,
    in the last think block before the answer (§3.2). 0 without an answer or a think block."""
    p = parsed(record)
    if p.answer is None or not normalize_answer(p.answer):
        return {"reward": 0.0}
    thinks = []
    for k, b in p.blocks:
        if k == "answer":
            break
        if k == "think":
            thinks.append(b)
    # whole words only: "Paris" occurs in "Paris is ..." but not in "comparison"
    hit = bool(thinks) and f" {normalize_answer(p.answer)} " in f" {normalize_answer(thinks[-1])} "
    return {"reward": float(hit)}


def info_think(record: dict, judge=None, **_) -> dict:
    """VERITAS info-think faithfulness: mean judge verdict over (information, next think)
    pairs. 0 when the rollout never searched (the paper is silent; 1 would pay for not
    searching) and 0 without a judge ("pairs" says how many there were)."""
    return _pair_verdicts(record, judge, OBSERVATIONS, ("think",), "info_think", ("info", "think"))


def think_search(record: dict, judge=None, **_) -> dict:
    """VERITAS think-search faithfulness (an evaluation metric): does each query follow from the
    think block before it? Mean judge verdict; 0 without searches or without a judge (average
    it over rollouts with pairs > 0)."""
    return _pair_verdicts(record, judge, ("think",), ACTIONS, "think_search", ("think", "search"))


def _pair_verdicts(record: dict, judge, first: tuple, second: tuple, kind: str, fields: tuple) -> dict:
    """Mean judge verdict over adjacent (first, second) block pairs, e.g. (information, think)."""
    blocks = parsed(record).blocks
    pairs = [(a, b) for (ka, a), (kb, b) in zip(blocks, blocks[1:]) if ka in first and kb in second]
    if not pairs or judge is None:
        return {"reward": 0.0, "pairs": len(pairs)}
    verdicts = judge.verdicts([judge.prompt(kind, **dict(zip(fields, pair))) for pair in pairs])
    return {"reward": sum(verdicts) / len(verdicts), "pairs": len(pairs)}


def veritas(record: dict, w_em: float = 0.9, w_info_think: float = 0.05, w_think_answer: float = 0.02,
            judge=None, **_) -> dict:  # fmt: skip
    """VERITAS eq. 1 (weights from §5.1)."""
    e = exact_match(parsed(record).answer, golden_of(record))
    it = info_think(record, judge=judge)["reward"]
    ta = think_answer(record)["reward"]
    return {"em": e, "info_think": it, "think_answer": ta, "judged": float(judge is not None),
            "reward": w_em * e + w_info_think * it + w_think_answer * ta}  # fmt: skip


def answer_verdict(record: dict, judge) -> float:
    """A judge's 0/1 on whether the final answer matches a golden answer (falls back to EM)."""
    p = parsed(record)
    if judge is None or p.answer is None:
        return exact_match(p.answer, golden_of(record))
    prompt = judge.prompt("answer", question=record.get("question", ""), answer=p.answer, golden=golden_of(record))
    return judge.verdicts([prompt])[0]


def syntax_verdict(record: dict, judge) -> float:
    """WebFilter's c: did the advanced search syntax help retrieve the needed evidence?"""
    p = parsed(record)
    if not p.queries:
        return 0.0
    prompt = judge.prompt("syntax", question=record.get("question", ""), queries=p.queries,
                          evidence=[b for k, b in p.blocks if k in OBSERVATIONS])  # fmt: skip
    return judge.verdicts([prompt])[0]


# --------------------------------------------------------------------------------------------
# BAPO (group-level): the boundary-aware reward (its modulator's stage, R_correct and the
# resampling: agent/bapo.py).


def bapo(group: list[dict], stage: str = "plateau", idk_ratio: float = 0.0, alpha: float = 0.05,
         sample_level: bool = True, f1_unit: str = "char", correct: str = "em", **_) -> list[dict]:  # fmt: skip
    """BAPO eq. 5-6 for one group of G rollouts of the same question.

    R_IDK = 0.5 [answer is IDK] when no rollout is correct (bapo_solved: EM by default; eq. 5's
    literal "every R_correct <= 0" with correct="reward"), and the modulator allows it:
      exploration stage: only while the batch's IDK ratio (from the trainer) is below alpha;
      plateau stage: always, except (sample level) for a question whose G rollouts give at
      least G/2 distinct answers (the model is still exploring it).
    """
    scores = [bapo_correct(r, f1_unit) for r in group]
    answers = [normalize_answer(parsed(r).answer or "") for r in group]
    distinct = len(set(answers))
    if stage == "exploration":
        gate = idk_ratio < alpha
    else:
        gate = not (sample_level and distinct >= len(group) / 2)
    none_correct = not any(bapo_solved(r, f1_unit, correct) for r in group)
    out = []
    for r, c in zip(group, scores):
        r_idk = 0.5 * float(parsed(r).idk) if none_correct and gate else 0.0
        out.append({"correct": c, "idk": float(parsed(r).idk), "idk_bonus": r_idk, "gate": float(gate),
                    "distinct_answers": distinct, "reward": c + r_idk})  # fmt: skip
    return out


bapo.group = True


# --------------------------------------------------------------------------------------------
# Per search step: "reward" 0 (the outcome is another term's), the credit in turn_rewards.


def turn_hit(record: dict, **_) -> dict:
    """1 for each search whose results hold a golden answer, 0 for one whose do not (None: a turn
    without a search). hit_rate: the share of the rollout's searches that hit."""
    hits = retrieval_hits(record)
    scored = [h for h in hits if h is not None]
    return {"reward": 0.0, "hit_rate": sum(scored) / len(scored) if scored else 0.0, "turn_rewards": hits}


def stepsearch(record: dict, passage=None, **_) -> dict:
    """StepSearch's IG_t - P_t per search (agent/steps.stepsearch_steps), against the question's
    gold documents (metadata.support_docs, or the passages metadata.gold_ids names)."""
    steps = stepsearch_steps(record, gold_documents(record, passage))
    scored = [s for s in steps if s is not None]
    return {"reward": 0.0, "step_mean": sum(scored) / len(scored) if scored else 0.0, "turn_rewards": steps}


def ig_search(group: list[dict], answer_logprob=None, swaps: int = 3, **_) -> list[dict]:
    """IG-Search's information gain per search of each rollout of the group (agent/steps.py),
    scored by the policy (`answer_logprob`, which train.py gives)."""
    if answer_logprob is None and any(r.get("tool_calls") for r in group):
        raise TrainingFault("reward 'ig_search' needs the policy's scorer (answer_logprob), which train.py gives; "
                            "it cannot be computed offline")  # fmt: skip
    steps = ig_search_steps(group, answer_logprob, int(swaps)) if answer_logprob else [[] for _ in group]
    out = []
    for turns in steps:
        scored = [s for s in turns if s is not None]
        out.append({"reward": 0.0, "ig_mean": sum(scored) / len(scored) if scored else 0.0, "turn_rewards": turns})
    return out


ig_search.group = True

# What a reward scores in place of a judge's verdicts in a run without one (train.judge ""): train.py
# says so once, at the start (reward_spec.judge_note), not only in a `judged: 0` component.
webfilter.without_judge = lambda params: "z (answer correct) is EM and c (the operators helped) is 0"
veritas.without_judge = lambda params: "its info_think term is 0"
info_think.without_judge = think_search.without_judge = lambda params: "it is 0 on every rollout"
deliberative.without_judge = lambda params: "r_acc is EM" if params.get("acc_metric") == "judge" else ""


# Ranges outside [0, 1] (RANGES below). deliberative's upper end grows with lambda: 1 + lambda.
deliberative.range, webfilter.range, bapo.range = (0.0, math.inf), (-1.0, 1.0), (-1.0, 1.5)
# Turn rewards: stepsearch's IG in [0, 1] minus a redundancy share in [0, 1]; ig_search's a
# difference of log-probabilities.
turn_hit.turn_range, stepsearch.turn_range, ig_search.turn_range = (0.0, 1.0), (-1.0, 1.0), (-math.inf, math.inf)


# --------------------------------------------------------------------------------------------
# The table, composition and scoring.

REWARDS = {
    # the papers' rewards
    "search_r1_em": search_r1_em,
    "search_r1_subem": search_r1_subem,
    "search_r1_format": search_r1_format,
    "deliberative": deliberative,
    "webfilter": webfilter,
    "bapo": bapo,
    "veritas": veritas,
    # components on their own ("em" is Search-R1's EM with its em / f1 / format_ok components)
    "em": search_r1_em,
    "subem": subem,
    "f1": f1,
    "char_f1": char_f1_reward,
    "format": format_reward,
    "idk": idk,
    "confidence": confidence,
    "reliability": reliability,
    "source_restricting": source_restricting,
    "think_answer": think_answer,
    "info_think": info_think,
    "think_search": think_search,
    # per search step (turn_rewards)
    "turn_hit": turn_hit,
    "stepsearch": stepsearch,
    "ig_search": ig_search,
}
# The documented range of each reward, said on its function (`.range`, default [0, 1]), so a new
# reward is one line in REWARDS; property tests hold every reward to it.
RANGES = {name: getattr(fn, "range", (0.0, 1.0)) for name, fn in REWARDS.items()}
# The range of each turn reward of a per-step reward (its "reward" is 0), said on its function (`.turn_range`).
TURN_RANGES = {name: fn.turn_range for name, fn in REWARDS.items() if hasattr(fn, "turn_range")}


def parse_spec(spec: str, key: str = "train.reward") -> list[tuple[float, str]]:
    """`train.reward` as (weight, name) terms of this table (trainer/reward_spec.py: the grammar,
    and a ConfigError naming the key for a NaN weight, a malformed sum or an unknown name).

    >>> parse_spec("0.9*em + 0.1 * think_answer")
    [(0.9, 'em'), (0.1, 'think_answer')]
    """
    return reward_spec.parse_spec(spec, REWARDS, key)


def check_reward(spec: str, params: dict, constraints: list = (),
                 keys: tuple[str, str] = ("train.reward", "train.reward_params")) -> None:  # fmt: skip
    """`train.reward` and `train.reward_params` checked against this table before any work: a
    misspelt parameter names itself (trainer/reward_spec.check_reward)."""
    reward_spec.check_reward(spec, params, REWARDS, constraints, keys)


def compute(records: list[dict], spec: str = "search_r1_em", params: dict | None = None, judge=None,
            given: dict | None = None) -> list[dict]:  # fmt: skip
    """Components and the scalar for each record (group rewards see their whole group).

    Returns one dict per record: {"reward": float, "components": {...}} and, where a term gives
    them, "turn_rewards" (the weighted sum of the terms' turn rewards, turn by turn; None where no
    term scores the turn). A single-term spec reports that reward's own components; a sum reports
    each term's scalar and its components as "<term>/<name>". `given`: what the trainer gives
    every reward besides the judge (passage, answer_logprob; module docstring). A reward that raises
    or gives what the contract does not allow (a non-number or non-finite reward, component or turn
    reward, turn rewards not one per action turn) raises TrainingFault naming the reward and the
    record (agent/scoring.py). With a
    judge, every verdict the rewards ask for, record by record, is asked in one call
    (judge.asked_at_once): the judge's concurrency serves the whole batch, for any reward.
    """
    params = dict(GIVEN) | dict(given or {}) | dict(params or {})
    terms = parse_spec(spec)
    return asked_at_once(judge, lambda j: scoring.compute(records, spec, terms, params, j, REWARDS))


# what every reward is given besides the judge (reward_spec.GIVEN, the one list of them); None: offline
GIVEN = dict.fromkeys(name for name in reward_spec.GIVEN if name != "judge")


def score(records: list[dict], spec: str = "search_r1_em", params: dict | None = None, judge=None,
          given: dict | None = None) -> list[dict]:  # fmt: skip
    """Attach `reward`, `reward_components` and, where given, `turn_rewards` to each rollout
    record (in place); return them. Nothing is attached unless every record scored well
    (compute's checks: a TrainingFault naming the reward and the record)."""
    for r, s in zip(records, compute(records, spec, params, judge, given)):
        r["reward"] = s["reward"]
        r["reward_components"] = s["components"]
        r.pop("_parsed", None)
        if "turn_rewards" in s:
            r["turn_rewards"] = s["turn_rewards"]
    return records


# --------------------------------------------------------------------------------------------
# CLI: offline audits of saved rollouts.

CLI_HELP = """
input  (jsonl, one rollout per line): {"id", "group_id", "question", "golden_answers": [..],
       "response": the full generated text after the prompt, tool outputs included}
       (train.py's samples/step_k.jsonl records work too: "response_text" is read if
       "response" is absent)
output (jsonl, one line per input line, same order): {"id", "reward", "components": {..}}
Group-level rewards (bapo) group lines by "group_id". Parameters: --set name=value, e.g.
--set lam=0.3 --set zeta=5 (deliberative), --set stage=exploration --set idk_ratio=0.02 (bapo).
"""


def _value(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__ + CLI_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reward", required=True, help="a table name or a weighted sum, e.g. '0.9*em + 0.1*think_answer'")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="reward parameter (JSON value)")
    ap.add_argument("--input", required=True, help="rollouts jsonl (schema above)")
    ap.add_argument("--output", required=True, help="scores jsonl to write")
    ap.add_argument("--judge-url", default="", help="OpenAI-compatible judge, e.g. http://127.0.0.1:8001/v1")
    ap.add_argument("--judge-model", default="", help="model name on that server (or a local dir with --judge-hf)")
    ap.add_argument("--judge-hf", action="store_true", help="run the judge in process with transformers")
    ap.add_argument("--judge-on-failure", default="error", choices=["error", "zero"],
                    help="when the judge fails after retries: stop, or score 0 and count it")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        params = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    except ValueError:
        sys.exit("error: --set needs NAME=VALUE")
    try:
        check_reward(args.reward, params, keys=("--reward", "--set"))
        with open(args.input) as f:
            records = []
            for n, line in enumerate(f, 1):
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError(f"{args.input}:{n}: not a JSON object")
                    records.append(rec)
    except FileNotFoundError:
        sys.exit(f"error: input file not found: {args.input}")
    except (ValueError, json.JSONDecodeError) as e:
        sys.exit(f"error: {e}")
    judge = None
    if args.judge_url or args.judge_hf:
        judge = make_judge(
            url=args.judge_url, model=args.judge_model, hf=args.judge_hf, on_failure=args.judge_on_failure
        )
    try:
        scores = compute(records, args.reward, params, judge)
    except TrainingFault as e:  # a NaN reward: one line, as train.py says it
        sys.exit(f"error: {e}")
    with open(args.output, "w") as f:
        for rec, s in zip(records, scores):
            f.write(json.dumps({"id": rec.get("id"), **s}) + "\n")
    mean = sum(s["reward"] for s in scores) / max(1, len(scores))
    extra = f", judge failures {judge.failures}" if judge is not None else ""
    print(f"scored {len(scores)} rollouts with {args.reward}: mean reward {mean:.4f}{extra} -> {args.output}")


if __name__ == "__main__":
    main()
