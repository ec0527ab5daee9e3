"""Training objectives over anchored blocks, and the validation metric.

Shapes: M blocks, T block size, V vocabulary, k selector candidates. Block
position 0 is the anchor (given); position k >= 1 predicts the token at
``anchor + k``. Every function here works on positions 1..T-1 only
(``[M, T-1, ...]``).

Labels and validity (`block_labels`): the label of position k is the captured
token id at ``anchor + k`` (the teacher's own continuation). A position is
*valid* when ``anchor + k`` lies inside the sequence and inside the response
(loss mask), and every earlier position of the block is valid too: acceptance
is a prefix, so nothing after the first masked position can ever be reached.

Position weights: ``w_k = exp(-(k - 1) / gamma)`` (gamma defaults to
``7 * T / 16``, i.e. 7 for block 16), or 1 when position weighting is off.

Objectives (both return a weighted *sum* and the caller divides by the total
weight of all micro-batches of one optimizer step, ``sum_valid w_k``, so
gradient accumulation gives the same update as one large batch):

- ``weighted_ce``: ``sum_k valid_k * w_k * CE_k``.
- ``prefix_survival``: ``sum_k valid_k * w_k * S_k * CE_k`` with the survival
  probability ``S_k = prod_{j=1}^{k-1} p_j``, ``S_1 = 1``, where ``p_j`` is the
  draft's own probability of the teacher token at position j
  (``softmax(logits_j)[label_j]``), detached: the weight of position k is the
  probability that every earlier proposal is accepted, so the loss spends its
  budget where acceptance can still reach.
- replay distillation (added with ``[train].replay_kd`` on the train split's
  replay rows, `kd_loss_sum`): ``sum_k valid_k * w_k * KL(q_k || p_k)`` with
  ``q_k`` the starting (released) draft's distribution at position k of the
  same block and ``p_k`` the trained draft's: on general text the draft is
  pulled toward what it proposed before adapting, every token's probability,
  not only the teacher's one token.
- L2-SP (``[train].l2sp``, `add_l2sp_gradient`): ``l2sp / 2 * ||w - w_start||^2`` over the
  trained tensors, added as its gradient once the step's gradients are summed.
- selector objective (added with ``selector_weight`` when the scope trains the
  candidate selector; the only objective of scope ``selector``, whose tensors
  do not change the logits): at each valid position the selector scores the
  top-k candidates of the draft logits given the *teacher-forced* predecessor
  (the anchor for k = 1, else ``label_{k-1}``), and the loss is the
  cross-entropy of picking the teacher's token among those k candidates,
  ``sum_k valid_k * in_topk_k * w_k * CE_sel_k``. Positions whose teacher token
  is not among the candidates carry no selector loss (the selector cannot
  pick it; only the backbone objective can fix that). Teacher forcing is exact
  for what matters: a position is only ever reached when every earlier
  proposal equalled the teacher token, so its real predecessor is the label.

Matching proposals (validation): the number of leading block positions whose
proposal equals the label, ``cumprod(proposal == label).sum()``. Proposals
are the draft's greedy choices: the selector's choice given the
teacher-forced predecessor for DFlash2 (equal, on every reached position, to
the selector's own greedy walk), the logits' argmax for DFlash v1. Per
position we count *reached* (valid and every earlier position matched),
*covered* (reached and the label is among the selector's top-k candidates; for
v1 the argmax) and *selected* (reached and matched), so unreached suffixes
never inflate conditional recall.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def default_gamma(block_size: int) -> float:
    """7 for block 16, scaled with the block size."""
    return 7.0 * block_size / 16.0


def position_weights(block_size: int, gamma: float | None, enabled: bool = True, device=None) -> torch.Tensor:
    """Weights [T-1] of positions 1..T-1: ``exp(-(k-1)/gamma)`` or all ones."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    if not enabled:
        return torch.ones_like(k)
    g = default_gamma(block_size) if gamma is None else float(gamma)
    return torch.exp(-(k - 1) / g)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """(labels [M, T-1] int64, valid [M, T-1] bool) for anchors [M] into one sequence [L]."""
    L = input_ids.shape[0]
    pos = anchors[:, None] + torch.arange(1, block_size, device=anchors.device)[None, :]
    inside = pos < L
    safe = pos.clamp(max=L - 1)
    labels = input_ids[safe].long()
    ok = inside & loss_mask[safe].bool()
    valid = ok.to(torch.int32).cumprod(dim=1).bool()
    return torch.where(valid, labels, torch.zeros_like(labels)), valid


