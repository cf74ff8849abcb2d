"""GRPO math against the formulas of docs/design.md §4, worked by hand."""

import math

import pytest
import torch
from numerics import EPS32, FP32_FORMULA, assert_close, ops_rtol

from agent.answers import parsed
from trainer.batching import accumulating
from trainer.grpo import group_advantages, grpo_token_loss, k3_kl


def test_group_advantages_by_hand():
    adv = group_advantages([1, 0, 0, 1, 0.5, 0.5], ["a"] * 4 + ["b"] * 2)
    std = math.sqrt((4 * 0.25) / 3) + 1e-6  # unbiased std of [1, 0, 0, 1], + group_advantages' eps
    # float64 both sides, a few ops: equal up to ~1e-16; approx's default is rel 1e-6, abs 1e-12
    assert adv[:4] == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert adv[4:] == [0.0, 0.0]  # equal rewards: no signal


@pytest.mark.numeric
def test_k3_matches_formula_and_is_clamped():
    logp = torch.tensor([-1.0, -2.0, -0.5, -30.0])
    ref = torch.tensor([-1.0, -1.5, -0.7, -1.0])
    d = ref - logp
    expected = (torch.exp(d) - d - 1).clamp(-10, 10)
    assert_close(k3_kl(logp, ref), expected, rtol=FP32_FORMULA, atol=FP32_FORMULA, what="k3")
    assert k3_kl(logp, ref)[0] == 0 and k3_kl(logp, ref)[3] == 10


@pytest.mark.numeric
def test_clip_by_hand():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5]))  # ratios
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, _, clipped = grpo_token_loss(logp, old, adv, None, 0.2, 0.0)
    # A>0: min(1.5, 1.2) = 1.2 ; min(0.5, 0.8) = 0.5 ; A<0: min(-1.5, -1.2) = -1.5 ; min(-0.5,-0.8) = -0.8
    assert_close(loss, [-1.2, -0.5, 1.5, 0.8], rtol=FP32_FORMULA, atol=FP32_FORMULA, what="clipped loss")
    assert clipped.tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.numeric
def test_kl_estimators_match_the_formulas():
    from trainer.grpo import kl_estimate

    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = logp - ref  # log pi - log ref
    for kind, formula in (("k1", d), ("k2", 0.5 * d**2), ("k3", torch.exp(-d) + d - 1)):
        assert_close(kl_estimate(logp, ref, kind), formula, rtol=FP32_FORMULA, atol=FP32_FORMULA, what=kind)
    # all three estimate KL(p || q) = E_p[log p - log q]: check on a sampled categorical
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    exact = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    # sampling error, not rounding: the per-sample estimates' std (~0.65 for k1, less for k3)
    # over sqrt(200_000) is 1.5e-3; 0.01 is > 6 standard errors (and the seed is fixed)
    for kind, tol in (("k1", 0.01), ("k3", 0.01)):
        assert float(kl_estimate(p.log()[x], q.log()[x], kind).mean()) == pytest.approx(exact, abs=tol), kind


def test_std_normalisation_options():
    rewards, groups = [1, 0, 0, 1, 1, 1], ["a"] * 4 + ["b"] * 2
    assert group_advantages(rewards, groups, std="none") == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]
    batch_std = torch.tensor(rewards, dtype=torch.float64).std().item() + 1e-6  # + group_advantages' eps
    # float64 both sides, a few ops: equal up to ~1e-16; approx's default is rel 1e-6, abs 1e-12
    assert group_advantages(rewards, groups, std="batch") == pytest.approx(
        [0.5 / batch_std, -0.5 / batch_std, -0.5 / batch_std, 0.5 / batch_std, 0.0, 0.0]
    )


