"""The tiny world (deterministic, well-formed, disjoint splits) and the BM25 retriever."""

import json
import random

import pytest

from search.corpus import format_hits, scan_corpus
from search.index import build_index, load_index, search
from tiny.world import UNRELIABLE_DOMAINS, generate_world, teacher_segments, write_jsonl
from trainer.config import WorldConfig

SMALL = WorldConfig(seed=3, n_people=200, n_cities=20, n_countries=5, n_val=10, n_test=10)


@pytest.fixture(scope="module")
def world():
    return generate_world(SMALL)


@pytest.fixture(scope="module")
def index(world, tmp_path_factory):
    corpus = tmp_path_factory.mktemp("world") / "corpus.jsonl"
    write_jsonl(corpus, world.corpus)
    return load_index(build_index(corpus, corpus.parent / "bm25"))


def test_world_is_deterministic_and_in_corpus_format(world):
    again = generate_world(SMALL)
    assert json.dumps(again.corpus) == json.dumps(world.corpus)
    other = generate_world(WorldConfig(seed=4, n_people=200, n_cities=20, n_countries=5, n_val=10, n_test=10))
    assert json.dumps(other.corpus) != json.dumps(world.corpus)
    for doc in world.corpus:
        title, _, text = doc["contents"].partition("\n")
        assert title.startswith('"') and title.endswith('"') and text
        assert {"id", "contents", "url", "domain", "date"} <= set(doc)
    assert len({d["id"] for d in world.corpus}) == len(world.corpus)


def test_unreliable_domains_contradict_the_reliable_passages(world):
    reliable = {d["contents"].split('"')[1]: d for d in world.corpus if d["domain"] == "tinypedia.org"}
    bad = [d for d in world.corpus if d["domain"] != "tinypedia.org"]
    assert bad and {d["domain"] for d in bad} <= set(UNRELIABLE_DOMAINS)
    for d in bad:
        title = d["contents"].split('"')[1]
        true_fact = reliable[title]["contents"].split("\n")[1]
        assert d["contents"].split("\n")[1] != "Some say " + true_fact  # a different city / country
        assert d["url"].startswith(f"https://{d['domain']}/")
    assert abs(len(bad) / len(reliable) - SMALL.unreliable_frac) < 0.02


def test_splits_ask_about_disjoint_people_and_answers_are_right(world):
    people = {s: {q["metadata"]["person"] for q in qs} for s, qs in world.questions.items()}
    assert not people["train"] & people["val"] and not people["val"] & people["test"]
    assert len(world.questions["val"]) == 2 * SMALL.n_val
    for q in world.questions["val"]:
        city = world.people[q["metadata"]["person"]]
        want = city if q["metadata"]["type"] == "1hop" else world.city_country[city]
        assert q["golden_answers"] == [want] and q["question"].strip()


def test_bm25_finds_the_gold_passage_first(world, index):
    qs = [q for q in world.questions["val"] if q["metadata"]["type"] == "1hop"]
    hits = search(index, [f"{q['metadata']['person']} born" for q in qs], k=3)  # one batched call
    top1 = sum(q["metadata"]["gold_ids"][0] == h[0]["document"]["id"] for q, h in zip(qs, hits))
    assert top1 / len(qs) >= 0.95
    assert all(len(h) == 3 for h in hits)


def test_format_hits_and_edge_queries(index):
    hits = search(index, ["", "zzzz qqqq", "x" * 10_000], k=3)
    assert hits[0] == [] and hits[1] == [] and hits[2] == []
    assert format_hits([]) == "No results."
    one = search(index, [search(index, ["born"], 1)[0][0]["document"]["contents"].split('"')[1] + " born"], k=2)[0]
    rendered = format_hits(one)
    assert rendered.startswith("Doc 1(Title: ") and "\nDoc 2(Title: " in rendered


def test_teacher_is_imperfect_in_the_designed_way(world, index):
    tool = lambda q: format_hits(search(index, [q], 3)[0])  # noqa: E731
    rng = random.Random(0)
    two_hop = [q for q in world.questions["train"] if q["metadata"]["type"] == "2hop"][:100]
    searches = [sum(r == "obs" for _, r in teacher_segments(q, tool, rng, ["K"], ["C"], 0.5, 0.1)) for q in two_hop]
    assert 0 in searches and 1 in searches and 2 in searches  # no search, guess after 1 hop, full
    assert 0.35 < searches.count(2) / len(searches) < 0.6


