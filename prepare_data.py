"""Search-R1's train and test parquets from FlashRAG's dataset files, offline.

    python prepare_data.py --flashrag data/flashrag --out data/nq_hotpotqa
    # data/nq_hotpotqa/train.parquet   nq train + hotpotqa train             (169,615 rows)
    # data/nq_hotpotqa/test.parquet    the seven benchmarks, test or dev     (51,713 rows)
    python prepare_data.py --flashrag data/flashrag --out data/nq --train nq --test nq   # nq_search.py's

`--flashrag` is a copy of the RUC-NLPIR/FlashRAG_datasets dataset repository: one folder per
benchmark, `<dataset>/<split>.jsonl`, rows {"id": "test_0", "question", "golden_answers": [..],
"metadata"?: {..}}. The output is what Search-R1's scripts/data_process/qa_search_train_merge.py
and qa_search_test_merge.py write (read at Search-R1 a14dc3a; its data_process.sh runs them with
nq,hotpotqa and nq,triviaqa,popqa,hotpotqa,2wikimultihopqa,musique,bamboogle), row for row:

    id, question, golden_answers     FlashRAG's, kept (ids repeat across sources: train_0 ...)
    question                         stripped, "?" appended unless it ends with one
    data_source                      the dataset's name ("nq", "hotpotqa", ...)
    prompt                           [{"role": "user", "content": make_prefix(question)}]
    ability, reward_model            "fact-reasoning", {"style": "rule", "ground_truth": {"target": golden}}
    extra_info                       {"split": "train" | "test", "index": row within its source}
    metadata                         last column; null for a source without it (nq, triviaqa, bamboogle)

Each test benchmark uses its test split, else dev, else train (the test script's rule: hotpotqa,
2wikimultihopqa and musique have no test split, so their dev split is the "test" set). The merge
scripts read the same files through the `datasets` library; this reads the jsonl directly, so it
needs neither `datasets` nor the network. Each input is checked as training checks it
(trainer.questions.load_questions: a bad line names file:line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from agent.protocols import SEARCH_R1_PREFIX, search_r1_question
from trainer.config import DataError, shown
from trainer.fsync import write_file
from trainer.questions import load_questions, question_lines, unreadable

TRAIN = ("nq", "hotpotqa")  # Search-R1 §4: NQ + HotpotQA training sets (scripts/nq_hotpotqa/data_process.sh)
TEST = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")  # its Table 2's seven
SPLIT_ORDER = {"train": ("train",), "test": ("test", "dev", "train")}  # qa_search_test_merge.py's choice


def source_file(flashrag: Path, dataset: str, split: str) -> Path:
    """The FlashRAG file a split of `dataset` comes from (the test split: test, else dev, else train).
    A name that is there but cannot be read (a broken symlink, a symlink loop, a directory) is a
    DataError naming it: passed over, the test parquet would be built from the train split."""
    for name in SPLIT_ORDER[split]:
        path = flashrag / dataset / f"{name}.jsonl"
        if os.path.lexists(path):
            if why := unreadable(path):
                raise DataError(f"{path}: cannot read it ({why}); fix or remove it (the {split} split would "
                                "otherwise come from another file)")  # fmt: skip
            return path
    tried = " or ".join(f"{dataset}/{name}.jsonl" for name in SPLIT_ORDER[split])
    raise FileNotFoundError(f"{flashrag}: no {tried} (download RUC-NLPIR/FlashRAG_datasets, README 'Search-R1 "
                            "from its released files')")  # fmt: skip


def search_r1_rows(path: Path, dataset: str, split: str) -> list[dict]:
    """One FlashRAG file as the merge scripts' rows (module docstring), in the file's order.

    >>> search_r1_rows(Path("flashrag/nq/test.jsonl"), "nq", "test")[0]  # doctest: +SKIP
    {'id': 'test_0', 'question': 'who got the first nobel prize in physics?', 'golden_answers': [...],
     'data_source': 'nq', 'prompt': [{'role': 'user', 'content': 'Answer the given question. ... Question:
     who got the first nobel prize in physics?\\n'}], 'ability': 'fact-reasoning', 'reward_model': {'style':
     'rule', 'ground_truth': {'target': [...]}}, 'extra_info': {'split': 'test', 'index': 0}, 'metadata': None}
    """
    rows = []
    for index, q in enumerate(load_questions(path)):
        question = search_r1_question(q["question"])
        rows.append({
            "id": q["id"], "question": question, "golden_answers": q["golden_answers"], "data_source": dataset,
            "prompt": [{"role": "user", "content": SEARCH_R1_PREFIX.format(question=question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": q["golden_answers"]}},
            "extra_info": {"split": split, "index": index},
            "metadata": q["metadata"] or None,  # load_questions reads a missing one as {}
        })  # fmt: skip
    return rows


def check_ids(rows: list[dict], path: Path, first: tuple[type, Path, int] | None) -> tuple[type, Path, int]:
    """One parquet column holds one type: every id of a split is text, or every one an integer that
    fits int64. An id that breaks this is a DataError naming path:line, before anything is written
    (Arrow's own error came after a line blaming the metadata). `first`: the split's first id type,
    its file and row; returns it."""
    line = lambda p, i: f"{p}:{question_lines(p)[i]}"  # noqa: E731  (read again only to name a bad row)
    for i, qid in enumerate(r["id"] for r in rows):
        if isinstance(qid, int) and not -(2**63) <= qid < 2**63:
            raise DataError(f"{line(path, i)}: id {qid} does not fit a parquet int64 column; write it as text")
        if first is None:
            first = (type(qid), path, i)
        elif type(qid) is not first[0]:
            kind = {str: "text", int: "an integer"}
            raise DataError(f"{line(path, i)}: id {shown(qid)} is {kind[type(qid)]}, but the id at "
                            f"{line(*first[1:])} is {kind[first[0]]}: one parquet column holds one type; write "
                            "every id as text")  # fmt: skip
    return first


def write_parquet(rows: list[dict], path: Path) -> None:
    """Rows -> parquet, metadata as one struct over every source's fields (a field a source lacks is
    null), as `datasets.concatenate_datasets` merges them. Metadata whose fields disagree in type
    across sources cannot be one struct: it is written as JSON text, which load_questions reads too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        print(f"{path.name}: metadata fields differ in type across sources ({str(e).splitlines()[0]}); "
              "writing metadata as JSON text", flush=True)  # fmt: skip
        table = pa.Table.from_pylist([r | {"metadata": json.dumps(r["metadata"])} for r in rows])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, lambda tmp: pq.write_table(table, tmp))  # whole or not at all
    except OSError as e:  # --out under a file, read-only, a full disk: one line, not mkdir's traceback
        raise DataError(f"cannot write {path} (--out): {e.strerror or e}"
                        + (f": {e.filename}" if e.filename else "")) from None  # fmt: skip


