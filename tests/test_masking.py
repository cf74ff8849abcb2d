"""Retrieved-token masking (Search-R1 §3.1): only policy tokens are ever trained.

The engine here is a *scripted* generator that replays fixed completions: it isolates the
rollout bookkeeping (what is masked) from sampling. Real-engine rollouts are covered in
test_rollout_engines.py.
"""

import torch

from rollout import rollout_batch
from tiny.sft import build_tiny_model, train_tokenizer
from trainer.config import Config
from trainer.engine import Completion
from trainer.grpo import grpo_step

TURNS = ["<think> find P</think><search> P born</search>", "<think> it is C</think><answer> C</answer>"]


class ScriptedEngine:
    def __init__(self, tokenizer):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in TURNS]
        self.calls = 0

    def generate(self, prompts, max_tokens, temperature, top_p, stop, seeds=None):
        ids = self.turns[min(self.calls, len(self.turns) - 1)]  # one call per turn
        self.calls += 1
        return [Completion(list(ids), [-0.5] * len(ids), "stop") for _ in prompts]


def setup(tmp_path):
    tok = train_tokenizer(["P was born in the city of C. Doc Title info " * 20] * 20, 300, tmp_path)
    torch.manual_seed(0)
    cfg = Config()
    cfg.model.hidden_size, cfg.model.num_heads, cfg.model.num_layers, cfg.model.intermediate_size = 64, 1, 1, 128
    model = build_tiny_model(cfg.model, tok)
    return tok, cfg, model, ScriptedEngine(tok)


def roll(tok, cfg, engine, result_text):
    q = {"id": "q1", "question": "Where was P born?", "golden_answers": ["C"]}
    engine.calls = 0
    return rollout_batch(engine, tok, [q], 1, lambda qs: [result_text] * len(qs), cfg.rollout)[0]


def trained_positions(model, record, cfg, tok):
    """Positions t (in prompt+response) whose *predicting* logits get a non-zero gradient."""
    captured = {}

    def hook(_module, _inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.lm_head.register_forward_hook(hook)
    record = dict(record, advantage=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grpo_step(model, None, [record], opt, cfg, tok.pad_token_id)
    handle.remove()
    grad = captured["logits"].grad[0]  # (K, V): the last K positions' logits; position p predicts token p + 1
    # the update asks for no logits before the first response token's predicting position (logits_to_keep)
    offset = len(record["prompt_ids"]) + len(record["response_ids"]) - grad.shape[0]
    assert offset == len(record["prompt_ids"]) - 1
    # exact zeros: a masked position's loss term is multiplied by a 0 mask, so its gradient is
    # exactly 0, not merely small
    return [offset + j + 1 for j in range(grad.shape[0]) if grad[j].abs().sum() > 0]


def test_gradient_is_exactly_zero_on_prompt_and_retrieved_tokens(tmp_path):
    tok, cfg, model, engine = setup(tmp_path)
    r = roll(tok, cfg, engine, "Doc 1(Title: P) P was born in the city of C.")
    assert r["finish"] == "answer" and r["answer"] == "C" and r["num_searches"] == 1
    n_prompt = len(r["prompt_ids"])
    policy_positions = [n_prompt + i for i, m in enumerate(r["loss_mask"]) if m]
    assert len(policy_positions) == sum(len(tok.encode(t, add_special_tokens=False)) for t in TURNS)
    assert trained_positions(model, r, cfg, tok) == policy_positions
    # the information block, tags included, is all zeros in the mask
    info = [i for i, c in enumerate(r["chunks"]) if c["role"] == "tool"][0]
    chunk = r["chunks"][info]
    assert chunk["text"].startswith("\n<information>") and chunk["text"].endswith("</information>\n")
    assert set(r["loss_mask"][chunk["start"] : chunk["end"]]) == {0}


def test_changing_retrieved_text_changes_context_not_trained_positions(tmp_path):
    tok, cfg, model, engine = setup(tmp_path)
    a = roll(tok, cfg, engine, "Doc 1(Title: P) P was born in the city of C.")
    b = roll(tok, cfg, engine, "Doc 1(Title: Q) Info info info.")
    assert a["response_ids"] != b["response_ids"]
    policy = lambda r: [t for t, m in zip(r["response_ids"], r["loss_mask"]) if m]  # noqa: E731
    assert policy(a) == policy(b)  # the same policy tokens, kept exactly as generated
    a_pos, b_pos = trained_positions(model, a, cfg, tok), trained_positions(model, b, cfg, tok)
    n = len(a["prompt_ids"])
    assert [p - n for p in a_pos] == [i for i, m in enumerate(a["loss_mask"]) if m]
    assert [p - n for p in b_pos] == [i for i, m in enumerate(b["loss_mask"]) if m]


def test_no_mask_ablation_trains_retrieved_tokens_too(tmp_path):
    tok, cfg, model, engine = setup(tmp_path)
    cfg.train.mask_retrieved = False
    r = roll(tok, cfg, engine, "Doc 1(Title: P) P was born in the city of C.")
    n = len(r["prompt_ids"])
    assert trained_positions(model, r, cfg, tok) == list(range(n, n + len(r["response_ids"])))
