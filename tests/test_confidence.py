"""Deliberative Searcher's confidence, measured and given its cue (issue 46): the evidence world and its
teacher, the teacher-forced P(c >= 5) over whole confidence strings, the shuffled-reliability control,
and the per-seed acceptance of tiny/papers.py. Real parts: the world's BM25 index, a Qwen-style BPE
trained on the world, a Qwen2 model, eval.py as a process."""

import doctest
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import metrics  # noqa: E402
from rewards import deliberative, fair_coin  # noqa: E402
from tiny import papers  # noqa: E402
from tiny.world import GUESSED, ensure_world_data, world_key  # noqa: E402
from trainer.config import ConfigError, DataError, load_config  # noqa: E402
from trainer.precision import resolve as resolve_precision  # noqa: E402
from trainer.questions import load_confidence_contexts, load_think_contexts  # noqa: E402

EVIDENCE = ROOT / "configs/reproduction/tiny_evidence.yaml"
# the evidence world at the micro size (tests/conftest.MICRO's), so it builds in seconds
SMALL = ["world.n_people=300", "world.n_cities=30", "world.n_countries=6", "world.n_val=20", "world.n_test=20",
         "model.hidden_size=128", "model.num_heads=2", "model.num_layers=2", "model.intermediate_size=256",
         "model.vocab_size=700"]  # fmt: skip


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    """(config, world dir, the teacher's search tool) of the evidence world as configured, data only (no SFT):
    its score floor is measured on this world's BM25 scores, which a smaller world does not share."""
    from tiny.sft import world_search_tool

    cfg = resolve_precision(load_config(EVIDENCE, [f"world.cache_dir={tmp_path_factory.mktemp('evidence')}"]))
    path = ensure_world_data(cfg)
    return cfg, path, world_search_tool(cfg, path)


def test_the_score_floor_finds_every_known_person_and_city_and_no_unknown_person(evidence):
    from search.tools import open_search
    from tiny.world import generate_world

    cfg, path, _ = evidence
    search = open_search(cfg.retriever, path / "corpus.jsonl")
    questions = [json.loads(x) for split in ("train", "val", "test") for x in (path / f"{split}.jsonl").open()]
    people = {q["metadata"]["person"]: q["metadata"].get("category") == "unanswerable" for q in questions}
    hits = search([f"{p} born" for p in people], 1)
    wrong = 0
    for (person, unknown), found in zip(people.items(), hits):
        if unknown:
            assert found == [], (person, found)
        else:
            assert found, person
            wrong += not found[0]["document"]["contents"].startswith(f'"{person}"\n')
    # the stemmer makes "Repol Solas" and "Repol Sola" one name: 1 known person in 4,000 finds the other
    assert wrong <= 0.001 * len(people), wrong
    cities = list(generate_world(cfg.world).city_country)
    for city, found in zip(cities, search([f"{c} country" for c in cities], 1)):
        assert found and found[0]["document"]["contents"].startswith(f'"{city}"\n'), city


def test_the_metrics_worked_examples_hold():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
    for fn in (metrics.p_certain, metrics.certainty_gap):
        for test in finder.find(fn, globs=vars(metrics)):
            assert runner.run(test).failed == 0, fn.__name__


def test_a_confident_start_pays_nothing_for_always_sure_and_certain_right_reads_it():
    rec = lambda c, answer: {"response": f"<answer> {answer}</answer><confidence> {c}</confidence>",  # noqa: E731
                             "golden_answers": ["Velor"]}  # fmt: skip
    records = [rec(9, "Velor"), rec(3, "Velor"), rec(8, "Kesh"), rec(2, "Kesh"), rec(7, "Velor")]
    m = metrics.deliberative_metrics(records, [1, 1, 0, 0, 1])
    assert m["ds_certain_right"] == pytest.approx(2 / 3) and m["ds_false_certain"] == pytest.approx(1 / 5)
    assert "ds_certain_right" not in metrics.deliberative_metrics(records[2:4], [0, 0])  # no right answer: absent


