"""The papers' tiny world (issue 7): unanswerable and misinformation questions, the teacher's
per-paper flaws, operator-aware search, the rule judge, config bases, per-category metrics, and
`reproduce.py --world papers` end to end on a micro version (real SFT, vLLM, training runs)."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.judge import RuleJudge, entities, make_judge  # noqa: E402
from tiny.report import finish_report  # noqa: E402
from tiny.world import Habits, generate_world, teacher_segments, world_key, write_jsonl  # noqa: E402
from trainer.config import ConfigError, WorldConfig, load_config  # noqa: E402

EXT = dict(seed=5, n_people=600, n_cities=40, n_countries=8, n_val=40, n_test=40, unanswerable_frac=0.25,
           misinfo_frac=0.2)  # fmt: skip


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    """(world, operator-aware BM25 search, index, corpus path) of a small extended world."""
    from search.index import build_index, load_index
    from search.web import operator_search

    world = generate_world(WorldConfig(**EXT))
    base = tmp_path_factory.mktemp("papers_world")
    write_jsonl(base / "corpus.jsonl", world.corpus)
    index = load_index(build_index(base / "corpus.jsonl", base / "bm25", "bm25"))
    return world, lambda queries, k=1: operator_search(index, queries, k), index, base / "corpus.jsonl"


def docs_tool(search):
    """The Search-R1 teacher's tool over `search`: a query -> "Doc i(Title: t) text" lines."""
    return lambda q: "\n".join(
        f"Doc {i}(Title: {h['document']['contents'].splitlines()[0][1:-1]}) {h['document']['contents'].splitlines()[1]}"
        for i, h in enumerate(search([q])[0], 1)) or "No results."  # fmt: skip


def test_extensions_off_leave_every_older_world_and_its_cache_key_unchanged():
    plain, off = generate_world(WorldConfig(seed=1, n_people=200)), generate_world(
        WorldConfig(seed=1, n_people=200, unanswerable_frac=0.0, misinfo_frac=0.0))  # fmt: skip
    assert json.dumps([plain.corpus, plain.questions]) == json.dumps([off.corpus, off.questions])
    assert not any("category" in q["metadata"] for qs in plain.questions.values() for q in qs)
    # the cached SFT starts of the shipped configs stay valid (results/tiny.md, the Lagrangian runs);
    # world.FORMAT_VERSION 4 (2026-11-23: the tokenizer splits as Qwen2's) changed them once, on purpose
    # sft.bf16=true: these keys were pinned when SFT ran in bf16 by default; `auto` (trainer/precision.py)
    # keys the resolved value, so a machine without native bf16 builds (and caches) its own start
    bf16 = ["sft.bf16=true"]
    assert world_key(load_config(ROOT / "configs/tiny.yaml", bf16)) == "2ab02866ae47"
    assert world_key(load_config(ROOT / "configs/experiments/tiny_lagrangian.yaml", bf16)) == "53ba2c44687a"


def test_unanswerable_people_are_absent_from_the_corpus(ext):
    world, *_ = ext
    text = " ".join(p["contents"] for p in world.corpus)
    for qs in world.questions.values():
        ghosts = {q["metadata"]["person"] for q in qs if q["metadata"].get("category") == "unanswerable"}
        people = {q["metadata"]["person"] for q in qs if q["metadata"].get("category") != "unanswerable"}
        assert len(ghosts) == round(0.25 * len(people))
        assert ghosts and not ghosts & set(world.people)
        assert not any(re.search(rf"\b{g}\b", text) for g in ghosts)  # whole words: "Ded Zelap" vs "Ded Zelapo"
    kinds = [q["metadata"].get("category", "plain") for q in world.questions["val"][:40]]
    assert len(set(kinds)) == 3  # shuffled: a max_questions prefix holds every category


def test_novel_ghost_names_share_no_name_with_the_corpus():
    shared = generate_world(WorldConfig(**EXT))
    novel = generate_world(WorldConfig(**EXT, unanswerable_novel_names=True))
    assert novel.corpus == shared.corpus  # only the ghosts' names change
    words = {w for p in novel.corpus for w in re.findall(r"\w+", p["contents"])}
    for world, want_shared in ((shared, True), (novel, False)):
        ghosts = {q["metadata"]["person"] for qs in world.questions.values() for q in qs
                  if q["metadata"].get("category") == "unanswerable"}  # fmt: skip
        assert len(ghosts) > 20
        namesakes = sum(bool(set(g.split()) & words) for g in ghosts)
        assert namesakes == (len(ghosts) if want_shared else 0)