@pytest.mark.numeric
def test_clip_higher_and_dual_clip_by_hand():
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.25, 5.0, 0.5]))
    adv = torch.tensor([1.0, -1.0, -1.0])
    sym, _, sym_clipped = grpo_token_loss(logp, old, adv, None, 0.2, 0.0)
    # A>0, rho 1.25: symmetric clips at 1.2 ; A<0, rho 5: max(5, 1.2) = 5 ; rho 0.5: max(0.5, 0.8) = 0.8
    tol = {"rtol": FP32_FORMULA, "atol": FP32_FORMULA}  # fp32 log, exp, clip, product vs the float64 value
    assert_close(sym, [-1.2, 5.0, 0.8], **tol, what="symmetric clip")
    high, _, _ = grpo_token_loss(logp, old, adv, None, 0.2, 0.0, clip_eps_high=0.28)
    assert_close(high, [-1.25, 5.0, 0.8], **tol, what="clip-higher")  # 1.25 < 1.28: not clipped
    dual, _, dual_clipped = grpo_token_loss(logp, old, adv, None, 0.2, 0.0, dual_clip=3.0)
    assert_close(dual, [-1.2, 3.0, 0.8], **tol, what="dual clip")  # the bad token's loss capped at c |A| = 3
    assert dual_clipped.tolist() == [1.0, 1.0, 1.0] and sym_clipped.tolist() == [1.0, 0.0, 1.0]
    ratio = torch.tensor([5.0], requires_grad=True)
    loss, _, _ = grpo_token_loss(ratio.log(), torch.zeros(1), torch.tensor([-1.0]), None, 0.2, 0.0, dual_clip=3.0)
    loss.sum().backward()
    assert ratio.grad.item() == 0.0  # capped: no gradient through the huge ratio


