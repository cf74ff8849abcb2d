"""PPO pieces (trainer/ppo.py) against DESIGN.md §4, a slow reference GAE and hand-worked numbers;
the critic on a tiny Qwen2 built here (no world, no tokenizer)."""

import random

import pytest
import torch

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


def reference_gae(rewards, values, mask, gamma, lam):
    """DESIGN §4 GAE, slowly: walk the policy tokens of each row backwards,
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
        assert torch.allclose(adv[on], ref[on], atol=1e-5)
        assert torch.allclose(ret[on], (ref + values)[on], atol=1e-5)


def test_gae_hand_example_advantage_is_return_minus_value():
    # p1 p2 [i1 i2] p3 p4, R = 1 on p4, gamma = lam = 1 (the trainer/ppo.py docstring example)
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    values = torch.tensor([[0.2, 0.4, 0.9, 0.9, 0.5, 0.7]])
    rewards = token_rewards(torch.tensor([1.0]), mask)
    adv, ret = gae(rewards, values, mask)
    assert adv[0].tolist() == pytest.approx([0.8, 0.6, 0.5, 0.5, 0.5, 0.3])
    assert ret[0].tolist() == pytest.approx([1.0] * 6)


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
                assert float(adv[b, t]) == pytest.approx(want_a) and float(ret[b, t]) == pytest.approx(want_r)
    # values and rewards at masked positions (retrieved tokens, padding) are never read
    noisy_v = torch.where(mask > 0, values, torch.randn_like(values) * 100)
    noisy_r = torch.where(mask > 0, rewards, torch.randn_like(rewards) * 100)
    adv2, ret2 = gae(noisy_r, noisy_v, mask, 0.99, 0.95)
    assert torch.allclose(adv2, adv) and torch.allclose(ret2, ret)


def test_interior_block_bootstraps_from_the_next_policy_token():
    # gamma < 1: the information block is not discounted as time steps (one step, not three)
    mask = torch.tensor([[1.0, 0, 0, 0, 1]])
    values = torch.tensor([[0.1, 5.0, 5.0, 5.0, 0.6]])
    rewards = torch.tensor([[0.0, 0, 0, 0, 1.0]])
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    a_last = 1.0 - 0.6
    assert float(adv[0, 4]) == pytest.approx(a_last)
    assert float(adv[0, 0]) == pytest.approx(0.5 * 0.6 - 0.1 + 0.25 * a_last)


def test_token_rewards_score_on_last_policy_token_kl_on_policy_tokens():
    mask = torch.tensor([[0.0, 1, 1, 0, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1], [0.0] * 8])
    kl = torch.full((3, 8), 2.0)
    r = token_rewards(torch.tensor([1.0, -1.0, 7.0]), mask, kl, kl_coef=0.1)
    assert r[0].tolist() == pytest.approx([0, -0.2, -0.2, 0, 0, 1 - 0.2, 0, 0])
    assert r[1].tolist() == pytest.approx([0, 0, -0.2, -0.2, -0.2, -0.2, -0.2, -1 - 0.2])
    assert r[2].tolist() == [0.0] * 8  # no policy token: nowhere to put the score
    assert token_rewards(torch.tensor([1.0, -1.0, 7.0]), mask)[0].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]


def test_whiten_uses_masked_positions_only():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, -50.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    w = whiten(x, mask)
    on = w[mask > 0]  # [1, 2, 3, 4]: mean 2.5, unbiased var 5/3
    assert float(on.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(on.var()) == pytest.approx(1.0, abs=1e-6)  # torch.var is unbiased
    assert on.tolist() == pytest.approx([(v - 2.5) / (5 / 3) ** 0.5 for v in (1, 2, 3, 4)], rel=1e-6)
    x2 = torch.where(mask > 0, x, torch.tensor(-1e4))
    assert torch.allclose(whiten(x2, mask)[mask > 0], on)
    assert torch.allclose(whiten(x, mask, shift_mean=False)[mask > 0], on + 2.5)


def test_value_loss_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token 0: v = 0.2, R = 1: inside the clip, 0.5 * 0.8^2 = 0.32
    # token 1: v = 2.0, R = 0: clip(2, -.5, .5) = .5 -> max(4, .25) = 4 -> 2.0 (unclipped wins)
    # token 2: masked
    loss, frac = value_loss(torch.tensor([[0.2, 2.0, 9.0]]), old, torch.tensor([[1.0, 0.0, 0.0]]), mask)
    assert float(loss) == pytest.approx((0.32 + 2.0) / 2) and float(frac) == 0.0
    # v = 2.0, R = 3: clipped .5 -> (.5 - 3)^2 = 6.25 > (2 - 3)^2 = 1: clipping matters
    loss, frac = value_loss(torch.tensor([[0.2, 2.0, 9.0]]), old, torch.tensor([[1.0, 3.0, 0.0]]), mask)
    assert float(loss) == pytest.approx((0.32 + 0.5 * 6.25) / 2) and float(frac) == 0.5
    loss, frac = value_loss(torch.tensor([[0.2, 2.0, 9.0]]), old, torch.tensor([[1.0, 3.0, 0.0]]), mask, clip=10.0)
    assert float(loss) == pytest.approx((0.32 + 0.5) / 2) and float(frac) == 0.0


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


def test_critic_shape_alignment_and_padding(policy_dir):
    critic = load_critic(policy_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert critic(ids, torch.ones_like(ids)).abs().max() == 0  # zero-initialised head: V = 0
    randomise_head(critic)
    with torch.no_grad():
        v = critic(ids, torch.ones_like(ids))
        changed = ids.clone()
        changed[0, 3] = 99
        v2 = critic(changed, torch.ones_like(ids))
    assert v.shape == (1, 5)
    assert torch.allclose(v[:, :3], v2[:, :3], atol=1e-6)  # V at t sees tokens <= t only
    assert not torch.allclose(v[:, 3], v2[:, 3])
    records = make_records(5)
    batched = critic_values(critic, records, micro_batch_tokens=60, pad_id=0)
    single = critic_values(critic, records[:1], micro_batch_tokens=10_000, pad_id=0)
    for r, vals in zip(records, batched):
        assert vals.shape == (len(r["prompt_ids"]) + len(r["response_ids"]) - 1,)
    assert torch.allclose(batched[0], single[0], atol=1e-5)  # padding does not change values


def test_critic_save_load_round_trip(policy_dir, tmp_path):
    critic = load_critic(policy_dir)
    randomise_head(critic, seed=3)
    records = make_records(3)
    before = critic_values(critic, records, 200, 0)
    save_critic(critic, tmp_path / "ckpt")
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "critic"):
        after = critic_values(load_critic(path), records, 200, 0)
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
    assert micro["value_loss"] == pytest.approx(full["value_loss"], rel=1e-5)
    assert micro["critic_grad_norm"] == pytest.approx(full["critic_grad_norm"], rel=1e-4)
    assert torch.allclose(w_full, w_micro, atol=1e-6)
    # and the reported loss is value_loss over the batch's policy tokens before the step
    masks = [torch.tensor(policy_positions(r), dtype=torch.float32) for r in records]
    critic = load_critic(policy_dir)
    randomise_head(critic)
    vals = critic_values(critic, records, 10_000, 0)
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    loss, _ = value_loss(cat(vals), cat(vals), cat([torch.ones_like(v) for v in vals]), cat(masks))
    assert full["value_loss"] == pytest.approx(float(loss), rel=1e-5)


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
    assert losses[0] == pytest.approx(0.5 * (n[0] + n[3]) / sum(n))  # V = 0 at first: 0.5 mean R^2
    print("value loss every 5 steps:", [round(x, 4) for x in losses[::5] + losses[-1:]])
    assert losses[-1] < 0.5 * losses[0], losses


def test_ppo_advantages_on_records():
    records = make_records(3, seed=4)
    values = [torch.full((len(r["prompt_ids"]) + len(r["response_ids"]) - 1,), 0.25) for r in records]
    adv, ret = ppo_advantages(records, values, [1.0, 0.0, 1.0], whiten_advantages=False)
    for a, r, rec, score in zip(adv, ret, records, [1.0, 0.0, 1.0]):
        on = torch.tensor(policy_positions(rec)) > 0
        assert torch.allclose(a[on], torch.full_like(a[on], score - 0.25))  # A = R - V
        assert torch.allclose(r[on], torch.full_like(r[on], score))
    adv_w, _ = ppo_advantages(records, values, [1.0, 0.0, 1.0])
    on = torch.cat([torch.tensor(policy_positions(r)) > 0 for r in records])
    flat = torch.cat(adv_w)[on]
    assert float(flat.mean()) == pytest.approx(0.0, abs=1e-6) and float(flat.var()) == pytest.approx(1.0, abs=1e-5)
