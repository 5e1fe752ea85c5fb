"""Host side of the speculative-sampling kernel (arkernels/triton/spec_sampling.py): scratch-free launch, one program
per row. Inputs are validated and converted by arkernels/ops/spec_sampling.py."""
from __future__ import annotations

import torch
import triton

from arkernels.triton.spec_sampling import BLOCK, spec_sampling_kernel

NUM_WARPS = 4  # one [BLOCK] fp32 tile per trip: 16 elements per thread; Triton's offline sm_90 compile + ptxas:
# 139 registers (draft distribution) / 104 (one-hot), no spill (tests/test_spec_sampling.py compiles both)


class _NoDevice:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def spec_walk_triton(p, q, draft_ids, temperature, seed, step):
    """The acceptance walk and the final draw on the device, no host sync.

    Args:
        p: fp32 ``[batch * (k+1), vocab]`` contiguous: the target's distributions, position-minor.
        q: fp32 ``[batch * k, vocab]`` contiguous, or None for a one-hot draft (``q_j = onehot(draft_ids[:, j])``).
        draft_ids: int64 ``[batch, k]`` (last dim contiguous).
        temperature: fp32 ``[batch]`` (0: greedy, the draft distribution is ignored); seed, step: int64 ``[batch]``.

    Returns:
        ``(tokens int64 [batch, k+1], accepted int64 [batch], valid bool [batch])``.
    """
    batch, k = draft_ids.shape
    vocab = p.shape[1]
    dev = p.device
    tokens = torch.empty(batch, k + 1, dtype=torch.int64, device=dev)
    accepted = torch.empty(batch, dtype=torch.int64, device=dev)
    valid = torch.empty(batch, dtype=torch.bool, device=dev)
    if batch == 0:  # (vocab >= 1: the op refuses an empty vocabulary)
        return tokens, accepted, valid
    onehot = q is None
    qq = p if onehot else q  # never read when ONEHOT
    with torch.cuda.device(dev) if dev.type == "cuda" else _NoDevice():
        spec_sampling_kernel[(batch,)](
            p, qq, draft_ids, draft_ids.stride(0), temperature, seed, step, tokens, accepted, valid, k, vocab,
            ONEHOT=onehot, BLOCK=min(BLOCK, triton.next_power_of_2(vocab)), KP=triton.next_power_of_2(k + 1),
            num_warps=NUM_WARPS)
    return tokens, accepted, valid
