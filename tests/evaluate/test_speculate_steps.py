"""A speculative step's acceptance and commit on their own, on hand-made logits and token buffers
(the whole loop against the target and the upstream reference is tests/model/test_speculate.py)."""

from __future__ import annotations

import torch

from dflash_worker.evaluate.speculate import _accept, _commit, _Sampling

GREEDY = _Sampling(temperature=0.0, top_p=1.0, top_k=0, generator=None)
VOCAB = 8


def logits_for(argmax: list[int]) -> torch.Tensor:
    """[1, len, VOCAB] logits whose argmax at each position is `argmax`."""
    out = torch.zeros(1, len(argmax), VOCAB)
    for i, t in enumerate(argmax):
        out[0, i, t] = 1.0
    return out


def test_greedy_accepts_the_longest_prefix_equal_to_the_argmax_and_takes_the_next_as_bonus() -> None:
    proposal = torch.tensor([[3, 4, 5]])
    accepted, bonus = _accept(proposal, logits_for([3, 4, 6, 7]), None, None, GREEDY)
    assert (accepted, int(bonus)) == (2, 6)
    # A later match after a miss does not count.
    accepted, bonus = _accept(proposal, logits_for([1, 4, 5, 7]), None, None, GREEDY)
    assert (accepted, int(bonus)) == (0, 1)
    accepted, bonus = _accept(proposal, logits_for([3, 4, 5, 7]), None, None, GREEDY)
    assert (accepted, int(bonus)) == (3, 7)


def test_sampled_acceptance_is_repeatable_with_a_generator_and_accepts_what_the_target_would_draw() -> None:
    # The target puts all its mass on the proposal's tokens, then on token 2: every proposal is accepted.
    proposal = torch.tensor([[3, 4]])
    logits = logits_for([3, 4, 2]) * 100
    draft_probs = torch.softmax(logits_for([3, 4]) * 100, dim=-1)
    runs = [_accept(proposal, logits, draft_probs, None, _Sampling(1.0, 1.0, 0, torch.Generator().manual_seed(1))) for _ in range(2)]
    assert runs[0][0] == runs[1][0] == 2 and int(runs[0][1]) == int(runs[1][1]) == 2


def buffer(size: int) -> torch.Tensor:
    return torch.full((1, size), -1, dtype=torch.long)


def test_commit_writes_the_accepted_tokens_and_the_bonus_after_pos() -> None:
    tokens = buffer(10)
    produced, stopped = _commit(tokens, 2, torch.tensor([[5, 6, 7]]), 2, torch.tensor(9), limit=9, stops=None)
    assert (produced, stopped) == (3, None)
    assert tokens[0, 3:6].tolist() == [5, 6, 9] and tokens[0, 6] == -1


def test_commit_cuts_at_the_limit_and_after_the_first_stop_token() -> None:
    tokens = buffer(10)
    # Three accepted + bonus would reach position 6, but the limit leaves room for two tokens after pos 2.
    produced, stopped = _commit(tokens, 2, torch.tensor([[5, 6, 7]]), 3, torch.tensor(8), limit=5, stops=None)
    assert (produced, stopped) == (2, None)
    tokens = buffer(10)
    produced, stopped = _commit(tokens, 2, torch.tensor([[5, 6, 7]]), 3, torch.tensor(8), limit=9, stops=torch.tensor([7, 6]))
    assert (produced, stopped) == (2, 6)
    # A stop token beyond the limit does not stop the step.
    tokens = buffer(10)
    produced, stopped = _commit(tokens, 2, torch.tensor([[5, 6, 7]]), 3, torch.tensor(8), limit=5, stops=torch.tensor([7]))
    assert (produced, stopped) == (2, None)
