"""Credit per search step (trainer/turns.py): a turn reward lands on its own turn's policy tokens,
in GRPO's loss and in PPO's token rewards, never on retrieved tokens; without turn rewards the
update is bit-identical to the outcome-only one. The tiny Qwen2 and the scripted two-turn rollout
(a search, then an answer) are test_masking.py's."""

import pytest
import torch
from test_masking import roll, setup

from trainer.grpo import grpo_step
from trainer.ppo import ppo_advantages
from trainer.turns import grpo_turn_advantages, has_turn_rewards, last_token_positions, turn_spans, turn_terms

DOC = "Doc 1(Title: P) P was born in the city of C."


def _gradient_rows(model, records, cfg, tok) -> list[list[int]]:
    """Per record (each in an update of its own, its per-token advantages as given), the positions
    t (in prompt + response) whose predicting logits get a gradient; exact zeros elsewhere."""
    out, captured = [], {}

    def hook(_module, _inputs, output):
        if output.requires_grad:  # the update's forward, not the no-gradient pass of pi_old
            output.retain_grad()
            captured["logits"] = output

    for r in records:
        handle = model.lm_head.register_forward_hook(hook)
        grpo_step(model, None, [r], torch.optim.SGD(model.parameters(), lr=0.0), cfg, tok.pad_token_id)
        handle.remove()
        grad = captured["logits"].grad[0]
        offset = len(r["prompt_ids"]) + len(r["response_ids"]) - grad.shape[0]
        out.append([offset + j + 1 for j in range(grad.shape[0]) if grad[j].abs().sum() > 0])
    return out


def _two_rollouts(tmp_path):
    tok, cfg, model, engine = setup(tmp_path)
    cfg.train.kl_coef = 0.0
    cfg.train.recompute_old_logprobs = True  # ratio 1: no token clips, so every scored token has a gradient
    first, second = roll(tok, cfg, engine, DOC), roll(tok, cfg, engine, DOC)
    for r in (first, second):
        r["group_id"] = "q1"
        r["advantage"] = 0.0  # both answered alike: no outcome signal, so any gradient is the turn term's
    return tok, cfg, model, [first, second]


def test_a_turn_reward_trains_exactly_that_turns_policy_tokens(tmp_path):
    tok, cfg, model, records = _two_rollouts(tmp_path)
    r = records[0]
    spans = turn_spans(r)
    assert len(spans) == 2 and [c["role"] for c in r["chunks"]] == ["policy", "tool", "policy"]
    records[0]["turn_rewards"], records[1]["turn_rewards"] = [1.0, None], [0.0, None]  # the search turn only
    for rec, adv in zip(records, grpo_turn_advantages(records, [0.0, 0.0], 1.0)):
        rec["advantages"] = adv
    n = len(r["prompt_ids"])
    search_turn = [n + j for j in range(*spans[0]) if r["loss_mask"][j]]
    assert search_turn and set(r["loss_mask"][spans[0][1] : spans[1][0]]) == {0}  # retrieved tokens between
    assert _gradient_rows(model, records, cfg, tok) == [search_turn, search_turn]
    # the answer turn's reward lands on the answer turn alone, and a retrieved token never trains
    records[0]["turn_rewards"], records[1]["turn_rewards"] = [None, 1.0], [None, 0.0]
    for rec, adv in zip(records, grpo_turn_advantages(records, [0.0, 0.0], 1.0)):
        rec["advantages"] = adv
    answer_turn = [n + j for j in range(*spans[1]) if r["loss_mask"][j]]
    assert _gradient_rows(model, records, cfg, tok) == [answer_turn, answer_turn]


def test_without_turn_rewards_the_loss_is_bit_identical(tmp_path):
    """No turn reward (or only None, or equal ones: a normalised term of exactly 0) leaves every
    per-token advantage A_i, so grpo_step's loss and gradient are the outcome-only bits."""
    tok, cfg, model, records = _two_rollouts(tmp_path)
    records[0]["advantage"], records[1]["advantage"] = 0.7071, -0.7071
    assert not has_turn_rewards(records)

    def loss_and_grad(recs):
        model.zero_grad()
        stats = grpo_step(model, None, recs, torch.optim.SGD(model.parameters(), lr=0.0), cfg, tok.pad_token_id)
        return stats["loss"], [p.grad.clone() for p in model.parameters() if p.grad is not None]

    base_loss, base_grad = loss_and_grad(records)
    for turn_rewards in ([[None, None], [None, None]], [[0.5, None], [0.5, None]]):
        recs = [dict(r, turn_rewards=t) for r, t in zip(records, turn_rewards)]
        for rec, adv in zip(recs, grpo_turn_advantages(recs, [r["advantage"] for r in records], 1.0)):
            rec["advantages"] = adv
        loss, grad = loss_and_grad(recs)
        assert loss == base_loss and all(torch.equal(a, b) for a, b in zip(grad, base_grad))


def test_turn_terms_pool_the_group_or_compare_each_turn_index():
    rewards = [[1.0, 0.0], [0.0], [None, 1.0]]
    pooled = turn_terms(rewards, ["q", "q", "q"], "group")
    assert pooled[2][0] is None
    assert pooled[0][0] == pytest.approx(pooled[2][1]) and pooled[0][1] == pytest.approx(pooled[1][0])
    assert sum(v for row in pooled for v in row if v is not None) == pytest.approx(0.0, abs=1e-9)
    per_index = turn_terms(rewards, ["q", "q", "q"], "turn_index")
    assert per_index[0][0] > 0 > per_index[1][0]  # the first turns: 1 against 0
    assert per_index[0][1] < 0 < per_index[2][1]  # the second turns: 0 against 1
    assert turn_terms([[1.0], [0.0]], ["a", "b"], "group") == [[0.0], [0.0]]  # another group is no baseline


def test_ppo_puts_a_turn_reward_at_that_turns_last_policy_token(tmp_path):
    tok, cfg, model, records = _two_rollouts(tmp_path)
    r = records[0]
    r["turn_rewards"] = [2.0, None]
    (pos, reward), = [(p, 2.0) for p in last_token_positions(r)[:1]]
    n = len(r["prompt_ids"])
    start, end = turn_spans(r)[0]
    assert pos == n + end - 2  # the position predicting the search turn's last token
    width = n + len(r["response_ids"]) - 1
    values = [torch.zeros(width)]
    adv, _ = ppo_advantages([r], values, [0.0], whiten_advantages=False, turn_rewards=[[(pos, reward)]])
    mask = [0] * n + r["loss_mask"]
    policy = [t - 1 for t in range(1, width + 1) if mask[t]]
    first_turn = [t for t in policy if t <= pos]
    assert first_turn and all(float(adv[0][t]) == 2.0 for t in first_turn)  # gamma = lambda = 1: the reward to go
    assert all(float(adv[0][t]) == 0.0 for t in policy if t > pos)  # the answer turn: nothing after it
    plain, _ = ppo_advantages([r], values, [0.0], whiten_advantages=False)
    assert torch.equal(plain[0], torch.zeros(width))