def prepare(flashrag: Path, out: Path, train: list[str], test: list[str]) -> dict[str, int]:
    """train.parquet and test.parquet under `out`; returns rows per file. Every input is found and
    checked before anything is written."""
    files = {split: [(d, source_file(flashrag, d, split)) for d in names]
             for split, names in (("train", train), ("test", test)) if names}  # fmt: skip
    if os.path.lexists(out) and not out.is_dir():  # before reading 170k rows, not after
        raise DataError(f"--out {out} is not a directory")
    counts = {}
    for split, sources in files.items():
        rows = []
        first: tuple[type, Path, int] | None = None  # the id type of the split's first row, and where it is
        for dataset, path in sources:
            part = search_r1_rows(path, dataset, split)
            first = check_ids(part, path, first)
            print(f"  {split}: {dataset:<16} {len(part):>7} rows from {path}", flush=True)
            rows += part
        write_parquet(rows, out / f"{split}.parquet")
        counts[split] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flashrag", required=True, help="folder of FlashRAG's <dataset>/<split>.jsonl files")
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train", default=",".join(TRAIN), help="datasets of train.parquet, in order "
                        "(default nq,hotpotqa; empty: none)")  # fmt: skip
    parser.add_argument("--test", default=",".join(TEST), help="datasets of test.parquet, in order "
                        "(default the seven of Search-R1 Table 2; empty: none)")  # fmt: skip
    args = parser.parse_args(argv)
    names = lambda text: [n.strip() for n in text.split(",") if n.strip()]  # noqa: E731
    try:
        counts = prepare(Path(args.flashrag), Path(args.out), names(args.train), names(args.test))
    except (DataError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    for split, n in counts.items():
        print(f"wrote {Path(args.out) / f'{split}.parquet'} ({n} rows)")


if __name__ == "__main__":
    main()