def test_misinformation_outranks_the_truth_unless_the_source_is_restricted(ext):
    world, search, *_ = ext
    qs = [q for q in world.questions["test"] if q["metadata"]["type"] == "1hop"]
    for q in qs:
        person, city, cat = q["metadata"]["person"], q["metadata"]["city"], q["metadata"].get("category")
        (plain,) = search([f"{person} born"])
        (site,) = search([f"{person} born site:tinypedia.org"])
        top, top_site = plain[0]["document"] if plain else None, site[0]["document"] if site else None
        if cat == "misinfo":
            assert top["domain"] != "tinypedia.org" and f"city of {city}." not in top["contents"]
            assert top_site["domain"] == "tinypedia.org" and f"city of {city}." in top_site["contents"]
        elif cat == "unanswerable":
            assert top is None or person not in top["contents"]
            assert top_site is None  # every word must occur: nothing on tinypedia names a ghost
        else:
            assert top["domain"] == "tinypedia.org" and f"city of {city}." in top["contents"]
    assert sum(q["metadata"].get("category") == "misinfo" for q in qs) >= 5


def test_operator_search_leaves_plain_queries_alone_and_never_crashes(ext):
    from search.index import search as plain_search

    _, search, index, _ = ext
    queries = ["Tavi born", "", "site:tinypedia.org", '"was born" -site:tinypedia.org Kasol', "NOT NOT"]
    out = search(queries, 3)
    assert len(out) == 5 and out[1] == [] and out[2] == []  # only operators: no hits, no error
    assert all(h["document"]["domain"] != "tinypedia.org" for h in out[3])
    plain = plain_search(index, ["Tavi born"], 3)[0]  # a plain query: exactly retriever.search's hits
    assert [h["document"]["id"] for h in out[0]] == [h["document"]["id"] for h in plain] and plain


def test_deliberative_and_webfilter_protocols_get_search_and_read_tools(ext):
    from search.tools import make_search_fn

    world, *_, corpus = ext
    person = next(q for q in world.questions["test"] if q["metadata"].get("category") == "misinfo")["metadata"]
    timings: dict = {}
    cfg = load_config(None, ["rollout.protocol=deliberative", "retriever.topk=2"])
    tools = make_search_fn(cfg, corpus, timings)
    assert set(tools) == {"search", "read"}
    (res,) = tools["search"]([f"{person['person']} born site:tinypedia.org"])
    assert res["error"] is None and [r["domain"] for r in res["results"]] == ["tinypedia.org"]
    good, missing = tools["read"]([res["results"][0]["id"], "p999999"])
    assert f"city of {person['city']}." in good["text"] and "no document" in missing["error"]
    assert timings["retrieve"] > 0
    with pytest.raises(ConfigError, match="in-process index"):
        make_search_fn(load_config(None, ["rollout.protocol=webfilter", "retriever.url=http://127.0.0.1:9"]),
                       corpus, {})  # fmt: skip


def test_teacher_has_each_papers_flaw_when_asked(ext):
    world, search, *_ = ext
    tool = docs_tool(search)
    countries, cities = world.countries, list(world.city_country)
    qs = world.questions["train"]
    always = Habits(p_site=1.0, p_unfaithful_think=1.0, rng=random.Random(0))
    for q in qs[:60]:
        text = "".join(t for t, _ in teacher_segments(q, tool, random.Random(1), countries, cities, 0.0, 0.0, always))
        assert text.count("site:tinypedia.org") == text.count("<search>") >= 1
        assert text.count("<think> I know the answer.</think>") == text.count("<search>")
    never = Habits(rng=random.Random(0))
    right = {"misinfo": 0, "unanswerable": 0, None: 0}
    total = dict.fromkeys(right, 0)
    for q in qs:
        segs = teacher_segments(q, tool, random.Random(2), countries, cities, 0.0, 0.0, never)
        text = "".join(t for t, _ in segs)
        assert "site:" not in text and "I know the answer" not in text
        cat = q["metadata"].get("category")
        total[cat] += 1
        right[cat] += text.endswith(f"<answer> {q['golden_answers'][0]}</answer>")
    # it believes what it reads: right on plain questions, fooled by misinformation, and answers
    # unanswerable questions anyway (a ghost's city only by a rare coincidence)
    assert right[None] == total[None] and right["misinfo"] <= 0.2 * total["misinfo"]
    assert right["unanswerable"] <= 0.3 * total["unanswerable"] and total["unanswerable"] > 20