@pytest.mark.numeric
def test_truncated_importance_weight_corrects_the_policy_term_only():
    # issue 23.9: w * pg + beta * kl, not w * (pg + beta * kl)
    logp = old = torch.log(torch.tensor([0.5, 0.5]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    adv, w = torch.tensor([1.0, -1.0]), torch.tensor([2.0, 0.5])
    loss, kl, _ = grpo_token_loss(logp, old, adv, ref, 0.2, 0.1, is_weight=w)
    k3 = (0.5 - math.log(0.5) - 1, 0.0)  # exp(ref - logp) - (ref - logp) - 1
    # fp32 log, exp and a few products vs float64; the floor: k3 cancels terms of size ~1 to 0.19
    assert_close(kl, k3, rtol=FP32_FORMULA, atol=FP32_FORMULA, what="k3")
    assert_close(loss, [2.0 * -1.0 + 0.1 * k3[0], 0.5 * 1.0 + 0.0], rtol=FP32_FORMULA, atol=FP32_FORMULA,
                 what="is-weighted loss")  # fmt: skip


def test_loss_aggregation_modes_by_hand():
    from trainer.grpo import loss_weights

    # two rollouts with 1 and 3 policy tokens, per-token losses l = [2] and [1, 1, 4]
    losses = [[2.0], [1.0, 1.0, 4.0]]
    lengths = [1, 3]

    def agg(mode, norm=10):
        w = loss_weights(lengths, mode, norm)
        return sum(wi * sum(li) for wi, li in zip(w, losses))

    # float64 sums of a few terms: equal up to ~1e-16; approx's default is rel 1e-6, abs 1e-12
    assert agg("token-mean") == pytest.approx(8 / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((2 / 1 + 6 / 3) / 2)
    assert agg("seq-mean-token-sum-norm") == pytest.approx((2 / 10 + 6 / 10) / 2)


def test_entropy_bonus_raises_entropy_when_advantages_are_zero(tmp_path):
    from test_masking import setup

    from trainer.grpo import grpo_step

    tok, cfg, model, _ = setup(tmp_path)
    ids = tok.encode("<think> P was born in the city of C.</think>", add_special_tokens=False)
    record = {"prompt_ids": ids[:3], "response_ids": ids[3:], "loss_mask": [1] * len(ids[3:]),
              "logprobs": [0.0] * len(ids[3:]), "advantage": 0.0}  # fmt: skip
    cfg.train.kl_coef = 0.0
    cfg.train.entropy_coef = 1.0
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = grpo_step(model, None, [record], opt, cfg, tok.pad_token_id)["entropy"]
    after = grpo_step(model, None, [record], opt, cfg, tok.pad_token_id)["entropy"]
    assert after > before  # with A = 0 the only gradient is the entropy bonus's
    cfg.train.entropy_coef = 0.0
    opt.zero_grad()
    stats = grpo_step(model, None, [record], torch.optim.SGD(model.parameters(), lr=0.0), cfg, tok.pad_token_id)
    assert stats["grad_norm"] == 0.0  # and without it there is none: every token's loss is -0 * rho, exactly


def test_unknown_choice_names_the_key():
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="'train.loss_agg' must be one of token-mean"):
        load_config(None, ["train.loss_agg=sequence-mean"])
    with pytest.raises(ConfigError, match="'train.kl_estimator'"):
        load_config(None, ["train.kl_estimator=k4"])


@pytest.mark.numeric
def test_kl_in_reward_sums_the_estimate_over_policy_tokens(tmp_path):
    from test_masking import setup

    from trainer.batching import pad_batch, token_logprobs
    from trainer.grpo import kl_penalties

    tok, cfg, model, _ = setup(tmp_path)
    ids = tok.encode("<think> P was born in the city of C.</think>", add_special_tokens=False)
    a, b = pad_batch([ids], [[1] * len(ids)], tok.pad_token_id)[:2]
    with torch.no_grad():
        true = token_logprobs(model, a, b)[0].tolist()
    n_prompt = 3
    mask = [1, 0] * ((len(ids) - n_prompt) // 2) + [1] * ((len(ids) - n_prompt) % 2)  # every other token
    logprobs = [lp + 0.1 for lp in true[n_prompt - 1 :]]  # pi_old = ref + 0.1 on every token
    record = {"prompt_ids": ids[:n_prompt], "response_ids": ids[n_prompt:], "loss_mask": mask, "logprobs": logprobs}
    # Each token's 0.1 comes back as fp32(lp + 0.1) - lp, the reference recomputed by the same
    # forward pass: rounded at |lp| (2 roundings); k3's slope there is 1 - e^-0.1 < 0.1, and k3
    # itself cancels terms of size 1 (3 roundings). The sum over tokens is a float64 one.
    n, shift = sum(mask), 2 * EPS32 * max(abs(x) + 0.1 for x in true)
    cfg.train.kl_estimator = "k1"
    assert_close(kl_penalties(model, [record], cfg, tok.pad_token_id)[0], 0.1 * n, rtol=0, atol=n * shift,
                 what="k1 sum")  # fmt: skip
    cfg.train.kl_estimator = "k3"
    k3 = math.exp(-0.1) + 0.1 - 1
    assert_close(kl_penalties(model, [record], cfg, tok.pad_token_id)[0], k3 * n, rtol=0,
                 atol=n * (0.1 * shift + ops_rtol(3)), what="k3 sum")  # fmt: skip


def _records_with(model, tok, engine_shift: float, advantages=(1.0, -1.0, 0.5, -0.5)):
    """Rollouts whose engine logprobs are the model's own + engine_shift (a vLLM/trainer gap)."""
    from trainer.batching import pad_batch, token_logprobs

    records = []
    for k, adv in enumerate(advantages):
        ids = tok.encode(f"<think> P{k} was born in the city of C{k}.</think>", add_special_tokens=False)
        a, b = pad_batch([ids], [[1] * len(ids)], tok.pad_token_id)[:2]
        with torch.no_grad():
            true = token_logprobs(model, a, b)[0].tolist()
        records.append({"prompt_ids": ids[:3], "response_ids": ids[3:], "loss_mask": [1] * len(ids[3:]),
                        "logprobs": [lp + engine_shift for lp in true[2:]], "advantage": adv,
                        "group_id": "q"})  # fmt: skip
    return records


@pytest.mark.numeric
def test_old_logprobs_recomputed_by_the_trainer_and_importance_correction(tmp_path):
    from test_masking import setup

    from trainer.grpo import grpo_step

    tok, cfg, model, _ = setup(tmp_path)
    cfg.train.kl_coef = 0.0
    frozen = torch.optim.SGD(model.parameters(), lr=0.0)
    records = _records_with(model, tok, engine_shift=-0.5, advantages=(1.0,))
    # pi_old from the engine: ratio = exp(0.5) = 1.65 > 1.2, so every token clips
    assert grpo_step(model, None, records, frozen, cfg, tok.pad_token_id)["clip_frac"] == 1.0  # a count ratio
    cfg.train.recompute_old_logprobs = True  # pi_old from the trainer: ratio 1, loss = -A
    stats = grpo_step(model, None, records, frozen, cfg, tok.pad_token_id)
    # pi_old and pi_theta: the same forward pass on the same batch, so ratio = exp(0) = 1; the
    # token-mean of -A sums in float64
    assert stats["clip_frac"] == 0.0
    assert_close(stats["loss"], -1.0, rtol=0, atol=FP32_FORMULA, what="loss at ratio 1")
    # truncated importance weight min(pi_trainer / pi_engine, C) = min(e^0.5, C). The engine's
    # logprobs lp - 0.5 are rounded to fp32 at |lp| (2 roundings), exp(0.5 + that) keeps it as a
    # relative error, and the ratio, clip, product and mean add a few roundings more.
    lp_max = max(abs(x) for r in records for x in r["logprobs"])
    for cap, weight in ((1.2, 1.2), (3.0, math.exp(0.5))):
        cfg.train.is_correction = cap
        loss = grpo_step(model, None, records, frozen, cfg, tok.pad_token_id)["loss"]
        assert_close(loss, -weight, rtol=2 * EPS32 * lp_max + FP32_FORMULA, atol=FP32_FORMULA,
                     what=f"IS-corrected loss, cap {cap}")  # fmt: skip


def test_epochs_times_mini_batches_optimizer_steps(tmp_path):
    from test_masking import setup

    from trainer.grpo import grpo_step

    tok, cfg, model, _ = setup(tmp_path)
    cfg.train.kl_coef = 0.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = []
    original = opt.step
    opt.step = lambda *a, **k: (steps.append(1), original(*a, **k))[1]
    records = _records_with(model, tok, engine_shift=0.0)
    cfg.train.epochs, cfg.train.mini_batches = 2, 2
    stats = grpo_step(model, None, records, opt, cfg, tok.pad_token_id)
    assert len(steps) == 4
    assert 0.0 < stats["clip_frac"] < 1.0  # later updates move off-policy and some tokens clip


def test_lr_warmup_is_linear_then_constant():
    from trainer.config import load_config
    from trainer.grpo import lr_at

    cfg = load_config(None, ["train.steps=10", "train.warmup_frac=0.5", "train.lr=1.0"])
    assert [lr_at(s, cfg) for s in (0, 1, 4, 9)] == [0.2, 0.4, 1.0, 1.0]
    cfg.train.warmup_frac = 0.0
    assert lr_at(0, cfg) == 1.0


def test_lr_cosine_after_warmup():
    import math

    from trainer.config import load_config
    from trainer.grpo import lr_at

    cfg = load_config(None, ["train.steps=10", "train.warmup_frac=0.2", "train.lr=2.0", "train.lr_schedule=cosine"])
    lrs = [lr_at(s, cfg) for s in range(10)]
    assert lrs[:2] == [1.0, 2.0]  # warm-up, then the peak at step 1
    # from step 1 (the first at full lr): 2 * 0.5 * (1 + cos(pi (s - 1) / 9))
    # float64 both sides, the same few ops (cos of the same angle): equal up to ~1e-16
    assert all(abs(lrs[s] - (1 + math.cos(math.pi * (s - 1) / 9))) < 1e-12 for s in range(1, 10))
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:])) and 0 < lrs[-1] < 0.07


