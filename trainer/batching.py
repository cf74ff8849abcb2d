"""Batches of token sequences, for the trainer's updates and the tiny world's SFT, in three parts:

  padding and cutting   pad_batch, pad_rows, the policy-token mask (policy_positions), and
                        token-budget micro-batches (token_budget_batches, min_padding_cuts)
  log-probs of logits   float32 log pi of the targets and the entropy, without a float32 copy
                        of the vocabulary (selected_logprobs, logprobs_and_entropy)
  passes over a batch   which process forwards which micro-batch (balanced_micro_batches with
                        gradients, no_grad_runs without), the gradient accumulation over them
                        (accumulating), and the no-gradient passes whose rows every process
                        gets (per_position, shared_per_position, batch_logprobs), and
                        teacher-forced continuations (continuation_logprobs)

One process or several: the collectives these call (all_reduce, gather_lists) are
trainer/distributed.py's, which imports nothing of this file.

    ids, attn, loss_mask = pad_batch([[5, 6, 7], [8, 9]], [[0, 1, 1], [1, 1]], pad_id=0)
    # ids [[5, 6, 7], [8, 9, 0]], attn [[1, 1, 1], [1, 1, 0]], loss_mask [[0, 1, 1], [1, 1, 0]]
    batches = token_budget_batches(lengths, budget=8192, rng=random.Random(0))  # index lists
    logps = per_position(lambda ids, attn: token_logprobs(model, ids, attn), seqs, 8192, pad_id)

Used by trainer/grpo.py (the GRPO step), trainer/ppo.py (the critic) and tiny/sft.py.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from trainer.distributed import all_reduce, compute_device, gather_lists


def pad_batch(seqs: list[list[int]], masks: list[list[int]], pad_id: int):
    """Right-pad to the longest sequence; returns input_ids, attention_mask, loss_mask."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    loss = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        loss[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, loss


def pad_rows(rows: list, width: int) -> torch.Tensor:
    """Per-position rows (lists or tensors) right-padded with 0 into one float32 [B, width]."""
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def policy_positions(record: dict, mask_retrieved: bool = True) -> list[int]:
    """Per-position mask of a rollout record (length len(prompt + response) - 1; position t-1
    predicts token t): 1 where the predicted token is a policy token. mask_retrieved=False
    (Search-R1's ablation) counts every response token, retrieved ones too."""
    response = record["loss_mask"] if mask_retrieved else [1] * len(record["response_ids"])
    return ([0] * len(record["prompt_ids"]) + list(response))[1:]