def test_the_evidence_world_says_when_it_guesses_and_its_digit_is_threshold_neutral(evidence):
    from tiny.sft import teacher_examples

    cfg, path, tool = evidence
    trajectories = teacher_examples(cfg, path, tool)
    train = [json.loads(x) for x in (path / "train.jsonl").read_text().splitlines()]
    assert len(trajectories) == len(train) > 10_000
    unknown = [q["metadata"].get("category") == "unanswerable" for q in train]
    assert abs(sum(unknown) / len(unknown) - 0.5) < 0.01  # half the questions ask about people no passage names
    certain = {True: [], False: []}
    for q, t, guess in zip(train, trajectories, unknown):
        obs = [text for text, role in t if role == "obs"]
        last = t[-1][0]
        conf = int(last.split("<confidence> ")[1].split("</confidence>")[0])
        if guess:  # the score floor: nothing found, and the teacher says it guesses
            assert obs == ["No results."], obs
            assert f"Nothing names {q['metadata']['person']}, so I guess" in last and GUESSED.search(last)
        else:  # a known person's passage is found and read
            assert obs[0].startswith("Doc 1(Title: ") and not GUESSED.search(last), last  # (a stem twin: see above)
        assert conf % 2 == (0 if guess else 1), (guess, conf)  # even after a guess, odd after a fact
        certain[guess].append(conf >= 5)
    for side, flags in certain.items():  # P(c >= 5) = 3/5 on both sides: eq. 5 finds no calibration at the start
        assert abs(sum(flags) / len(flags) - 0.6) < 0.05, (side, sum(flags) / len(flags))


def test_the_floor_and_the_teacher_are_in_the_world_key_and_older_worlds_keep_theirs():
    cfg = load_config(EVIDENCE, SMALL)
    assert world_key(cfg) != world_key(load_config(EVIDENCE, [*SMALL, "retriever.min_score=0"]))
    assert world_key(cfg) != world_key(load_config(EVIDENCE, [*SMALL, "sft.admits_guess=false"]))
    assert world_key(cfg) != world_key(load_config(EVIDENCE, [*SMALL, "sft.confidence=random"]))
    papers_cfg = load_config(ROOT / "configs/reproduction/tiny_papers.yaml")
    assert world_key(papers_cfg) == world_key(load_config(ROOT / "configs/reproduction/tiny_papers.yaml",
                                                          ["sft.admits_guess=false", "retriever.min_score=0"]))


