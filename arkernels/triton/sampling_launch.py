"""Host side of the sampling kernels (arkernels/triton/sampling.py): splits, scratch, the tickets' workspace, grids
and launches of ``arkernels::sample`` (two launches, nothing else on the device), ``sampling_probs`` and
``sampling_rules``. Inputs arrive validated and converted by arkernels/ops/sampling.py.

Full-row passes (``debug=True`` counts them): fast path 2 (stats + compaction); fallback without top-k and
top-p 2 (stats + split race); other fallbacks 1 + the search passes (top-k: 1 per search pass, top-p: 1 for
the mass with top-k + its search passes) + 1 (draw).
"""
from __future__ import annotations

import torch
import triton

from arkernels.triton.pdl import pdl_supported
from arkernels.triton.sampling_select import DRAW_TILE, KMAX
from arkernels.triton.tickets import EPOCH_MAX
from arkernels.triton.sampling import (DRAW_BLOCK, LAUNCH, MAX_PASSES, MAX_SPLITS, NB, PIVOTS, SEARCH_BLOCK,
                                       STATS_BLOCK, TILE_CHUNKS, sampling_compact_kernel, sampling_probs_kernel,
                                       sampling_rules_kernel, sampling_stats_kernel)

CAND_CAP = 4096  # candidates per row on the fast path: 32 KB of scratch per row (value + column)
TARGET_PROGRAMS = 264  # 2 per SM on an H200 (132 SMs)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _on(dev):
    return torch.cuda.device(dev) if dev.type == "cuda" else _null()


def _rule_args(logits, token_state, history, penalties, logit_bias, spare):
    """The token-rule kernel arguments: ``(state, history, penalties, bias, history rows, STATE, BIAS)``; what is
    off is passed as ``spare`` (any tensor of the call: the kernels never read it then, and no stand-in is made)."""
    if token_state is not None and penalties is None:
        penalties = torch.tensor([1.0, 0.0, 0.0], device=logits.device).repeat(max(logits.shape[0], 1), 1)
    nh = (token_state if token_state is not None else logit_bias).shape[0] if history is not None else 0
    return (*(t if t is not None else spare for t in (token_state, history, penalties, logit_bias)), nh,
            token_state is not None, logit_bias is not None)


class _Workspace:
    """What the programs of a row share across one launch, on one (device, stream), for batches with several
    programs per row: int64 tickets (per row: one for the stats launch, one for the compaction launch) and the
    int32 row histograms, all 0 between launches (each row's last program resets its own), and the epoch of the next
    call (the tickets' tag: see ``tickets.last_program``). Per stream: launches on one stream run one after another. Grown
    (new zeroed tensors) for a larger batch; a CUDA graph may hold the old addresses, so they are kept. Graphs
    captured on one stream must not be replayed concurrently on two streams; created during a capture, the zero
    fill becomes a node of that graph (harmless: the launches find the reset values anyway). What a reset cannot
    cover: a launch aborted between the histogram atomics and its last program leaves counts behind."""

    def __init__(self):
        self.rows, self.tickets, self.rhist, self.epoch, self.retired = 0, None, None, 0, []

    def take(self, device: torch.device, batch: int):
        if self.rows < batch:
            if self.tickets is not None:
                self.retired.append((self.tickets, self.rhist))
            self.rows = triton.cdiv(max(batch, 1), 16) * 16  # the compaction tickets stay 16-byte aligned
            self.tickets = torch.zeros(2 * self.rows, dtype=torch.int64, device=device)
            self.rhist = torch.zeros(self.rows, NB.value, dtype=torch.int32, device=device)
        self.epoch = self.epoch % EPOCH_MAX + 1
        return self.tickets[:self.rows], self.tickets[self.rows:], self.rhist, self.epoch


_WORKSPACES: dict = {}