def token_budget_batches(
    lengths: list[int], budget: int, rng: random.Random, max_padding: float = 0.1
) -> list[list[int]]:
    """Group example indices into micro-batches of at most `budget` padded tokens (a sequence
    longer than the budget goes alone), similar lengths together, batches in random order.

    Sort by length, then cut the sorted list where padding is least: a batch is as wide as its
    longest member, so the cut is a small dynamic programme over the sorted lengths. It uses as
    few micro-batches as the budget allows, and one more at a time (up to twice that many)
    until padding is at most `max_padding` of all positions. A greedy cut ("fill to the budget,
    then start the next") fills batches but strands long sequences beside short ones: 21.8% vs
    this cut's measured padding at the 8192 default (README, Memory and efficiency).

    >>> token_budget_batches([5, 9, 6, 10], 20, random.Random(0))  # doctest: +SKIP
    [[1, 3], [0, 2]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    cuts = min_padding_cuts([lengths[i] for i in order], budget, max_padding)
    batches = [order[a:b] for a, b in zip(cuts, cuts[1:])]
    rng.shuffle(batches)
    return batches


def min_padding_cuts(sorted_lengths: list[int], budget: int, max_padding: float = 0.1) -> list[int]:
    """Cut points [0, c1, ..., n] of ascending lengths into contiguous micro-batches: the fewest
    batches under `budget` padded tokens, more (up to twice as many) while padding exceeds
    `max_padding`; among cuts with the same count, the least padding.

    >>> min_padding_cuts([2, 2, 2, 9], 18)      # greedy would pack [2,2,2] | [9]: same here
    [0, 3, 4]
    >>> min_padding_cuts([1, 1, 8, 8, 8, 9], 30)  # [1,1] | [8,8,8] | [9]: 2+24+9 = 35 positions
    [0, 2, 5, 6]
    """
    n = len(sorted_lengths)
    if n == 0:
        return [0]
    real = sum(sorted_lengths)
    inf = float("inf")

    # cost[k][j]: least positions covering the first j sequences with k batches; back[k][j]: cut.
    # A batch ending at j holds d = j - i sequences, d <= d_max[j] (it fits the budget); lengths
    # ascend, so d_max never grows with j and the j that admit a given d are one slice. One numpy
    # pass per d keeps this fast for an SFT epoch (7,200 sequences: seconds per epoch in Python
    # loops, milliseconds here); d ascending with a strict < keeps the largest i among ties.
    lengths = np.asarray(sorted_lengths, dtype=np.float64)
    d_max = np.maximum(1, budget // np.asarray(sorted_lengths, dtype=np.int64))  # index j - 1
    last_j = [0] + [int(np.searchsorted(-d_max, -d, side="right")) for d in range(1, n + 1)]
    cost, back = [np.array([0.0] + [inf] * n)], [np.zeros(n + 1, dtype=np.int64)]
    while True:
        k = len(cost)
        row, arg = np.full(n + 1, inf), np.zeros(n + 1, dtype=np.int64)
        for d in range(1, n + 1):
            hi = min(last_j[d], n)  # j in [d, hi] admit a batch of d
            if hi < d:
                break
            js = np.arange(d, hi + 1)
            cand = cost[k - 1][js - d] + lengths[js - 1] * d
            better = cand < row[js]
            row[js[better]], arg[js[better]] = cand[better], js[better] - d
        cost.append(row)
        back.append(arg)
        fewest = next(m for m in range(1, k + 1) if cost[m][n] < inf) if row[n] < inf else None
        if fewest is not None and (1 - real / row[n] <= max_padding or k >= 2 * fewest or k >= n):
            break
    cuts, j = [n], n
    for m in range(k, 0, -1):
        j = int(back[m][j])
        cuts.append(j)
    return cuts[::-1]


# ---------------------------------------------------------------------------------------------
# Log-probs from logits: float32 where it counts, without a float32 copy of the vocabulary.


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1, shape (B, T-1). Position t-1 predicts token t."""
    return selected_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])


@torch.no_grad()
def continuation_logprobs(model, contexts: list[list[int]], continuations: list[list[int]], pad_id: int,
                          rows_per_pass: int = 64) -> list[list[float]]:  # fmt: skip
    """log p(continuation | context), summed over the continuation's tokens, for every context and
    every continuation: out[i][j] for contexts[i] followed by continuations[j]. Teacher-forced, no
    gradient, in passes of `rows_per_pass` sequences (report/metrics.p_certain reads confidences so).

    contexts [[5, 6]] and continuations [[7], [8, 9]] -> [[log p(7|5 6), log p(8|5 6) + log p(9|5 6 8)]]
    """
    pairs = [(i, j) for i in range(len(contexts)) for j in range(len(continuations))]
    out = [[0.0] * len(continuations) for _ in contexts]
    device = next(model.parameters()).device
    for at in range(0, len(pairs), rows_per_pass):
        part = pairs[at : at + rows_per_pass]
        seqs = [contexts[i] + continuations[j] for i, j in part]
        marks = [[0] * len(contexts[i]) + [1] * len(continuations[j]) for i, j in part]
        ids, attn, mask = pad_batch(seqs, marks, pad_id)
        logp = token_logprobs(model, ids.to(device), attn.to(device)).float().cpu()
        sums = (logp * mask[:, 1:]).sum(-1)
        for (i, j), total in zip(part, sums.tolist()):
            out[i][j] = total
    return out


