"""How a slot mapping splits into whole-block runs and single tokens (`SlotPlan`, `plan_slots`): the plan the
layouts' torch path copies by (the compiled ops plan for themselves)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotPlan:
    """How one slot mapping splits into whole-block runs and leftover tokens.

    `block_runs` holds (chunk_pos, first_block, num_blocks): chunk rows chunk_pos.. map to whole blocks
    first_block.. in order, so they can move with block-level copies. `token_pos` / `token_slots` are the
    remaining valid (slot >= 0) tokens, moved one row at a time by index.
    """

    num_tokens: int
    block_runs: tuple[tuple[int, int, int], ...]
    token_pos: torch.Tensor
    token_slots: torch.Tensor
    num_valid: int = 0  # slots >= 0

    @property
    def has_holes(self) -> bool:
        """Whether some rows have no valid slot (slot < 0): a gather must leave them as they are."""
        return self.num_valid < self.num_tokens


def plan_slots(slots: torch.Tensor, block_size: int) -> SlotPlan:
    """Finds whole blocks in order inside `slots` (vectorised; a Python loop only over blocks)."""
    num_tokens = slots.numel()
    covered = torch.zeros(num_tokens, dtype=torch.bool, device=slots.device)
    runs: list[tuple[int, int, int]] = []
    if num_tokens >= block_size:
        span = num_tokens - block_size + 1
        steps = torch.zeros(num_tokens, dtype=torch.int64, device=slots.device)
        if num_tokens > 1:
            steps[1:] = ((slots[1:] - slots[:-1]) == 1).cumsum(0)
        # A block starts at p when its first slot is block-aligned and the next block_size-1 steps are +1.
        whole = ((steps[block_size - 1:] - steps[:span]) == block_size - 1) \
            & (slots[:span] >= 0) & (slots[:span] % block_size == 0)
        starts = whole.nonzero().flatten()
        if starts.numel():
            rows = (starts[:, None] + torch.arange(block_size, device=slots.device)).flatten()
            covered[rows] = True
            for pos, slot in zip(starts.tolist(), slots[starts].tolist()):
                block = slot // block_size
                if runs and runs[-1][0] + runs[-1][2] * block_size == pos and runs[-1][1] + runs[-1][2] == block:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((pos, block, 1))
    token_pos = ((~covered) & (slots >= 0)).nonzero().flatten()
    return SlotPlan(num_tokens, tuple(runs), token_pos, slots[token_pos], int((slots >= 0).sum()))
