"""Token-budget micro-batching (batching.token_budget_batches / min_padding_cuts): the budget holds,
every index appears once, and the cut is the least-padding one (checked against brute force)."""

import itertools
import random

from trainer.batching import min_padding_cuts, token_budget_batches


def positions(sorted_lengths, cuts):
    return sum(sorted_lengths[b - 1] * (b - a) for a, b in zip(cuts, cuts[1:]))


def brute_force(sorted_lengths, budget, k):
    """Least positions over every cut of the sorted list into exactly k batches under budget."""
    n, best = len(sorted_lengths), float("inf")
    for inner in itertools.combinations(range(1, n), k - 1):
        cuts = [0, *inner, n]
        if all(b - a == 1 or sorted_lengths[b - 1] * (b - a) <= budget for a, b in zip(cuts, cuts[1:])):
            best = min(best, positions(sorted_lengths, cuts))
    return best


def test_cut_is_optimal_for_its_batch_count():
    rng = random.Random(0)
    for _ in range(60):
        ls = sorted(rng.randint(3, 40) for _ in range(rng.randint(1, 9)))
        budget = rng.randint(30, 120)
        cuts = min_padding_cuts(ls, budget, max_padding=0.0)
        k = len(cuts) - 1
        assert cuts[0] == 0 and cuts[-1] == len(ls) and cuts == sorted(set(cuts))
        assert positions(ls, cuts) == brute_force(ls, budget, k)


def test_more_batches_only_while_padding_is_high():
    ls = [10] * 6 + [40] * 2  # fewest under 120: [10 x6] (60) | [40 x2] (80) -> no padding at all
    assert min_padding_cuts(ls, 120) == [0, 6, 8]
    ls = [10, 10, 10, 38, 40]  # fewest under 200: one batch, 200 positions, 46% padding
    assert min_padding_cuts(ls, 200, max_padding=1.0) == [0, 5]
    assert min_padding_cuts(ls, 200, max_padding=0.1) == [0, 3, 5]  # 30 + 80: 1.8% padding


def test_batches_cover_every_index_once_and_keep_the_budget():
    rng = random.Random(1)
    lengths = [rng.randint(20, 220) for _ in range(128)]
    batches = token_budget_batches(lengths, 2048, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(128))
    assert all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 2048 for b in batches)
    real = sum(lengths)
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert 1 - real / padded <= 0.1
    long = token_budget_batches([5000, 10, 10], 2048, random.Random(0))  # over budget: alone
    assert sorted(map(sorted, long)) == [[0], [1, 2]]


def test_selected_logprobs_and_their_gradient_match_the_batched_log_softmax():
    """batching.selected_logprobs (x_t - logsumexp x, softmax recomputed per row in the backward)
    against torch's log_softmax + gather on the same fp32 logits: the same quantities evaluated in
    another order. Logprobs: the log-normaliser's sum of V terms in another order plus a few
    roundings (logprob_atol at these logits, |z| < 4). Gradients: onehot - softmax, each entry a
    softmax evaluated another way, within FP32_FORMULA of it, |grad| <= 1. Entropy: V terms
    p log p, each log p within logprob_atol (sum p = 1), then the sum in another order: twice it."""
    import torch
    from numerics import FP32_FORMULA, assert_close, logprob_atol

    from trainer.batching import log_normalizers, row_entropy, selected_logprobs

    torch.manual_seed(0)
    vocab = 50
    logits = (torch.randn(3, 7, vocab) * 1.3).clamp(-4, 4).requires_grad_(True)
    targets = torch.randint(0, vocab, (3, 7))
    weights = torch.randn(3, 7)  # a loss that weighs each position differently
    mine = selected_logprobs(logits, targets)
    (mine * weights).sum().backward()
    grad_mine, logits.grad = logits.grad.clone(), None
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    (ref * weights).sum().backward()
    assert_close(mine, ref, rtol=0, atol=logprob_atol(vocab, logit_max=4.0), what="logprobs")
    assert_close(grad_mine, logits.grad, rtol=0, atol=FP32_FORMULA * weights.abs().max(), what="gradients")
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    entropy_atol = logprob_atol(vocab, logit_max=4.0) * 2
    assert_close(row_entropy(logits, log_normalizers(logits)), entropy, rtol=0, atol=entropy_atol, what="entropy")
