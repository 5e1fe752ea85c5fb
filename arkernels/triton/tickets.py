"""Arrival tickets shared by the Triton kernels whose programs hand a reduction to the last one to arrive
(int8_matmul's fused split-K reduce, the sampler's per-row cutoff and draw), and the epochs their hosts pass."""
import triton
import triton.language as tl

EPOCH_MAX = (1 << 31) - 1  # ticket epochs cycle in [1, EPOCH_MAX]: an int32 kernel argument, a 64-bit ticket tag


@triton.jit
def last_program(ticket_ptr, epoch):
    """Take this program's ticket; True for the program that arrives last of the ``num_programs(1)`` programs that
    share it (split-K splits of one output tile, a sampled row's programs), which then owns the reduction. The
    ticket is left reset for the next launch.

    A ticket is an int64 ``(tag << 32) | count``: ``count`` programs of the launch whose epoch is ``tag`` have
    arrived. The host passes every launch a new epoch (1, 2, ..., EPOCH_MAX, then 1 again), and a program that
    finds another tag (the reset value 0, or what an aborted launch left: some of its programs never arrived, so
    its last program never reset the ticket) claims the ticket for its own epoch with a compare-and-swap that
    discards the stale count. Stale state therefore never shifts a later launch's count, and no launch has to
    succeed for the next one to be right (a plain counter reset by the kernel itself stays poisoned forever after
    one aborted launch). The last program still resets the ticket to 0: a CUDA graph replays a captured launch
    with its captured epoch, so the next replay must find a count of 0, not the count it left. What a reset cannot
    cover: an aborted replay followed by a replay of the same captured launch with no other launch on the ticket
    between them (any other w8a16 decode call of the stream in between re-tags it).

    Cost: one atomic round trip (an add) for every program that finds its own tag; the first of a launch adds a
    compare-and-swap (two on contention). Ordering: the barrier puts every thread's partial-sum stores before the
    release of the single-thread atomic (the threadfence-reduction idiom); its acquire orders the last program's
    loads of the other splits' partials after their releases.
    """
    tl.debug_barrier()
    old = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    mine = old + 1
    claimed = (old >> 32) == epoch
    seen = mine
    while not claimed:  # first arrival of this epoch (or racing another first arrival): claim the tag
        want = tl.where((seen >> 32) == epoch, seen + 1, (epoch.to(tl.int64) << 32) + 1)
        got = tl.atomic_cas(ticket_ptr, seen, want, sem="acq_rel", scope="gpu")
        claimed = got == seen
        mine = want
        seen = got
    last = (mine & 0xFFFFFFFF) == tl.num_programs(1)
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
    return last
