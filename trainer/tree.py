"""Tree-GRPO's advantages (Ji et al., arXiv 2509.21240) for rollout_tree.py's leaves: group-relative
within the question's trees together (inter-tree) plus within the leaf's own tree (intra-tree),

    A_leaf = (r - mean(R_question)) / (std(R_question) + eps) + (r - mean(R_tree)) / (std(R_tree) + eps)

one scalar per leaf, on every token of the leaf's sequence, as the paper's code computes it
(AMAP-ML/Tree-GRPO 90b1709, verl/trainer/ppo/ray_trainer_ts.py, adv_estimator "tree": two
compute_grpo_outcome_advantage calls, index uid and tree_uid, summed). We have not read the paper's
own equation numbers; this is the released code's estimator.

Shared prefixes are weighted as the paper does, not trained once: each leaf is a whole sequence in
the batch, so a step shared by k leaves is in the loss k times, each with its leaf's A. Its total
weight is the sum of the advantages of the leaves below it, which is the step-level signal: in a
tree, sum_leaves_below(node) A_intra = k (mean of the node's leaves - mean of the tree) / std, the
node's value against the tree's, from outcome rewards alone (the paper's step-level preference
reading of the intra-tree term). Training the prefix once would need a per-position weight and
changes loss_agg's token counts; counting it per leaf keeps every leaf a plain record.

    >>> [round(a, 3) for a in tree_advantages([1, 0, 0, 0], ["q"] * 4, ["q/t0", "q/t0", "q/t1", "q/t1"])]
    [2.207, -1.207, -0.5, -0.5]

A tree with one leaf (rollout.tree_l 0) has intra-tree advantage 0 here (group_advantages' rule for
a one-member group), so the sum is chain GRPO's A exactly; the paper's code would add the raw reward
there (its one-member groups take mean 0, std 1).
"""

from __future__ import annotations

from trainer.grpo import group_advantages


def tree_advantages(rewards: list[float], group_ids: list[str], tree_ids: list[str], eps: float = 1e-6,
                    std: str = "group") -> list[float]:  # fmt: skip
    """A_inter + A_intra per leaf, each with group_advantages' rule (train.adv_std, adv_eps)."""
    inter = group_advantages(rewards, group_ids, eps, std)
    intra = group_advantages(rewards, tree_ids, eps, std)
    return [a + b for a, b in zip(inter, intra)]