def test_citing_teacher_puts_the_unreliable_attribution_in_its_answers_think(ext):
    """sft.think_cites_source: the think before the answer carries "Fans of" exactly when the
    teacher read a rumour passage (misinformation, or an unanswerable question's namesake), so the
    evidence against its answer sits in the tokens before the confidence. Its answers are the
    default teacher's."""
    world, search, *_ = ext
    tool = docs_tool(search)
    countries, cities = world.countries, list(world.city_country)
    wrong = {True: [], False: []}  # read a rumour -> was each answer wrong
    for q in world.questions["train"][:300]:
        segs = [[t for t, _ in teacher_segments(q, tool, random.Random(3), countries, cities, 0.0, 0.0,
                                                Habits(cites_source=cites, rng=random.Random(0)))]
                for cites in (False, True)]  # fmt: skip
        plain, citing = segs
        assert plain[-1].rsplit("<answer>")[-1] == citing[-1].rsplit("<answer>")[-1]  # the same answer
        read_rumour = any("Fans of" in t for t in citing[1::2])  # the observations
        final_think = citing[-1].split("</think>")[0]
        assert ("Fans of" in final_think) == read_rumour, citing
        assert "Fans of" not in "".join(plain[::2])  # the default teacher drops the attribution
        wrong[read_rumour].append(not citing[-1].endswith(f"<answer> {q['golden_answers'][0]}</answer>"))
    # a flagged answer is mostly wrong; the unflagged wrong ones read a namesake's own page
    assert len(wrong[True]) > 20 and sum(wrong[True]) >= 0.8 * len(wrong[True])  # a wrong city may share the country
    assert sum(wrong[False]) <= 0.15 * len(wrong[False])
    with pytest.raises(ConfigError, match="sft.think_cites_source"):  # only the Search-R1 teacher has it
        load_config(None, ["sft.think_cites_source=true", "rollout.protocol=deliberative"])


@pytest.mark.parametrize("after", [False, True])
def test_hinted_confidence_follows_the_teachers_correctness_in_both_teachers(ext, tmp_path, after):
    """sft.p_confidence_hint = 1: every stated confidence is >= 5 exactly when the teacher's
    answer is right, in tiny/sft.py's Search-R1 teacher and in tiny/teachers.py's protocol teachers; with
    rollout.confidence_after_answer both write the final confidence after the answer."""
    from dataclasses import replace

    from agent.answers import exact_match, parse_response
    from search.tools import make_search_fn
    from tiny.sft import teacher_examples
    from tiny.teachers import teacher_rollouts

    world, search, _, corpus = ext
    qs = world.questions["train"][:80]
    hint = ["sft.confidence=random", "sft.p_confidence_hint=1", f"rollout.confidence_after_answer={after}"]
    cfg = load_config(None, ["rollout.protocol=deliberative", "rollout.max_turns=5", "retriever.topk=1", *hint])
    recs = teacher_rollouts(cfg, qs, make_search_fn(cfg, corpus, {}), world.countries, list(world.city_country))
    texts = [r["response_text"] for r in recs]
    cfg = load_config(None, hint)
    cfg.world = replace(cfg.world, **EXT)
    write_jsonl(tmp_path / "train.jsonl", qs)
    tool = docs_tool(search)
    texts += ["".join(t for t, role in ex if role != "prompt") for ex in teacher_examples(cfg, tmp_path, tool)]
    parsed = [parse_response(t) for t in texts]
    right = [exact_match(p.answer, q["golden_answers"]) == 1.0 for p, q in zip(parsed, qs + qs)]
    assert [p.confidence >= 5 for p in parsed] == right and 0 < sum(right) < len(right)
    assert all(p.format_ok for p in parsed[: len(qs)])  # the rewards' parser takes either place (tiny/sft.py's
    # texts here lack the observation tags, which tokenize_segments adds)
    ends = [re.search(r"</answer>(<confidence> \d+</confidence>)?$", t) for t in texts]
    assert all(m and bool(m.group(1)) == after for m in ends)
    for bad in (["sft.p_confidence_hint=0.3"], [*hint[:1], "sft.p_confidence_hint=1.5"]):
        with pytest.raises(ConfigError, match="sft.p_confidence_hint"):
            load_config(None, bad)


