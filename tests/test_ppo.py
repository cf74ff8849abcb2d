"""PPO pieces (trainer/ppo.py) against docs/design.md §4, a slow reference GAE and hand-worked numbers;
the critic on a tiny Qwen2 built here (no world, no tokenizer)."""

import random

import pytest
import torch
from numerics import EPS32, FP32_FORMULA, assert_close, assert_equal_bits, ops_rtol, sum_rtol

from trainer.ppo import (
    critic_optimizer,
    critic_step,
    critic_update,
    critic_values,
    gae,
    load_critic,
    policy_positions,
    ppo_advantages,
    save_critic,
    token_rewards,
    value_loss,
    whiten,
)

pytestmark = pytest.mark.numeric  # fp32 PPO math against float64 hand values, and critic forward passes


def reference_gae(rewards, values, mask, gamma, lam):
    """docs/design.md §4 GAE, slowly: walk the policy tokens of each row backwards,
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, V_next = A_next = 0
    after the last policy token. Only policy positions are filled in."""
    adv = torch.full_like(values, float("nan"))
    for b in range(values.shape[0]):
        steps = [t for t in range(values.shape[1]) if mask[b, t] > 0]
        v_next = a_next = 0.0
        for t in reversed(steps):
            delta = float(rewards[b, t]) + gamma * v_next - float(values[b, t])
            a_next = delta + gamma * lam * a_next
            v_next = float(values[b, t])
            adv[b, t] = a_next
    return adv


