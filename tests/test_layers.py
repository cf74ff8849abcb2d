"""Imports run one way: each layer imports only what lies below it, at the top of the file.

    trainer/  <  search/  <  agent/  <  rollout.py, rewards.py  <  rollout_tree.py, report/  <  tiny/  <  data.py
              <  run_setup.py, sampling.py  <  the entry scripts (eval.py, retriever.py, ..., train.py)

trainer/ is the ground floor: the library every layer uses, importing nothing of the project above
it. tiny/ is the classroom's demo: only data.py (a run's inputs) and the entry scripts reach it.
An import inside a function would hide an edge from this test (and a cycle from readers), so the
project's own modules are imported at the top only. Tests and benchmarks stand above it all."""

import ast
from pathlib import Path

from conftest import ROOT

RANK = {"trainer": 0, "search": 1, "agent": 2, "rollout": 3, "rewards": 3, "rollout_tree": 4, "report": 4,
        "tiny": 5, "data": 6, "run_setup": 7, "sampling": 7, "eval": 8, "retriever": 8, "prepare_data": 8,
        "convert_gguf": 8, "train": 9, "reproduce": 9}  # fmt: skip


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        layer = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if layer in RANK:
            yield rel, layer, ast.parse(path.read_text())


def test_every_project_module_has_a_layer():
    top = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top - {"conftest"} <= set(RANK), sorted(top - set(RANK))


def test_no_import_runs_back_up_and_none_hides_in_a_function():
    upward, inner = [], []
    for rel, layer, tree in _modules():
        at_top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for root in {n.split(".")[0] for n in names} & set(RANK):
                if id(node) not in at_top:
                    inner.append(f"{rel}:{node.lineno} imports {root} inside a function")
                # the entry scripts may use each other's functions (train.py: eval.summarize)
                if root != layer and RANK[root] >= RANK[layer] and not (RANK[layer] >= 8 and RANK[root] >= 8):
                    upward.append(f"{rel}:{node.lineno} ({layer}) imports {root}, a layer above or beside it")
    assert not upward and not inner, upward + inner


def test_the_tiny_world_is_reached_only_from_data_py_and_the_entry_scripts():
    reach = {layer for rel, layer, tree in _modules() for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom)) and layer != "tiny"
             and any(n.split(".")[0] == "tiny" for n in ([a.name for a in node.names] if isinstance(node, ast.Import)
                                                         else [node.module or ""]))}  # fmt: skip
    assert reach <= {"data", "train", "reproduce", "eval", "retriever", "prepare_data"}, reach
    assert Path(ROOT / "data.py").is_file()