@torch.no_grad()
def log_normalizers(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the vocabulary of each position ([B, T, V] -> [B, T], float32), one
    sequence at a time: the float32 copy of the logits exists for one row only."""
    return torch.stack([torch.logsumexp(row.float(), -1) for row in logits])


class _SelectedLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] = logit[target] - logsumexp(logits), float32, whose backward
    recomputes the softmax one sequence at a time. The graph keeps the logits (which exist
    anyway, in the model's dtype) and one log-normaliser per position, not a float32
    log-softmax of the whole vocabulary (TRL's selective_log_softmax and verl's fused kernels
    avoid the same copies)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(-1, targets[..., None]).squeeze(-1).float() - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for b in range(len(logits)):  # d/dx (x_t - lse) = onehot(t) - softmax(x)
            g = -torch.exp(logits[b].float() - lse[b, :, None]) * grad[b, :, None]
            grad_logits[b] = g.scatter_add_(-1, targets[b, :, None], grad[b, :, None]).to(logits.dtype)
        return grad_logits, None, None


def selected_logprobs(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(logits)[..., target] in float32 ([B, T, V] logits, [B, T] targets), without a
    float32 copy or log-softmax of the whole micro-batch's vocabulary (B x T x V x 4 bytes: 2.4 GB
    for 4096 tokens of Qwen2.5's 152k vocabulary), in the forward or kept for the backward.
    `lse`: the logits' log_normalizers, when the caller has them already (row_entropy uses them too).

    >>> selected_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 3]])).exp()   # uniform over 4
    tensor([[0.2500, 0.2500]])
    """
    return _SelectedLogprobs.apply(logits, targets, log_normalizers(logits) if lse is None else lse)


@torch.no_grad()
def row_entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """-sum_v p log p of each position ([B, T, V] -> [B, T], float32) from the logits and their
    log_normalizers, one sequence at a time, no graph: the entropy as a statistic (entropy_coef 0)."""
    out = []
    for row, row_lse in zip(logits, lse):
        logp = row.float() - row_lse[:, None]
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.stack(out)


ENTROPY_CHUNK_TOKENS = 256  # positions per float32 slice of _LogprobsEntropy: 2 x 256 x 152064 x 4 B = 0.31 GB


def chunk_spans(batch: int, length: int, chunk: int) -> Iterator[tuple[int, int, int]]:
    """(row, start, stop) slices of at most `chunk` positions of a [batch, length, V] tensor, each
    within one row, so the slice of a [:, :-1] view is contiguous (no copy of the micro-batch)."""
    for b in range(batch):
        for t in range(0, length, chunk):
            yield b, t, min(t + chunk, length)


class _LogprobsEntropy(torch.autograd.Function):
    """(log pi of each target, entropy of each position), float32, with the entropy's gradient,
    from [B, T, V] logits, `chunk` positions at a time in the forward and in the backward. The
    graph keeps the logits (in the graph anyway) and three float32 numbers per position (lse,
    entropy); the backward recomputes each chunk's softmax. Peak beyond the logits: their
    gradient (the logits' dtype) and two float32 [chunk, V] slices (trainer/plan.py counts it so,
    tests/test_box.py measures it), where torch's log_softmax, exp, product and their backward
    held four to five float32 [B, T, V] tensors (5 GB each at 8192 x 152064).

    d(x_t - lse)/dx = onehot(t) - p;  dH/dx = -p (log p + H)   (H = -sum p log p)
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int):
        B, T, _ = logits.shape
        lp, ent, lse = (torch.empty(B, T, dtype=torch.float32, device=logits.device) for _ in range(3))
        for b, t0, t1 in chunk_spans(B, T, chunk):
            x = logits[b, t0:t1].to(torch.float32, copy=True)  # copy: fp32 logits must not change in place
            lse[b, t0:t1] = torch.logsumexp(x, -1)
            x.sub_(lse[b, t0:t1, None])  # log p
            lp[b, t0:t1] = x.gather(-1, targets[b, t0:t1, None]).squeeze(-1)
            ent[b, t0:t1] = -(x.exp().mul_(x)).sum(-1)
        ctx.chunk = chunk
        ctx.save_for_backward(logits, targets, lse, ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor, g_ent: torch.Tensor):
        logits, targets, lse, ent = ctx.saved_tensors
        B, T, _ = logits.shape
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, t0, t1 in chunk_spans(B, T, ctx.chunk):
            sl = (b, slice(t0, t1))
            x = logits[sl].to(torch.float32, copy=True).sub_(lse[sl][:, None])  # log p
            p = x.exp()
            # -p * (g_lp + g_ent * (log p + H)), then + g_lp at the target
            x.add_(ent[sl][:, None]).mul_(g_ent[sl][:, None]).add_(g_lp[sl][:, None]).mul_(p).neg_()
            del p
            grad[sl] = x.scatter_add_(-1, targets[sl][:, None], g_lp[sl][:, None]).to(logits.dtype)
        return grad, None, None


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, entropy_grad: bool,
                         chunk: int = ENTROPY_CHUNK_TOKENS) -> tuple:  # fmt: skip
    """(log pi of each target, entropy of each position), float32, from [B, T, V] logits, through
    _LogprobsEntropy (`chunk` positions of float32 at a time, so the same peak with or without
    the entropy's gradient); without entropy_grad (entropy_coef 0) the entropy is a statistic."""
    logp, entropy = _LogprobsEntropy.apply(logits, targets, chunk)
    return logp, entropy if entropy_grad else entropy.detach()


def autocast(bf16: bool):
    """bf16 compute (train.bf16) on the device the forward runs on; off: the weights' dtype."""
    return torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16, enabled=bf16)


# ---------------------------------------------------------------------------------------------
# Passes over a batch, in one process or several: which process forwards which micro-batch, the
# gradient accumulation over them, and the no-gradient passes whose rows every process gets.


def forward_rows(fn, seqs: list[list[int]], batches: list[tuple[list[int], bool]], pad_id: int) -> dict:
    """fn(input_ids, attention_mask) -> [B, T-1] over `batches` ((indices, keep) pairs): {index:
    the float32 row of each kept sequence, length len(seq) - 1}. A batch not kept is run for its
    collectives only (FSDP). Right padding changes no row (causal attention)."""
    out = {}
    for idx, keep in batches:
        ids, attn, _ = pad_batch([seqs[i] for i in idx], [[] for _ in idx], pad_id)
        values = fn(ids, attn).float().cpu()
        if keep:
            out.update((i, values[row, : len(seqs[i]) - 1].clone()) for row, i in enumerate(idx))
    return out


@torch.no_grad()
def per_position(fn, seqs: list[list[int]], micro_batch_tokens: int, pad_id: int) -> list[torch.Tensor]:
    """fn(input_ids, attention_mask) -> [B, T-1] over token-budget micro-batches, split back into
    one float32 row per sequence (length len(seq) - 1): log-probs of a policy or reference,
    values of a critic."""
    batches = token_budget_batches([len(s) for s in seqs], micro_batch_tokens, random.Random(0))
    rows = forward_rows(fn, seqs, [(b, True) for b in batches], pad_id)
    return [rows[i] for i in range(len(seqs))]


@torch.no_grad()
def shared_per_position(fn, seqs: list[list[int]], budget: int, pad_id: int, rank: int = 0, world: int = 1,
                        exact: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """per_position (fn(ids, attn) -> [B, T-1], one float32 row per sequence) with the
    work shared: each process forwards its micro-batches of `no_grad_runs`, then every process
    gets every row (gather_lists). One process: per_position itself."""
    if world == 1:
        return per_position(fn, seqs, budget, pad_id)
    mine = forward_rows(fn, seqs, no_grad_runs([len(s) for s in seqs], budget, rank, world, exact), pad_id)
    rows = dict(gather_lists(list(mine.items()), world))
    return [rows[i] for i in range(len(seqs))]


def batch_logprobs(model, seqs: list[dict], micro_batch_tokens: int, pad_id: int, bf16: bool = False, rank: int = 0,
                   world: int = 1, exact: bool = False) -> list:  # fmt: skip
    """log pi(token t | tokens < t) of every position of every sequence, no gradient: the
    reference model's logprobs, or pi_old recomputed by the trainer before the first update.
    With several processes each forwards its share and all get every row (shared_per_position)."""
    device = compute_device(model)

    def logprobs(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        with autocast(bf16):
            return token_logprobs(model, ids.to(device), attn.to(device))

    return shared_per_position(logprobs, [s["ids"] for s in seqs], micro_batch_tokens, pad_id, rank, world, exact)


def no_grad_runs(lengths: list[int], budget: int, rank: int, world: int,
                 exact: bool = False) -> list[tuple[list[int], bool]]:  # fmt: skip
    """Process `rank`'s micro-batches of a pass without gradients over every sequence (the
    reference's and pi_old's logprobs, the critic's values): (indices, real). Each sequence is
    forwarded by one process, then the rows are shared (`shared_per_position`), so 2 processes
    each forward about half of the tokens, not all of them.

    Default: sequences dealt longest first, each to the process with the fewest tokens so far,
    then cut into token-budget micro-batches. exact (train.exact_grad_sum): the micro-batches of
    the 1-process cut of the whole batch, dealt the same way: each row is then computed in the
    very batch a 1-process run computes it in, so it is the same to the bit. Processes
    with fewer micro-batches repeat the shortest sequence (real False) until all have run as many
    forwards as the busiest (FSDP's all-gathers must line up).

    >>> no_grad_runs([50, 10, 40, 12], 64, 0, 2)   # 60 tokens (a padded pair of 50 and 10 is over 64)
    [([1], True), ([0], True)]
    >>> no_grad_runs([50, 10, 40, 12], 64, 1, 2)   # 52 tokens
    [([3], True), ([2], True)]
    """
    # every process deals every share (no message needed) and keeps its own
    if exact:  # whole micro-batches of the 1-process cut
        cut = token_budget_batches(lengths, budget, random.Random(0))
        micro = [[cut[j] for j in share] for share in _deal([sum(lengths[i] for i in b) for b in cut], world)]
    else:  # sequences, each process's share then cut
        micro = [[[share[j] for j in b] for b in token_budget_batches([lengths[i] for i in share], budget,
                                                                       random.Random(0))]
                 for share in map(sorted, _deal(lengths, world))]  # fmt: skip
    mine, n_micro = micro[rank], max(len(m) for m in micro)
    filler = [min(range(len(lengths)), key=lengths.__getitem__)]  # the cheapest repeat
    return [(idx, True) for idx in mine] + [(filler, False)] * (n_micro - len(mine))


def _deal(weights: list[int], world: int) -> list[list[int]]:
    """Indices of `weights` dealt to `world` processes, heaviest first, each to the one with the
    least weight so far. _deal([50, 10, 40, 12], 2) == [[0, 1], [2, 3]]."""
    load, shares = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        k = min(range(world), key=load.__getitem__)
        load[k] += weights[i]
        shares[k].append(i)
    return shares


def balanced_micro_batches(items: list[int], lengths: list[int], budget: int, rank: int, world: int,
                           exact: bool = False) -> list[tuple[list[int], float]]:  # fmt: skip
    """Process `rank`'s micro-batches of the mini-batch `items` (their `lengths`), weight 1.0,
    then zero-weight repeats until every process runs as many forward/backward passes (FSDP's
    collectives must line up).

    Default: the process's share items[rank::world], cut into token-budget micro-batches.
    exact (train.exact_grad_sum): the whole mini-batch is cut, the same cut whatever the number of
    processes, and process `rank` takes every world-th micro-batch. Each micro-batch's gradient is
    then the one a 1-process run computes; only the summing differs (see `accumulating`). Keep
    micro_batch_tokens small enough for several micro-batches per process, or some only repeat.

    >>> balanced_micro_batches([0, 2, 5, 7], [30, 29, 60, 61], 64, 0, 1)   # one process: no repeats
    [([2, 0], 1.0), ([5], 1.0), ([7], 1.0)]
    >>> balanced_micro_batches([0, 2, 5, 7], [30, 29, 60, 61], 64, 1, 2, exact=True)   # rank 1 of 2
    [([5], 1.0), ([5], 0.0)]
    """

    def cut(idx: list[int], lens: list[int]) -> list[list[int]]:
        return [[idx[j] for j in b] for b in token_budget_batches(lens, budget, random.Random(0))]

    if exact:
        micro = cut(items, lengths)
        mine, n_micro = micro[rank::world], -(-len(micro) // world)  # the busiest process runs n_micro
        if len(micro) < world:
            warnings.warn(f"train.exact_grad_sum: {len(micro)} micro-batch(es) for {world} processes, so some "
                          "only repeat; lower train.micro_batch_tokens to share the work", stacklevel=2)  # fmt: skip
    else:
        mine = cut(items[rank::world], lengths[rank::world])
        n_micro = int(all_reduce(torch.tensor(float(len(mine))), world, "max"))
    return [(idx, 1.0) for idx in mine] + [(mine[0] if mine else items[:1], 0.0)] * (n_micro - len(mine))


def accumulating(model, runs: list, exact: bool, world: int) -> Iterator:
    """Yield each micro-batch of `runs`; the caller runs its forward and backward in the loop body.
    Without `exact`, the gradients add up as torch does (fp32, and FSDP reduces each backward).

    With `exact` (train.exact_grad_sum), the update's gradient is the float64 sum of the
    micro-batch gradients, rounded to float32 once, so it does not depend on which process ran
    which micro-batch: a 2-process run steps to the weights of a 1-process run. One process keeps
    float64 sums here; under FSDP the gradients stay unsharded in float64 until the last
    micro-batch, then one float64 reduce-scatter sums them (distributed._fsdp_kwargs: reduce_dtype
    float64). The price is a float64 copy of the unsharded gradients on every process during the step."""
    sums: dict = {}
    for k, run in enumerate(runs):
        if exact and world > 1:
            model.set_requires_gradient_sync(k == len(runs) - 1)
        yield run
        if exact and world == 1:
            for p in model.parameters():
                if p.grad is not None:
                    sums[p] = p.grad.double() if p not in sums else sums[p].add_(p.grad)
                    p.grad = None
    for p, total in sums.items():
        p.grad = total.float()