def test_missing_or_malformed_corpus_names_the_path_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        scan_corpus(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "\\"A\\"\\nok"}\n\n{"id": "1"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:3"):
        scan_corpus(bad)
    bad.write_text('{"id": "0", "contents": "x"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        scan_corpus(bad)


def test_the_saved_tiny_tokenizer_loads_as_it_was_trained(tmp_path):
    """SFT tokenises with the tokenizer it trained; everything after (trainer, eval, vLLM) loads
    it with AutoTokenizer next to the policy's Qwen2 config, which rebuilds it as Qwen2Tokenizer.
    Both must give the same ids, digits included (" Doc 1(", dates, ids like p3487), or every
    observation after SFT is written in tokens the policy never saw."""
    from transformers import AutoTokenizer

    from rollout import tokenize_segments
    from tiny.sft import build_tiny_model, train_tokenizer
    from trainer.config import ModelConfig

    world = generate_world(WorldConfig(n_people=60, n_cities=12, n_countries=4, n_val=5))
    texts = [p["contents"] for p in world.corpus]  # + what observations and answers hold: digits after a space
    texts += [f"Doc {i % 3 + 1}(Title: x) born {1990 + i % 5} [p{i}] I'm <confidence> {i % 10 + 1}" for i in range(300)]
    trained = train_tokenizer(texts, 400, tmp_path, ["<confidence>", "</confidence>"])
    build_tiny_model(ModelConfig(vocab_size=400), trained).config.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen2Tokenizer"  # what the trainer, eval and vLLM get
    segments = [("Question: Where was Tavi Morek born?\n", "prompt"),
                ("<think> I need it.</think><search> Tavi Morek born</search>", "policy"),
                ("Doc 1(Title: Tavi Morek) Tavi Morek was born in 1990. Doc 12(Title: p3487)", "obs"),
                ("<think> Velor.</think><answer> Velor</answer><confidence> 10</confidence>", "policy")]  # fmt: skip
    assert tokenize_segments(loaded, segments) == tokenize_segments(trained, segments)
    for text in texts:
        assert loaded.encode(text, add_special_tokens=False) == trained.encode(text, add_special_tokens=False)


def test_an_sft_start_that_has_not_learnt_to_copy_is_flagged(tmp_path):
    """Too few SFT steps leave a policy that cannot read the city off a passage (copying is
    learnt in a jump, docs/design.md §10): tiny/world.py still caches it, and says so on stderr, also
    when the periodic probe is off (sft.probe_every 0) and again when the cached start is reused."""
    import subprocess
    import sys

    from conftest import ROOT, write_micro_config

    sft = {"steps": 10, "warmup_steps": 2, "probe_every": 0}  # 0: probed only at the end
    path = write_micro_config(tmp_path / "c.yaml", tmp_path / "cache", sft=sft)
    built, cached = [subprocess.run([sys.executable, "-m", "tiny.sft", "--config", str(path)],
                                    capture_output=True, text=True, cwd=ROOT) for _ in range(2)]  # fmt: skip
    assert built.returncode == cached.returncode == 0, built.stderr[-2000:] + cached.stderr[-2000:]
    summary = json.loads(next((tmp_path / "cache").glob("tiny-*/sft_summary.json")).read_text())
    assert [p["step"] for p in summary["copy_acc"]] == [10]
    acc = summary["copy_acc"][-1]["copy_acc"]
    assert acc < 0.5
    for out in (built, cached):  # the cached start is flagged again
        assert f"copies the city off the passage on {acc:.0%} of held-out" in out.stderr
    assert "sft step" in built.stderr + built.stdout and "sft step" not in cached.stderr + cached.stdout


def test_a_model_of_yours_trains_on_the_tiny_world_with_no_data_paths(micro, tmp_path):
    """With model.path set (another model, another prompt, another SFT) and data.* empty, the
    corpus and questions come from a cache keyed on the world alone: the same files as the tiny
    policy's world, written on first use."""
    from data import data_paths
    from tiny.world import data_key, world_dir
    from trainer.config import load_config

    _, cfg, policy, world_path = micro
    overrides = [f"world.{k}={v}" for k, v in vars(cfg.world).items() if k != "cache_dir"] + [
        f"world.cache_dir={tmp_path}", f"model.path={policy}", "model.hidden_size=64", "rollout.chat_template=true",
        "rollout.prompt_template=", "sft.steps=7", "retriever.topk=5"]  # fmt: skip
    mine = load_config(None, overrides)
    assert world_dir(mine) != world_dir(cfg) and data_key(mine) == data_key(cfg)
    paths = data_paths(mine)
    for kind in ("corpus", "train", "val", "test"):
        assert paths[kind].parent.name == f"world-{data_key(cfg)}"
        assert paths[kind].read_bytes() == (world_path / f"{kind}.jsonl").read_bytes()
    with pytest.raises(FileNotFoundError, match="corpus file not found"):  # the tiny policy's own cache: not built
        data_paths(load_config(None, [o for o in overrides if not o.startswith("model.path")]))