def test_rule_judge_rules_and_their_use_in_the_rewards():
    judge = make_judge("rule")
    assert isinstance(judge, RuleJudge) and "rule" in judge.model
    info = "Doc 1(Title: Tavi Morek) Tavi Morek was born in the city of Velor."
    cases = [
        ("info_think", dict(info=info, think="Tavi Morek was born in the city of Velor."), 1.0),
        ("info_think", dict(info=info, think="I know the answer."), 0.0),
        ("info_think", dict(info=info, think="Kesh is a city in the country of Oru."), 0.0),
        ("think_search", dict(think="I need the country of Velor.", search="Velor country"), 1.0),
        ("think_search", dict(think="I know the answer.", search="Velor country"), 0.0),
        (
            "syntax",
            dict(
                question="Where was Tavi Morek born?", queries=["Tavi Morek born site:tinypedia.org"], evidence=[info]
            ),
            1.0,
        ),  # fmt: skip
        ("syntax", dict(question="Where was Tavi Morek born?", queries=["Tavi Morek born"], evidence=[info]), 0.0),
        ("answer", dict(question="q", answer="the Velor.", golden=["Velor"]), 1.0),
        ("answer", dict(question="q", answer="Kesh", golden=["Velor"]), 0.0),
    ]
    assert judge.verdicts([judge.prompt(k, **f) for k, f, _ in cases]) == [v for *_, v in cases]
    assert entities("I know the answer. Doc 1(Title: x)") == set()
    with pytest.raises(ValueError, match="no rule for 'bogus'"):
        judge.prompt("bogus")
    from report.metrics import compute_metrics
    from rewards import score

    faithful = f"<think> a</think><search> Tavi Morek born</search><information>{info}</information>"
    recs = [{"response": faithful + "<think> Tavi Morek was born in the city of Velor.</think><answer> Velor</answer>",
             "golden_answers": ["Velor"], "question": "Where was Tavi Morek born?"},
            {"response": faithful + "<think> I know the answer.</think><answer> Velor</answer>",
             "golden_answers": ["Velor"], "question": "Where was Tavi Morek born?"}]  # fmt: skip
    out = score([dict(r) for r in recs], "veritas", judge=judge)
    assert [r["reward_components"]["info_think"] for r in out] == [1.0, 0.0]
    assert out[0]["reward"] > out[1]["reward"]
    assert compute_metrics(recs, judge=judge)["info_think"] == 0.5
    site = dict(
        recs[0], response=recs[0]["response"].replace("Morek born</search>", "Morek born site:tinypedia.org</search>")
    )
    wf = score([site, dict(recs[0])], "webfilter", judge=judge)
    assert [r["reward_components"]["c"] for r in wf] == [1.0, 0.0] and wf[0]["reward"] > wf[1]["reward"]