def sampling_workspace(device: torch.device) -> _Workspace:
    """The sampler's workspace of ``device``'s current stream (tests read its state)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _WORKSPACES.setdefault((device, stream), _Workspace())


def sampling_splits(batch: int, vocab: int) -> int:
    """Programs per row (``sample``'s stats and compaction grids are ``(batch, splits)``): about
    TARGET_PROGRAMS in all, at most MAX_SPLITS per row, whole chunks each, no program without a chunk. A pure
    function of (batch, vocab): batch 1 x 128256 -> 63 programs of 2 chunks; batch >= 133 -> 1 (no merge)."""
    nchunk = max(1, triton.cdiv(vocab, STATS_BLOCK))
    s = max(1, min(MAX_SPLITS, nchunk, TARGET_PROGRAMS // max(batch, 1)))
    return triton.cdiv(nchunk, triton.cdiv(nchunk, s))


def sampling_tile_chunks(chunks_per_program: int) -> int:
    """Chunks per loop trip (the R of the stats / compaction tiles): TILE_CHUNKS, or fewer when a program has
    fewer chunks (a power of two: a constexpr tile dimension)."""
    return min(TILE_CHUNKS, triton.next_power_of_2(max(chunks_per_program, 1)))


def sample_triton(logits, temperature, top_k, top_p, min_p, seed, step, token_state=None, history=None,
                  penalties=None, logit_bias=None, *, cap: int = CAND_CAP, splits: int | None = None,
                  kmax: int = KMAX, pdl: bool | None = None, debug: bool = False):
    """The ``arkernels::sample`` kernels: ``(ids int64 [batch], valid bool [batch])``; token rules as in the
    schema (contiguous tensors; ``history`` required with ``token_state`` / ``logit_bias``).

    ``cap``: candidates per row on the fast path; ``splits``: programs per row (default
    ``sampling_splits``); ``kmax``: rows with top-k <= kmax draw on chip (0: every row searches its candidates,
    a power of two up to KMAX otherwise); none of them changes a token (bar a top_p within fp32 rounding of a
    boundary: the mass is summed in another order). ``pdl``: launch both kernels with programmatic dependent launch
    (None: where ``pdl_supported``; each waits for the kernel before it first, so no token changes). ``debug``: also return ``(ncand, passes)``, int32 ``[batch]``:
    the row's candidate count (-1: it took the full-row fallback; -2: the fallback without a search, raced by
    the split programs; 0: greedy / no finite logit) and its full-row passes."""
    batch, vocab = logits.shape
    dev = logits.device
    if kmax and (kmax > KMAX or kmax & (kmax - 1)):
        raise ValueError(f"sample_triton: kmax must be 0 or a power of two <= {KMAX}, got {kmax}")
    ids = torch.empty(batch, dtype=torch.int64, device=dev)
    valid = torch.empty(batch, dtype=torch.bool, device=dev)
    nchunk = max(1, triton.cdiv(vocab, STATS_BLOCK))
    S = splits if splits is not None else sampling_splits(batch, vocab)
    cps = triton.cdiv(nchunk, S)
    S = triton.cdiv(nchunk, cps)
    R = sampling_tile_chunks(cps)
    ncp, spx = triton.next_power_of_2(nchunk), max(triton.next_power_of_2(S), MAX_SPLITS)  # one variant per split
    f32, i32 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int32, device=dev)
    # torch.empty only: no launch besides the two kernels (the workspace is zeroed once, then reset by the kernels)
    cmax, carg, csum = torch.empty(batch, nchunk, **f32), torch.empty(batch, nchunk, **i32), torch.empty(batch, nchunk, **f32)
    cut, off, ncand = torch.empty(batch, **i32), torch.empty(batch, spx, **i32), torch.empty(batch, **i32)
    cval, cidx = torch.empty(batch, cap, **f32), torch.empty(batch, cap, **i32)
    rbest, rcol = torch.empty(batch, S, **f32), torch.empty(batch, S, **i32)
    passes = torch.empty(batch if debug else 1, **i32)  # DEBUG: the stats launch writes it first
    if S > 1:
        hist = torch.empty(batch, S, NB.value, **i32)
        t_stats, t_compact, rhist, epoch = sampling_workspace(dev).take(dev, batch)
    else:  # one program per row: no histogram leaves it, no ticket (never read)
        hist, t_stats, t_compact, rhist, epoch = carg, seed, seed, carg, 0
    st, hs, pn, bs, nh, STATE, BIAS = _rule_args(logits, token_state, history, penalties, logit_bias, temperature)
    supported = pdl_supported(dev)
    if pdl and not supported:
        raise ValueError("sample_triton: pdl=True needs a CUDA device of compute capability >= 9 (not interpreted)")
    pdl = supported if pdl is None else pdl
    common = dict(STATE=STATE, BIAS=BIAS, PDL=pdl, **(dict(launch_pdl=True) if pdl else {}))
    if batch > 0 and vocab > 0:
        with _on(dev):
            sampling_stats_kernel[(batch, S)](
                logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, cmax, carg, csum, hist, rhist,
                t_stats, epoch, cut, off, ncand, passes, st, hs, pn, bs, nh, nchunk, cps, S, cap,
                BLOCK=STATS_BLOCK, R=R, NCP=ncp, SP=spx, DEBUG=debug, **common, **LAUNCH["sampling_stats_kernel"])
            sampling_compact_kernel[(batch, S)](
                logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, seed, step, cmax, carg, csum, cut,
                off, ncand, cval, cidx, rbest, rcol, t_compact, epoch, ids, valid, passes, st, hs, pn, bs, nh,
                nchunk, cps, S, cap, BLOCK=STATS_BLOCK, R=R, DRAW_BLOCK=DRAW_BLOCK, SEARCH_BLOCK=SEARCH_BLOCK,
                P=PIVOTS, MAX_PASSES=MAX_PASSES, NCP=ncp, SP=spx, DEBUG=debug, KMAX=kmax, DT=DRAW_TILE, **common,
                **LAUNCH["sampling_compact_kernel"])
    if debug:
        return ids, valid, (ncand, passes)
    return ids, valid


def sampling_probs_triton(logits, temperature, top_k, top_p, min_p, token_state=None, history=None,
                          penalties=None, logit_bias=None):
    """The ``arkernels::sampling_probs`` kernel: fp32 ``[batch, vocab]``."""
    batch, vocab = logits.shape
    probs = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    st, hs, pn, bs, nh, STATE, BIAS = _rule_args(logits, token_state, history, penalties, logit_bias, logits)
    if batch > 0:
        with _on(logits.device):
            sampling_probs_kernel[(batch,)](
                logits, logits.stride(0), vocab, temperature, top_k, top_p, min_p, probs, probs.stride(0),
                st, hs, pn, bs, nh, BLOCK=DRAW_BLOCK, SEARCH_BLOCK=SEARCH_BLOCK, P=PIVOTS, MAX_PASSES=MAX_PASSES,
                STATE=STATE, BIAS=BIAS, **LAUNCH["sampling_probs_kernel"])
    return probs


def sampling_rules_triton(logits, token_state=None, history=None, penalties=None, logit_bias=None):
    """The ``arkernels::sampling_rules`` kernel: the processed fp32 logits ``[batch, vocab]``."""
    batch, vocab = logits.shape
    out = torch.empty(batch, vocab, dtype=torch.float32, device=logits.device)
    st, hs, pn, bs, nh, STATE, BIAS = _rule_args(logits, token_state, history, penalties, logit_bias, logits)
    if batch > 0 and vocab > 0:
        with _on(logits.device):
            sampling_rules_kernel[(batch, triton.cdiv(vocab, DRAW_BLOCK))](
                logits, logits.stride(0), vocab, out, st, hs, pn, bs, nh, BLOCK=DRAW_BLOCK, STATE=STATE, BIAS=BIAS,
                **LAUNCH["sampling_rules_kernel"])
    return out