def random_batch(seed: int, batch: int = 5, width: int = 30):
    """Random rewards/values and masks: prompt zeros, a policy turn, an interior <information>
    run, a second policy turn, trailing padding (different lengths per row)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    mask = torch.zeros(batch, width)
    for b in range(batch):
        p = rng.randint(1, 5)
        turn1, info, turn2 = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6)
        mask[b, p : p + turn1] = 1
        mask[b, p + turn1 + info : p + turn1 + info + turn2] = 1
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g), mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9)])
def test_gae_matches_the_slow_formula(gamma, lam):
    for seed in range(3):
        rewards, values, mask = random_batch(seed)
        adv, ret = gae(rewards, values, mask, gamma, lam)
        ref = reference_gae(rewards, values, mask, gamma, lam)
        on = mask > 0
        # fp32 recursion vs float64: ~6 roundings per policy step (delta, gamma V, gamma lam A, the
        # adds), each at <= the largest intermediate; gamma lam <= 1 keeps older errors from growing
        steps = int(mask.sum(1).max())
        scale = float(ref[on].abs().max()) + 3 * float(torch.cat([rewards, values]).abs().max())
        tol = {"rtol": 0.0, "atol": ops_rtol(6 * steps) * scale}
        assert_close(adv[on], ref[on], **tol, what=f"GAE advantages, seed {seed}")
        assert_close(ret[on], (ref + values)[on], **tol, what=f"GAE returns, seed {seed}")


def test_gae_hand_example_advantage_is_return_minus_value():
    # p1 p2 [i1 i2] p3 p4, R = 1 on p4, gamma = lam = 1 (the trainer/ppo.py docstring example)
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    values = torch.tensor([[0.2, 0.4, 0.9, 0.9, 0.5, 0.7]])
    rewards = token_rewards(torch.tensor([1.0]), mask)
    adv, ret = gae(rewards, values, mask)
    # fp32, a few adds of numbers <= 1 vs the decimal values
    assert_close(adv[0], [0.8, 0.6, 0.5, 0.5, 0.5, 0.3], rtol=FP32_FORMULA, atol=FP32_FORMULA, what="advantages")
    assert_close(ret[0], [1.0] * 6, rtol=FP32_FORMULA, atol=FP32_FORMULA, what="returns")


def test_masked_positions_carry_through():
    rewards, values, mask = random_batch(7)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95)
    for b in range(mask.shape[0]):
        policy = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        for t in range(mask.shape[1]):
            if mask[b, t] == 0:
                after = [s for s in policy if s > t]
                want_a = float(adv[b, after[0]]) if after else 0.0
                want_r = float(ret[b, after[0]]) if after else 0.0
                # exact: a masked position gets the next policy token's values through torch.where
                # (a copy), and its return is the same fp32 add of the same two numbers
                assert (float(adv[b, t]), float(ret[b, t])) == (want_a, want_r)
    # values and rewards at masked positions (retrieved tokens, padding) are never read: torch.where
    # drops whatever was computed from them, so every kept number is the same ops on the same bits
    noisy_v = torch.where(mask > 0, values, torch.randn_like(values) * 100)
    noisy_r = torch.where(mask > 0, rewards, torch.randn_like(rewards) * 100)
    adv2, ret2 = gae(noisy_r, noisy_v, mask, 0.99, 0.95)
    assert_equal_bits(adv2, adv, what="advantages, noise at masked positions")
    assert_equal_bits(ret2, ret, what="returns, noise at masked positions")


def test_interior_block_bootstraps_from_the_next_policy_token():
    # gamma < 1: the information block is not discounted as time steps (one step, not three)
    mask = torch.tensor([[1.0, 0, 0, 0, 1]])
    values = torch.tensor([[0.1, 5.0, 5.0, 5.0, 0.6]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1.0]])
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    a_last = 1.0 - 0.6
    tol = {"rtol": FP32_FORMULA, "atol": FP32_FORMULA}  # fp32, a few ops on numbers <= 1
    assert_close(adv[0, 4], a_last, **tol, what="last advantage")
    assert_close(adv[0, 0], 0.5 * 0.6 - 0.1 + 0.25 * a_last, **tol, what="advantage across the block")


def test_token_rewards_score_on_last_policy_token_kl_on_policy_tokens():
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1], [0.0] * 8])
    kl = torch.full((3, 8), 2.0)
    r = token_rewards(torch.tensor([1.0, -1.0, 7.0]), mask, kl, kl_coef=0.1)
    tol = {"rtol": FP32_FORMULA, "atol": FP32_FORMULA}  # fp32 0.1 x 2, one add
    assert_close(r[0], [0, -0.2, -0.2, 0, 0, 1 - 0.2, 0, 0], **tol, what="token rewards, row 0")
    assert_close(r[1], [0, 0, -0.2, -0.2, -0.2, -0.2, -0.2, -1 - 0.2], **tol, what="token rewards, row 1")
    assert r[2].tolist() == [0.0] * 8  # no policy token: nowhere to put the score
    assert token_rewards(torch.tensor([1.0, -1.0, 7.0]), mask)[0].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]


def test_whiten_uses_masked_positions_only():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, -50.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    w = whiten(x, mask)
    on = w[mask > 0]  # [1, 2, 3, 4]: mean 2.5, unbiased var 5/3
    # fp32: the mean and var of 4 values <= 1.2 (a few roundings each; whiten's eps 1e-8 moves
    # the var by 6e-9), then the check's own mean and var
    tol = {"rtol": FP32_FORMULA, "atol": FP32_FORMULA}
    assert_close(on.mean(), 0.0, **tol, what="whitened mean")
    assert_close(on.var(), 1.0, **tol, what="whitened var")  # torch.var is unbiased
    assert_close(on, [(v - 2.5) / (5 / 3) ** 0.5 for v in (1, 2, 3, 4)], **tol, what="whitened values")
    # masked entries enter the sums as x * 0 = 0, which adds nothing: the same sums, bit for bit;
    # and the mean 10 / 4 = 2.5 is exact, so adding it back is the same add
    x2 = torch.where(mask > 0, x, torch.tensor(-1e4))
    assert_equal_bits(whiten(x2, mask)[mask > 0], on, what="whitened, other masked values")
    assert_equal_bits(whiten(x, mask, shift_mean=False)[mask > 0], on + 2.5, what="whitened, mean kept")


def test_value_loss_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token 0: v = 0.2, R = 1: inside the clip, 0.5 * 0.8^2 = 0.32
    # token 1: v = 2.0, R = 0: clip(2, -.5, .5) = .5 -> max(4, .25) = 4 -> 2.0 (unclipped wins)
    # token 2: masked
    tol = {"rtol": FP32_FORMULA, "atol": FP32_FORMULA}  # fp32: a few products and a mean of 2
    loss, frac = value_loss(torch.tensor([[0.2, 2.0, 9.0]]), old, torch.tensor([[1.0, 0.0, 0.0]]), mask)
    assert_close(loss, (0.32 + 2.0) / 2, **tol, what="value loss")
    assert float(frac) == 0.0
    # v = 2.0, R = 3: clipped .5 -> (.5 - 3)^2 = 6.25 > (2 - 3)^2 = 1: clipping matters
    loss, frac = value_loss(torch.tensor([[0.2, 2.0, 9.0]]), old, torch.tensor([[1.0, 3.0, 0.0]]), mask)
    assert_close(loss, (0.32 + 0.5 * 6.25) / 2, **tol, what="clipped value loss")
    assert float(frac) == 0.5
    loss, frac = value_loss(torch.tensor([[0.2, 2.0, 9.0]]), old, torch.tensor([[1.0, 3.0, 0.0]]), mask, clip=10.0)
    assert_close(loss, (0.32 + 0.5) / 2, **tol, what="value loss, wide clip")
    assert float(frac) == 0.0


# ---------------------------------------------------------------------------------------------
# The critic on a tiny Qwen2 policy directory.

VOCAB = 128


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A tiny model is all overhead: with the 2 cores shared, 2 threads ran the learning test
    20-35x slower than 1 here (1.0-1.7 s vs 20-35 s for the 30 steps, side by side)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_policy")
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def make_records(n: int, seed: int = 0) -> list[dict]:
    """Records shaped like rollout.py's: prompt, policy turn, <information> block, policy turn."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 8))]
        t1, info, t2 = rng.randint(2, 6), rng.randint(2, 6), rng.randint(2, 6)
        response = [rng.randrange(1, VOCAB) for _ in range(t1 + info + t2)]
        records.append({"prompt_ids": prompt, "response_ids": response, "loss_mask": [1] * t1 + [0] * info + [1] * t2})
    return records