def test_rft_keeps_accepted_rollouts_and_one_idk_when_none_is_correct():
    from trainer.grpo import rft_select

    def rec(group, reward, answer):
        return {"group_id": group, "reward": reward, "response": f"<think>x</think><answer>{answer}</answer>"}

    records = [rec("a", 1.0, "Paris"), rec("a", 0.0, "Rome"), rec("a", 1.0, "Paris"),
               rec("b", 0.0, "Rome"), rec("b", 0.0, "I don't know"), rec("b", 0.0, "I don't know"),
               rec("c", 0.0, "Rome")]  # fmt: skip
    kept = rft_select(records, accept=1.0, idk=[parsed(r).idk for r in records])
    assert [(r["group_id"], r["reward"]) for r in kept] == [("a", 1.0), ("a", 1.0), ("b", 0.0)]
    assert "don't know" in kept[2]["response"]


def test_bapo_resampling_enlarges_the_group_in_the_plateau_stage_only():
    # issue 23.3: BAPO §4.2 resamples in the plateau stage, and App. B.2's new rollouts enlarge
    # the effective group (G, then up to G (k + 1)) instead of replacing it
    from sampling import resample_marked_groups
    from trainer.config import load_config

    def rec(qid: str, answer: str) -> dict:
        text = f"<think>x</think><answer>{answer}</answer>"
        return {"group_id": f"tiny:{qid}", "golden_answers": ["Velor"], "response": text}

    calls = []

    def roll_out(questions: list[dict], seed: int) -> list[dict]:  # the second try of q1 finds it
        calls.append(([q["id"] for q in questions], seed))
        return [rec(q["id"], "Velor" if len(calls) == 2 else "Kesh") for q in questions for _ in range(2)]

    questions = [{"id": "q1"}, {"id": "q2"}]
    first = [rec("q1", "Kesh"), rec("q1", "Zug"), rec("q2", "Velor"), rec("q2", "Kesh")]
    cfg = load_config(None, ["train.resample_groups=2"])
    assert resample_marked_groups(first, questions, roll_out, cfg, 0, "exploration") == (first, 0) and not calls
    records, count = resample_marked_groups(first, questions, roll_out, cfg, 0, "plateau")
    assert count == 2 and [ids for ids, _ in calls] == [["q1"], ["q1"]]  # q2 had a correct rollout
    assert [r["group_id"] for r in records].count("tiny:q1") == 6  # 2 + 2 + 2: the group grew
    assert records[:4] == first
    calls.clear()
    cfg = load_config(None, ["train.resample_groups=2", "train.resample_mode=replace", "train.resample_stage=always"])
    records, count = resample_marked_groups(first, questions, roll_out, cfg, 0, "exploration")
    assert count == 2 and [r["group_id"] for r in records].count("tiny:q1") == 2  # replaced each time


def test_exact_grad_sum_adds_micro_batch_gradients_in_float64_in_any_order():
    """One process, train.exact_grad_sum: the update's gradient is the float64 sum of the
    micro-batch gradients, rounded once. Gradients 1, 1e-8, -1: summed in float32 as torch
    accumulates them, the 1e-8 is lost (1 + 1e-8 == 1) and the order decides; in float64 it
    survives in every order."""
    def summed(order: list[float], exact: bool) -> float:
        w = torch.nn.Parameter(torch.zeros(()))
        for g in accumulating(torch.nn.ParameterList([w]), order, exact, world=1):
            (w * g).backward()
        return float(w.grad)

    # exact by construction: 1 - 1 = 0 and 0 + x = x in any precision, 1 + 1e-8 rounds to 1 in
    # float32 but not in float64, and float32(1e-8) is one rounding of 1e-8
    assert summed([1.0, 1e-8, -1.0], exact=False) == 0.0
    assert summed([1.0, -1.0, 1e-8], exact=False) == float(torch.tensor(1e-8))
    for order in ([1.0, 1e-8, -1.0], [1.0, -1.0, 1e-8], [1e-8, -1.0, 1.0]):
        assert summed(order, exact=True) == float(torch.tensor(1e-8)), order