def test_config_base_inherits_and_bad_bases_name_the_file(tmp_path):
    veritas = load_config(ROOT / "configs/reproduction/tiny_veritas.yaml")
    papers = load_config(ROOT / "configs/reproduction/tiny_papers.yaml")
    assert veritas.train.reward != papers.train.reward == "em"
    assert (veritas.world, veritas.sft, veritas.rollout) == (papers.world, papers.sft, papers.rollout)
    bapo = load_config(ROOT / "configs/reproduction/tiny_bapo.yaml")  # base: tiny_papers_boundary, its base tiny_papers
    assert bapo.world.unanswerable_frac == 0.5 and bapo.world.n_people == papers.world.n_people
    fixed = load_config(ROOT / "configs/reproduction/tiny_deliberative_fixed.yaml")  # a base of a base
    assert fixed.train.constraints[0]["fixed_lambda"] == 0.1 and fixed.train.reward == "deliberative"
    (tmp_path / "a.yaml").write_text("base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml.*the base of"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("base: c.yaml\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "d.yaml").write_text(
        "base: c.yaml\ntrain: {lr_rat: 1}\n".replace("c.yaml", str(ROOT / "configs/reproduction/tiny_papers.yaml"))
    )
    with pytest.raises(ConfigError, match="train.lr_rat"):
        load_config(tmp_path / "d.yaml")
    with pytest.raises(ConfigError, match="rollout.protocol"):
        load_config(None, ["rollout.protocol=serach_r1"])


def test_summary_splits_the_categories():
    from eval import summarize

    def rec(cat, answer, query="P born"):
        meta = {"type": "1hop"} | ({"category": cat} if cat else {})
        resp = f"<think> a</think><search> {query}</search><information>x</information><think> b</think>"
        resp += f"<answer> {answer}</answer>"
        return {"response": resp, "golden_answers": ["Velor"], "metadata": meta, "num_searches": 1,
                "reward_components": {"em": float(answer == "Velor"), "f1": 0.0, "format_ok": 1.0}}  # fmt: skip

    m = summarize([rec(None, "Velor"), rec("misinfo", "Kesh"), rec("misinfo", "Velor", "P born site:tinypedia.org"),
                   rec("unanswerable", "I don't know"), rec("unanswerable", "Kesh")])  # fmt: skip
    assert (m["em_plain"], m["em_misinfo"], m["em_answerable"]) == (1.0, 0.5, 2 / 3)
    assert (m["idk_unanswerable"], m["idk_answerable"], m["operator_misinfo"], m["operator"]) == (0.5, 0.0, 0.5, 0.2)


def test_every_papers_row_shares_its_baselines_start():
    from tiny.papers import RUNS, START_OF, STARTS
    from tiny.world import world_dir

    start = {row: world_dir(load_config(ROOT / config)) for row, config in RUNS.items()}
    for row in RUNS:
        assert start[row] == start[STARTS[START_OF[row]]], row
    assert len(set(start.values())) == len(STARTS) == 3  # BAPO's and the Deliberative rows' starts are their own


def test_a_partial_report_keeps_every_line_whose_rows_ran():
    """Lines of rows not run (nan) are left out; BAPO's, which says "unanswerable", is kept."""
    from tiny.papers import BOUNDARY_BASELINE, acceptance_shown

    per = {"idk_unanswerable": 0.9, "idk_answerable": 0.03, "em_answerable": 0.9}
    rows = {f"{BOUNDARY_BASELINE} seed0": per | {"idk_unanswerable": 0.0}, "BAPO seed0": per}
    shown = [paper for paper, _, _ in acceptance_shown(rows)]
    assert "BAPO" in shown and "WebFilter" not in shown and "VERITAS" not in shown, shown


def test_veritas_line_is_per_seed_below_the_baselines_lowest_and_keeps_em():
    from tiny.papers import BASELINE, SFT_ROW, veritas_line

    rows = {SFT_ROW: {"p_unfaithful_think": 0.29, "em": 0.62}}
    for seed, (b, v) in enumerate([(0.034, 0.008), (0.070, 0.013), (0.056, 0.011)]):
        rows[f"{BASELINE} seed{seed}"] = {"p_unfaithful_think": b, "em": 0.62}
        rows[f"VERITAS seed{seed}"] = {"p_unfaithful_think": v, "em": 0.61}
    paper, claim, met = veritas_line(rows)
    assert met and "0.008 / 0.013 / 0.011" in claim and "start 0.290" in claim, claim
    rows["VERITAS seed2"]["p_unfaithful_think"] = 0.04  # below the baseline's mean, above its lowest seed
    assert veritas_line(rows)[2] is False
    rows["VERITAS seed2"] = {"p_unfaithful_think": 0.011, "em": 0.45}  # mean EM falls by more than 0.03
    assert veritas_line(rows)[2] is False


MICRO_PAPERS = [
    # the micro world of conftest.MICRO with the papers' extensions (world key of its own)
    "world.n_people=300", "world.n_cities=30", "world.n_countries=6", "world.n_val=20", "world.n_test=20",
    "model.hidden_size=128", "model.num_heads=2", "model.num_layers=2", "model.intermediate_size=256",
    "model.vocab_size=700", "sft.steps=250", "sft.batch_tokens=2048", "sft.warmup_steps=20",
    "rollout.max_model_len=512", "rollout.max_tokens_per_turn=48", "train.questions_per_step=4",
    "train.group_size=4", "train.steps=1", "train.eval_every=1", "train.save_every=1",
    # 32 held-out questions, not all (46 and 60): this world's test split has 6 unanswerable questions, the
    # first at index 25 (tiny/world.py shuffles the categories), and the report needs one. vLLM without
    # torch.compile: the runs check wiring, and each of their engine starts compiled for ~10 s
    # (conftest.MICRO's rollout.enforce_eager)
    "eval.max_questions=32", "rollout.enforce_eager=true",
]  # fmt: skip


@pytest.mark.slow
def test_reproduce_papers_end_to_end_and_rerun_keeps_finished_runs(tmp_path):
    import os

    cache = os.environ.get("MICRO_CACHE") or str(tmp_path / "cache")
    # 120 SFT steps, not 250: the starts still write think blocks (info_think is measured); the
    # wiring is what is checked, and the two starts' SFT was a third of this test's time
    sets = sum((["--set", s] for s in [*MICRO_PAPERS, "sft.steps=120", f"world.cache_dir={cache}"]), [])
    rows = ["GRPO baseline (EM)", "BAPO", "WebFilter", "Deliberative: Lagrangian"]  # each start once
    cmd = [sys.executable, "reproduce.py", "--world", "papers", "--seeds", "0", "--only", *rows,
           "--out", str(tmp_path / "papers.md"), "--run-dir", str(tmp_path / "runs"), *sets]  # fmt: skip
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    report = (tmp_path / "papers.md").read_text()
    assert "## Acceptance: " in report and "rule judge" in report
    assert ' --only "GRPO baseline (EM)" "BAPO" "WebFilter" "Deliberative: Lagrangian"' in report.splitlines()[2]
    # BAPO's and the Deliberative rows: a start (and test split) of their own
    for row in rows + ["SFT start", "SFT start, boundary world", "SFT start, evidence world"]:
        assert f"| {row} |" in report
    data = json.loads((tmp_path / "runs" / "tiny_papers.json").read_text())["rows"]
    starts = ("start", "start-boundary", "start-evidence")
    evaluated = {start: json.loads((tmp_path / "runs" / "eval" / start / "command.json").read_text())
                 for start in starts}  # fmt: skip
    datasets = {start: Path(argv[argv.index("--datasets") + 1]) for start, argv in evaluated.items()}
    assert len({d.parent for d in datasets.values()}) == 3  # three worlds, three test splits
    # the teacher-forced confidence, read at the evidence world's own contexts, and the per-seed lines
    assert "--confidence-contexts" in evaluated["start-evidence"]
    assert "--think-contexts" in evaluated["start"] and "--think-contexts" not in evaluated["start-evidence"]
    assert 0 < data["WebFilter seed0"]["p_unfaithful_think"] < 1  # every row of the papers' start is read
    lagrangian = data["Deliberative: Lagrangian seed0"]
    assert {"certain_gap", "p_certain_answerable", "p_certain_unanswerable", "best_constant"} <= set(lagrangian)
    assert "| Deliberative: Lagrangian | Δ per seed " in report
    assert all((d.parent / "policy" / "DONE").is_file() for d in datasets.values())  # each start's own world
    webfilter = data["WebFilter seed0"]
    assert {"operator_use", "em_misinfo", "idk_unanswerable", "info_think", "ds_reliability"} <= set(webfilter)
    # the runs used what their configs name: the rule judge, BAPO's stage (the Lagrangian: the protocol test)
    metrics = {p.name.split("-seed")[0]: [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines()]
               for p in (tmp_path / "runs").glob("*-seed0-*")}  # fmt: skip
    # judged: 1 for every well-formed rollout (the rule judge gave z and c), 0 for a format failure
    assert metrics["tiny-webfilter"][-1]["reward/judged"] > 0 and "reward/c" in metrics["tiny-webfilter"][-1]
    assert "bapo_stage" in metrics["tiny-bapo"][-1]
    assert "info_think" in metrics["tiny-papers"][0]["eval"]  # every run measures faithfulness
    for paper in ("searchr1", "deliberative", "bapo", "webfilter", "veritas"):  # named after the report's stem
        assert (tmp_path / "curves" / f"papers_{paper}.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished earlier") == len(rows) and "  started tiny-" not in again.stdout
    assert again.stdout.count("evaluated earlier") == 3  # every start's evaluation is kept too
    assert again.stdout.count("built earlier") == 3  # and every start, without a tiny.sft process


@pytest.mark.parametrize("protocol", ["bapo", "deliberative", "webfilter"])
def test_protocol_teachers_write_valid_trajectories_through_the_rollout_loop(ext, protocol):
    from agent.answers import parse_response
    from rewards import score
    from search.tools import make_search_fn
    from tiny.teachers import teacher_rollouts

    world, *_, corpus = ext
    qs = world.questions["train"][:80]
    flawless = ["sft.p_no_search=0", "sft.p_guess_second_hop=0", "sft.p_idk=0", "sft.p_site=0",
                "sft.p_unfaithful_think=0", "sft.confidence=random"]  # fmt: skip
    for sets, check in (
        (flawless, "clean"),
        (flawless[:2] + ["sft.confidence=random", "sft.p_site=1", "sft.p_unfaithful_think=1", "sft.p_idk=1"], "flaws"),
    ):
        cfg = load_config(None, [f"rollout.protocol={protocol}", "rollout.max_turns=5", "retriever.topk=1", *sets])
        recs = teacher_rollouts(cfg, qs, make_search_fn(cfg, corpus, {}), world.countries, list(world.city_country))
        assert all(r["finish"] == "answer" and not r["invalid_actions"] for r in recs)
        parsed = [parse_response(r.get("response", r["response_text"])) for r in recs]
        assert all(p.format_ok and p.confidence is not None for p in parsed)  # the rewards' parser agrees
        if check == "clean":
            plain = [(p, q) for p, q in zip(parsed, qs) if "category" not in q["metadata"]]
            assert all(p.answer.replace("\\boxed{", "").rstrip("}") == q["golden_answers"][0] for p, q in plain)
            assert all("I know the answer" not in r["response_text"] for r in recs)
            if protocol == "deliberative":  # search, then read the first source, per hop
                assert all(r["num_reads"] == r["num_searches"] >= 1 for r in recs if "category" not in r["metadata"])
        else:
            assert all(p.idk for p in parsed) and all(q.endswith(f"site:{'tinypedia.org'}") for p in parsed
                                                      for q in p.queries)  # fmt: skip
            assert all("I know the answer" in r["response_text"] for r in recs)
        reward = {"bapo": "bapo", "deliberative": "deliberative", "webfilter": "webfilter"}[protocol]
        scored = score(recs, reward, {"stage": "plateau"} if protocol == "bapo" else {})
        assert all(r["reward"] > -1 for r in scored)  # no format failure in the paper's own reward


@pytest.mark.slow
def test_a_protocol_world_builds_and_trains_end_to_end(tmp_path):
    """World -> deliberative teacher through rollout.py -> tokenizer with the protocol's tags ->
    SFT -> one GRPO step with vLLM, search + read tools, the deliberative reward and its Lagrangian
    (configs/reproduction/tiny_deliberative_uniform.yaml: the evidence world's teacher writes Search-R1's format
    only; a smoke run: 30 SFT steps teach nothing, the wiring is what is checked)."""
    sets = [*MICRO_PAPERS, f"world.cache_dir={tmp_path / 'cache'}", "sft.steps=30", "rollout.protocol=deliberative",
            "rollout.max_turns=5", "rollout.prompt_template=", "train.steps=1",
            "train.eval_every=0",  # the step's own rollouts check the tools; validation adds nothing here
            f"train.run_dir={tmp_path / 'runs'}", "rollout.gpu_memory_utilization=0.1"]  # fmt: skip
    cmd = [sys.executable, "train.py", "--config", "configs/reproduction/tiny_deliberative_uniform.yaml",
           *sum((["--set", s] for s in sets), [])]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    world = next((tmp_path / "cache").glob("tiny-*"))
    first = json.loads((world / "sft.jsonl").read_text().splitlines()[0])
    assert "<confidence>" in first[1][0] and any(role == "tool" and "<result>" in text for text, role in first)
    tok = json.loads((world / "policy" / "tokenizer.json").read_text())
    assert {"<read>", "<result>", "<confidence>"} <= {t["content"] for t in tok["added_tokens"]}
    rows = [json.loads(x) for x in next((tmp_path / "runs").glob("*/metrics.jsonl")).read_text().splitlines()]
    assert "reward/reliability" in rows[-1] and "lambda/reliability" in rows[-1] and rows[-1]["step"] == 1


def test_a_report_names_its_runs_relative_to_the_repository(tmp_path):
    """finish_report: a committed report never names one checkout's absolute path (results/*.md
    named /work/main/runs/... before); a run directory outside the repository stays as given."""
    out = tmp_path / "report.md"
    finish_report(out, ["# r"], [], ROOT / "runs" / "reproduce-x", tmp_path / "r.json", {})
    assert "`runs/reproduce-x` (not committed)" in out.read_text() and str(ROOT) not in out.read_text()
    finish_report(out, ["# r"], [], tmp_path / "elsewhere", tmp_path / "r.json", {})
    assert f"`{tmp_path / 'elsewhere'}`" in out.read_text()