def token_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, objective: str
) -> torch.Tensor:
    """Weighted CE sum over positions 1..T-1; `logits` [M, T-1, V]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [M, T-1]
    w = valid.float() * weights[None, :]
    if objective == "prefix_survival":
        p = lp.detach().exp() * valid.float()
        survival = torch.cumprod(torch.cat((torch.ones_like(p[:, :1]), p[:, :-1]), dim=1), dim=1)
        w = w * survival
    elif objective != "weighted_ce":
        raise ValueError(f"unknown objective {objective}")
    return -(w * lp).sum()


def kd_loss_sum(logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Distillation toward another draft's block distributions (``[train].replay_kd``):
    ``sum_k valid_k * w_k * KL(q_k || p_k)``, `q` from `target_logits` (no gradient), `p` from
    `logits`; both [M, T-1, V]. Zero exactly where the two distributions agree."""
    logp = F.log_softmax(logits.float(), dim=-1)
    logq = F.log_softmax(target_logits.detach().float(), dim=-1)
    kl = (logq.exp() * (logq - logp)).sum(-1)  # [M, T-1]
    return (valid.float() * weights[None, :] * kl).sum()


def add_l2sp_gradient(params: list[torch.nn.Parameter], start: list[torch.Tensor], lam: float) -> float:
    """Add the gradient of ``lam / 2 * ||w - w_start||^2`` to each of `params` (`start`: their starting
    values, in the same order; a missing gradient becomes that term alone); returns the penalty."""
    total = 0.0
    with torch.no_grad():
        for p, p0 in zip(params, start):
            diff = p.detach() - p0
            total += float(diff.square().sum())
            if p.grad is None:
                p.grad = lam * diff
            else:
                p.grad.add_(diff, alpha=lam)
    return 0.5 * lam * total


def selector_scores(selector, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor):
    """(scores [M, T-1, k], candidate ids [M, T-1, k]) given teacher-forced predecessors `prev` [M, T-1]."""
    unary, cand = selector.candidates(logits)
    return selector.pair_scores(hidden, unary, cand, prev), cand


def selector_loss_sum(
    selector, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
    labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
) -> torch.Tensor:
    """Selector cross-entropy sum (see module docstring); hidden [M, T-1, H], logits [M, T-1, V]."""
    return selector_terms(selector, hidden, logits, anchor_ids, labels, valid, weights)[0]


def selector_terms(
    selector, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
    labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(selector CE sum, scores [M, T-1, k], candidate ids [M, T-1, k]): the loss plus what
    `proposals_from_scores` needs, so a training step ranks the vocabulary (top-k) only once."""
    prev = torch.cat((anchor_ids[:, None], labels[:, :-1]), dim=1)
    scores, cand = selector_scores(selector, hidden, logits, prev)
    hit = cand == labels.unsqueeze(-1)
    in_topk = hit.any(-1)
    target = hit.float().argmax(-1)
    ce = F.cross_entropy(scores.float().flatten(0, 1), target.flatten(), reduction="none").view_as(target)
    w = (valid & in_topk).float() * weights[None, :]
    return (w * ce).sum(), scores, cand


def weight_total(valid: torch.Tensor, weights: torch.Tensor) -> float:
    """The normaliser of one micro-batch: ``sum valid_k * w_k``."""
    return float((valid.float() * weights[None, :]).sum())


@torch.no_grad()
def proposals(model, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, labels: torch.Tensor):
    """(greedy proposals [M, T-1], covered [M, T-1] bool) for positions 1..T-1."""
    selector = getattr(model, "candidate_selector", None)
    if selector is None:
        prop = logits.argmax(-1)
        return prop, prop == labels
    prev = torch.cat((anchor_ids[:, None], labels[:, :-1]), dim=1)
    return proposals_from_scores(*selector_scores(selector, hidden, logits, prev), labels)


@torch.no_grad()
def proposals_from_scores(scores: torch.Tensor, cand: torch.Tensor, labels: torch.Tensor):
    """`proposals` of a DFlash2 draft from teacher-forced selector scores already computed."""
    prop = cand.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
    return prop, (cand == labels.unsqueeze(-1)).any(-1)


def match_counts(prop: torch.Tensor, covered: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> dict:
    """Per-block accepted counts and per-position reached / covered / selected counts."""
    match = (prop == labels) & valid
    accepted = match.to(torch.int32).cumprod(dim=1)
    reached = torch.cat((torch.ones_like(accepted[:, :1]), accepted[:, :-1]), dim=1).bool() & valid
    return {
        "accepted": accepted.sum(1).tolist(),
        "reached": reached.sum(0).tolist(),
        "covered": (reached & covered).sum(0).tolist(),
        "selected": (reached & match).sum(0).tolist(),
    }


def summarize(counts: list[dict], positions: int) -> dict:
    """Merge `match_counts` results: mean matching proposals and per-position totals."""
    accepted = [a for c in counts for a in c["accepted"]]
    out = {
        "blocks": len(accepted),
        "matching_proposals": (sum(accepted) / len(accepted)) if accepted else 0.0,
    }
    for key in ("reached", "covered", "selected"):
        out[key] = [sum(c[key][i] for c in counts) for i in range(positions)]
    return out