def randomise_head(critic, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.head.weight.copy_(torch.randn(critic.head.weight.shape, generator=g) * 0.3)
        critic.head.bias.fill_(0.1)


def head_atol(critic) -> float:
    """V = w . h + b under another batch shape (padded rows, other micro-batches): the head's sum of
    64 terms in another order, sum_rtol(64) of sum|w_k h_k| <= |w| |h|, with |h| = sqrt(64) = 8 after
    the final RMSNorm (weights 1 at init); and the backbone's reordered sums, which that norm
    scales to the same size: twice that."""
    return 2 * sum_rtol(64) * 8 * float(critic.head.weight.detach().norm())


def test_critic_shape_alignment_and_padding(policy_dir):
    critic = load_critic(policy_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert critic(ids, torch.ones_like(ids)).abs().max() == 0  # zero-initialised head: 0 * h + 0 is exactly 0
    randomise_head(critic)
    with torch.no_grad():
        v = critic(ids, torch.ones_like(ids))
        changed = ids.clone()
        changed[0, 3] = 99
        v2 = critic(changed, torch.ones_like(ids))
    assert v.shape == (1, 5)
    # V at t sees tokens <= t only. Exact: the same batch shape, so the same kernels; a matmul's row
    # reads no other row, and the causal mask makes later keys' weights exp(-inf) = 0 exactly
    assert_equal_bits(v[:, :3], v2[:, :3], what="values before the changed token")
    assert float((v[:, 3] - v2[:, 3]).abs().max()) > 100 * head_atol(critic)  # it sees the change
    records = make_records(5)
    batched = critic_values(critic, records, micro_batch_tokens=60, pad_id=0)
    single = critic_values(critic, records[:1], micro_batch_tokens=10_000, pad_id=0)
    for r, vals in zip(records, batched):
        assert vals.shape == (len(r["prompt_ids"]) + len(r["response_ids"]) - 1,)
    # padding does not change values: only the batch shape differs
    assert_close(batched[0], single[0], rtol=0, atol=head_atol(critic), what="values, padded vs alone")


def test_critic_save_load_round_trip(policy_dir, tmp_path):
    critic = load_critic(policy_dir)
    randomise_head(critic, seed=3)
    records = make_records(3)
    before = critic_values(critic, records, 200, 0)
    save_critic(critic, tmp_path / "ckpt")
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "critic"):
        after = critic_values(load_critic(path), records, 200, 0)
        # exact: safetensors stores the bits, and the same kernels run on them
        assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_critic_step_micro_batches_do_not_change_the_gradient(policy_dir):
    records = make_records(6, seed=1)
    results = []
    for budget in (10_000, 40):  # one micro-batch vs several
        critic = load_critic(policy_dir)
        randomise_head(critic)
        old = critic_values(critic, records, 10_000, 0)
        returns = [torch.ones_like(v) for v in old]
        opt = torch.optim.SGD(critic.parameters(), lr=0.1)
        stats = critic_step(critic, opt, records, old, returns, 0.5, budget, 0, grad_clip=1e9)
        results.append((stats, critic.head.weight.detach().clone()))
    (full, w_full), (micro, w_micro) = results
    # One micro-batch vs several: the values move by head_atol (another batch shape), so each
    # loss term 0.5 (V - R)^2 by |V - R| head_atol (|V - R| <= the largest one); the gradient, a
    # sum of (V - R) dV/dw, by about as much relative to its size at |V - R| ~ 1, plus its fp32
    # accumulation over micro-batches; SGD (lr 0.1) moves the head by lr times that.
    critic = load_critic(policy_dir)
    randomise_head(critic)
    vals = critic_values(critic, records, 10_000, 0)
    v_tol, gap = head_atol(critic), float((torch.cat(vals) - 1).abs().max())
    n_terms = len(torch.cat(vals))  # and the fp32 sum of its positive terms in another order
    assert_close(micro["value_loss"], full["value_loss"], rtol=sum_rtol(n_terms), atol=gap * v_tol,
                 what="value loss")  # fmt: skip
    g_rtol = 2 * v_tol + sum_rtol(len(records))
    assert_close(micro["critic_grad_norm"], full["critic_grad_norm"], rtol=g_rtol, atol=EPS32, what="grad norm")
    w0 = critic.head.weight.detach()  # the start of both runs: compare the steps w - w0 = -lr g
    assert_close(w_micro - w0, w_full - w0, rtol=g_rtol, atol=ops_rtol(2) * float(w0.abs().max()),
                 what="SGD step of the head")  # fmt: skip
    # and the reported loss is value_loss over the batch's policy tokens before the step
    masks = [torch.tensor(policy_positions(r), dtype=torch.float32) for r in records]
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    loss, _ = value_loss(cat(vals), cat(vals), cat([torch.ones_like(v) for v in vals]), cat(masks))
    # the same values (the same batch); only the sum of the n positive terms comes in another
    # order (per micro-batch, then float64), the floor one rounding of a term's size (~1)
    n = int(sum(m.sum() for m in masks))
    assert_close(full["value_loss"], loss, rtol=sum_rtol(n), atol=EPS32, what="reported value loss")


def test_critic_takes_epochs_times_mini_batches_steps_like_the_actor(policy_dir, monkeypatch):
    # issue 23.8: verl mini-batches the critic as the actor; one step per batch left it behind
    from trainer import ppo

    records = make_records(8, seed=5)
    critic = load_critic(policy_dir)
    randomise_head(critic)
    old = critic_values(critic, records, 10_000, 0)
    returns = [torch.ones_like(v) for v in old]
    opt = torch.optim.SGD(critic.parameters(), lr=0.05)
    sizes = []

    def counting(critic, optimizer, recs, *args):
        sizes.append(len(recs))
        return critic_step(critic, optimizer, recs, *args)

    monkeypatch.setattr(ppo, "critic_step", counting)
    stats = critic_update(critic, opt, records, old, returns, 0.5, 10_000, 0, 1.0, epochs=2, mini_batches=2, seed=7)
    assert sizes == [4, 4, 4, 4]  # 2 epochs x 2 mini-batches of 4 records
    assert stats["value_loss"] > 0 and stats["critic_grad_norm"] > 0


def test_critic_learns_the_returns(policy_dir):
    """The real learning check: on a fixed batch, 30 critic steps at lr 1e-3 (with V_old
    recomputed each step, as the trainer does each rollout) cut the value loss by > 50%.
    The returns differ by record (scores 1, 0, 0, 1), so the backbone must tell them apart."""
    torch.manual_seed(0)
    critic = load_critic(policy_dir)
    opt = critic_optimizer(critic, lr=1e-3)
    records = make_records(4, seed=2)
    values = critic_values(critic, records, 10_000, 0)
    _, returns = ppo_advantages(records, values, [1.0, 0.0, 0.0, 1.0])
    assert [float(r[policy_positions(rec).index(1)]) for r, rec in zip(returns, records)] == [1, 0, 0, 1]
    losses = []
    for _ in range(30):
        old = critic_values(critic, records, 10_000, 0)
        losses.append(critic_step(critic, opt, records, old, returns, 0.5, 10_000, 0, 1.0)["value_loss"])
    n = [sum(policy_positions(r)) for r in records]
    # V = 0 at first (zero head): 0.5 mean R^2, sums of 0.5s and 0s (exact) and one division
    assert_close(losses[0], 0.5 * (n[0] + n[3]) / sum(n), rtol=ops_rtol(2), atol=0.0, what="first value loss")
    print("value loss every 5 steps:", [round(x, 4) for x in losses[::5] + losses[-1:]])
    assert losses[-1] < 0.5 * losses[0], losses


def test_ppo_advantages_on_records():
    records = make_records(3, seed=4)
    values = [torch.full((len(r["prompt_ids"]) + len(r["response_ids"]) - 1,), 0.25) for r in records]
    adv, ret = ppo_advantages(records, values, [1.0, 0.0, 1.0], whiten_advantages=False)
    tol = {"rtol": FP32_FORMULA, "atol": FP32_FORMULA}  # fp32 GAE with gamma = lam = 1: a few adds of <= 1
    for a, r, rec, score in zip(adv, ret, records, [1.0, 0.0, 1.0]):
        on = torch.tensor(policy_positions(rec)) > 0
        assert_close(a[on], torch.full_like(a[on], score - 0.25), **tol, what="A = R - V")
        assert_close(r[on], torch.full_like(r[on], score), **tol, what="returns")
    adv_w, _ = ppo_advantages(records, values, [1.0, 0.0, 1.0])
    on = torch.cat([torch.tensor(policy_positions(r)) > 0 for r in records])
    flat = torch.cat(adv_w)[on]
    # whitened in fp32, then the check's own mean and var: sums of n terms of size <= max|A|
    # (twice), a few roundings more
    n, big = len(flat), float(flat.abs().max())
    assert_close(flat.mean(), 0.0, rtol=0, atol=2 * sum_rtol(n) * big + FP32_FORMULA, what="whitened mean")
    assert_close(flat.var(), 1.0, rtol=0, atol=2 * sum_rtol(n) * big**2 + FP32_FORMULA, what="whitened var")