def test_parity_and_admitted_guesses_are_refused_for_another_protocol_in_one_line(evidence, tmp_path):
    from tiny.sft import teacher_examples

    cfg = load_config(EVIDENCE, ["rollout.protocol=deliberative", f"world.cache_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="search_r1 only"):
        teacher_examples(cfg, evidence[1], evidence[2])


def _model_dir(cfg, path: Path, out: Path) -> Path:
    """A Qwen2 model (random weights) with the world's own tokenizer, saved as a policy directory."""
    import torch

    from tiny.sft import build_tiny_model, train_tokenizer

    texts = [json.loads(x)["contents"] for x in (path / "corpus.jsonl").read_text().splitlines()]
    texts += [json.loads(x)["question"] for x in (path / "train.jsonl").read_text().splitlines()]
    tokenizer = train_tokenizer(texts + ["<confidence> 1</confidence> I guess Nothing names"], 700, out)
    torch.manual_seed(0)
    build_tiny_model(cfg.model, tokenizer).save_pretrained(out)
    return out


def test_the_readout_takes_every_confidence_as_its_whole_string(evidence, tmp_path):
    """log p(" 10</confidence>") is log p("1") + log p("0" | "1") + ..., not the digit "1" or "0"
    alone; the batched, padded computation equals a forward of each whole sequence."""
    import torch

    from eval import teacher_forced_readout
    from rollout import tokenize_segments
    from tiny.sft import confidence_contexts
    from trainer.batching import continuation_logprobs
    from trainer.engine import load_policy, load_tokenizer

    cfg, path, tool = evidence
    model_dir = _model_dir(cfg, path, tmp_path / "policy")
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir).eval()
    contexts = confidence_contexts(cfg, path, tool, "test", 8)
    assert {c["category"] for c in contexts} == {"answerable", "unanswerable"}
    values = [tokenizer.encode(f" {k}</confidence>", add_special_tokens=False) for k in metrics.CONFIDENCES]
    assert values[9][:2] == values[0][:2] and values[9][2] != values[0][2]  # " ", "1", then "0" or "</"
    ids = [tokenize_segments(tokenizer, [tuple(s) for s in c["segments"]])[0] for c in contexts]
    for c, context in zip(contexts, ids):  # cut where SFT's one policy string has a token boundary
        whole = [tuple(s) for s in c["segments"][:-1]] + [(c["segments"][-1][0] + " 10</confidence>", "policy")]
        assert tokenize_segments(tokenizer, whole)[0] == context + values[9]
    batched = continuation_logprobs(model, ids, values, tokenizer.eos_token_id, rows_per_pass=7)
    with torch.no_grad():
        for i, context in enumerate(ids):
            for j, value in enumerate(values):
                logp = torch.log_softmax(model(input_ids=torch.tensor([context + value])).logits[0].float(), -1)
                alone = sum(logp[len(context) - 1 + t, tok].item() for t, tok in enumerate(value))
                assert batched[i][j] == pytest.approx(alone, abs=1e-4), (i, j)
    readout = teacher_forced_readout(model_dir, tokenizer, cfg, 5, contexts, None)
    p = [metrics.p_certain(row) for row in batched]
    cats = [c["category"] for c in contexts]
    mean = lambda cat: sum(x for x, c in zip(p, cats) if c == cat) / cats.count(cat)  # noqa: E731
    assert readout["certain_gap"] == pytest.approx(mean("answerable") - mean("unanswerable"), abs=1e-5)
    assert readout["n_contexts"] == 8 and 0 < readout["p_certain_answerable"] < 1


def test_the_think_readout_reads_the_unfaithful_think_where_the_answers_think_begins(evidence, tmp_path):
    """VERITAS's flaw read as a probability: the contexts end at "<think>" on a token boundary of
    the teacher's own string, and p_unfaithful_think is the mean of p(" I know the answer.</think>")
    there, computed alongside the confidence readout from one loaded model."""
    import torch

    from eval import teacher_forced_readout
    from rollout import tokenize_segments
    from tiny.sft import confidence_contexts, think_contexts
    from trainer.engine import load_policy, load_tokenizer

    cfg, path, tool = evidence
    model_dir = _model_dir(cfg, path, tmp_path / "policy")
    tokenizer, model = load_tokenizer(model_dir), load_policy(model_dir).eval()
    contexts = think_contexts(cfg, path, tool, "test", 6)
    assert all(c["segments"][-1] == ["<think>", "policy"] and c["segments"][-2][1] == "obs" for c in contexts)
    assert {c["unfaithful"] for c in contexts} == {" I know the answer.</think>"}
    cont = tokenizer.encode(" I know the answer.</think>", add_special_tokens=False)
    probs = []
    with torch.no_grad():
        for c in contexts:
            context = tokenize_segments(tokenizer, [tuple(s) for s in c["segments"]])[0]
            whole = [tuple(s) for s in c["segments"][:-1]] + [("<think> I know the answer.</think>", "policy")]
            assert tokenize_segments(tokenizer, whole)[0] == context + cont  # as SFT tokenised the teacher
            logp = torch.log_softmax(model(input_ids=torch.tensor([context + cont])).logits[0].float(), -1)
            probs.append(math.exp(sum(logp[len(context) - 1 + t, tok].item() for t, tok in enumerate(cont))))
    both = teacher_forced_readout(model_dir, tokenizer, cfg, 5, confidence_contexts(cfg, path, tool, "test", 4),
                                  contexts)  # fmt: skip
    assert both["p_unfaithful_think"] == pytest.approx(sum(probs) / len(probs), rel=1e-4)
    assert both["n_think_contexts"] == 6 and both["n_contexts"] == 4 and "certain_gap" in both
    assert teacher_forced_readout(model_dir, tokenizer, cfg, 5, None, None) == {}


def test_the_shuffled_control_scores_the_digit_against_a_coin_not_correctness():
    recs = [{"question_id": f"q{i}", "sample": i % 8, "golden_answers": ["Velor"],
             "response_text": f"<think> {i}</think><confidence> 9</confidence><answer> Velor</answer>"}
            for i in range(400)]  # fmt: skip
    for r in recs:
        r["response"] = r["response_text"]
    real = [deliberative(r, lam=1.0) for r in recs]
    shuffled = [deliberative(r, lam=1.0, coin=True) for r in recs]
    assert all(r["reliability"] == 1.0 and r["acc"] == 1.0 for r in real)  # right and sure: always reliable
    assert all(s["acc"] == 1.0 for s in shuffled)  # the answer's reward is untouched
    assert [s["reliability"] for s in shuffled] == [fair_coin(r) for r in recs]  # sure: reliable iff heads
    share = sum(s["reliability"] for s in shuffled) / len(recs)
    assert 0.4 < share < 0.6, share  # a fair coin: 400 draws, 4 standard deviations either side
    assert fair_coin(recs[0]) == fair_coin(dict(recs[0]))  # fixed by the rollout: a resumed run draws the same


def _row(gap, rel, fc, right, em):
    return {"certain_gap": gap, "ds_reliability": rel, "best_constant": max(em, 1 - em), "ds_false_certain": fc,
            "ds_certain_right": right, "em": em, "acc": em}  # fmt: skip


def test_the_deliberative_acceptance_is_per_seed_so_a_mean_cannot_hide_a_failed_seed():
    rows = {papers.EVIDENCE_SFT_ROW: _row(0.01, 0.40, 0.4, 0.6, 0.5)}
    for seed in range(3):
        rows[f"{papers.EVIDENCE_BASELINE} seed{seed}"] = _row(0.05, 0.5, 0.3, 0.7, 0.52)
        rows[f"{papers.SHUFFLED} seed{seed}"] = _row(-0.1, 0.5, 0.2, 0.5, 0.52)
        rows[f"{papers.LAGRANGIAN} seed{seed}"] = _row(0.45, 0.95, 0.02, 0.9, 0.51)
    lines = papers.deliberative_acceptance(rows)
    assert len(lines) == 7 and all(met for _, _, met in lines), lines
    assert "0.450 / 0.450 / 0.450" in lines[3][1]  # every seed's number is shown
    rows[f"{papers.LAGRANGIAN} seed2"] = _row(0.10, 0.95, 0.02, 0.9, 0.51)  # mean gap 0.33 >= 0.30, one seed not
    assert [met for _, _, met in papers.deliberative_acceptance(rows)][3] is False
    rows[f"{papers.LAGRANGIAN} seed2"] = _row(0.45, 0.95, 0.02, 0.3, 0.51)  # unsure when right: not a pass
    assert [met for _, _, met in papers.deliberative_acceptance(rows)][5] is False
    rows[papers.EVIDENCE_SFT_ROW] = _row(0.20, 0.40, 0.4, 0.6, 0.5)  # a start already calibrated: refused
    assert papers.deliberative_acceptance(rows)[0][2] is False


def test_a_bad_contexts_file_is_one_line_naming_file_and_line_before_any_engine(tmp_path):
    good = {"category": "answerable", "segments": [["Question: x\n", "prompt"], ["<think> a</think><confidence>",
                                                                                  "policy"]]}  # fmt: skip
    bad = tmp_path / "contexts.jsonl"
    bad.write_text(json.dumps(good) + "\n" + json.dumps({"category": "answerable", "segments": [["x", "tool"]]}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}:2: "):
        load_confidence_contexts(bad)
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps(good | {"segments": [["Question: x\n", "prompt"], ["<think> a</think>", "policy"]]}))
    with pytest.raises(DataError, match=rf"{cut}:1: the last segment must end in <confidence>"):
        load_confidence_contexts(cut)
    think = tmp_path / "think.jsonl"  # a think context without the think to read
    think.write_text(json.dumps(good | {"segments": [["Question: x\n", "prompt"], ["<think>", "policy"]]}) + "\n")
    with pytest.raises(DataError, match=rf"{think}:1: a think context needs \"unfaithful\""):
        load_think_contexts(think)
    with pytest.raises(DataError, match=rf"{bad}:1: the last segment must end in <think>"):
        load_think_contexts(bad)
    corpus = tmp_path / "data" / "corpus.jsonl"
    corpus.parent.mkdir()
    corpus.write_text(json.dumps({"id": "p0", "contents": '"A"\nA was born in the city of B.'}) + "\n")
    questions = tmp_path / "data" / "test.jsonl"
    questions.write_text(json.dumps({"id": "q", "question": "Where was A born?", "golden_answers": ["B"]}) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # never loaded: the file is refused first
    done = subprocess.run([sys.executable, "eval.py", "--model", str(model), "--datasets", str(questions),
                           "--set", f"data.corpus={corpus}", "--confidence-contexts", str(bad)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("eval.py: error: ") and f"{bad}:2:" in done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "eval.py", "--model", str(model), "--datasets", str(questions),
                           "--set", f"data.corpus={corpus}", "--think-contexts", str(think)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and f"{think}:1:" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


def test_p_certain_renormalises_over_the_ten_confidences():
    """p_certain is invariant to a common shift of the ten log-probabilities (it renormalises)."""
    rng = random.Random(0)
    lp = [math.log(rng.random()) for _ in range(10)]
    assert metrics.p_certain(lp) == pytest.approx(metrics.p_certain([x - 7.0 for x in lp]))
    assert metrics.p_certain(lp, zeta=1) == pytest.approx(1.0) and metrics.p_certain(lp, zeta=11) == 0.0
