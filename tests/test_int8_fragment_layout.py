"""The fragment layout (arkernels/ops/int8_matmul_layout.py, LAYOUT_FRAGMENT): exact round trips, and the byte order
checked element by element against the PTX ISA's mma.m16n8k16 B-fragment table, written here independently of the
layout code (the SIMT emulator models the mma's math from the same table, so the layout's correctness is pinned here
too, not only through the kernel)."""
import pytest
import torch

from arkernels.ops.int8_matmul_layout import (FRAG_ROWS, fragment_weight, is_fragment, is_packed, pack_weight, to_plain,
                                             unfragment_weight)

# (N, K): whole groups, a short last group (N % 16), a K tail (K % 32 == 16), K of one tail only, tiny N.
SHAPES = [(32, 64), (16, 16), (17, 48), (272, 1040), (4016, 80), (5, 16), (48, 32), (0, 32), (31, 0)]


def _weight(N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)


@pytest.mark.parametrize("N,K", SHAPES)
def test_fragment_round_trip_exact(N, K):
    w = _weight(N, K)
    f = fragment_weight(w)
    assert f.shape == (N, K // 16, 4, 4) and f.is_contiguous() and is_fragment(f) and not is_packed(f)
    assert torch.equal(unfragment_weight(f), w)
    assert torch.equal(unfragment_weight(f, torch.float32), w.float())
    assert torch.equal(to_plain(f), w)
    # every byte moved, none invented: the same multiset of values
    assert torch.equal(f.reshape(-1).sort().values, w.reshape(-1).sort().values)


def test_fragment_from_strided_view():
    w = _weight(40, 96)
    view = torch.cat([w, w], 1)[:, ::2]  # non-contiguous [40, 96]
    assert torch.equal(fragment_weight(view), fragment_weight(view.contiguous()))


def ptx_b_fragment_element(lane: int, i: int) -> tuple[int, int]:
    """PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", matrix B (.f16/.bf16): the element
    b_i (i = 0..3; two per .f16x2 register) of lane `lane` is B[row][col] with groupID = lane >> 2,
    threadID_in_group = lane % 4, row = threadID_in_group * 2 + (i & 0x1) for i < 2, and + 8 for i >= 2, col = groupID.
    Returns (row = k within the k16 step, col = n within the n8 tile)."""
    group_id, tig = lane >> 2, lane % 4
    row = tig * 2 + (i & 0x1) + (8 if i >= 2 else 0)
    return row, group_id


@pytest.mark.parametrize("N,K", [(32, 64), (16, 48), (48, 1040)])
def test_fragment_bytes_follow_the_ptx_b_fragment_table(N, K):
    """Byte 8 s + 4 j + i of lane l's 16 bytes in unit u of group G is element b_i of that lane's B fragment for n8
    tile j and k16 step s of the unit (B[k][n] = w[n, k]); in the 16-column K tail, byte 4 j + i of its 8."""
    w = _weight(N, K, seed=1)
    flat = fragment_weight(w).reshape(-1)
    units = K // 32
    checked = 0
    for G in range(N // 16):
        base = G * 16 * K
        for u in range(units + (K % 32 != 0)):
            tail = u == units
            for lane in range(32):
                for s in range(1 if tail else 2):
                    for j in range(2):
                        for i in range(4):
                            k, n = ptx_b_fragment_element(lane, i)
                            want = w[16 * G + 8 * j + n, 32 * u + 16 * s + k]
                            off = base + (512 * u + 8 * lane + 4 * j + i if tail else
                                          512 * u + 16 * lane + 8 * s + 4 * j + i)
                            assert flat[off] == want, (G, u, lane, s, j, i)
                            checked += 1
    assert checked == (N // 16) * 16 * K


def test_fragment_short_last_group_is_plain():
    N, K = 37, 64
    w = _weight(N, K, seed=2)
    flat = fragment_weight(w).reshape(-1)
    assert torch.equal(flat[32 * K:].view(5, K), w[32:])


@pytest.mark.parametrize("N,K", [(64, 80), (40, 48)])
def test_fragment_slices_and_concatenates_along_n(N, K):
    """Rows [a, b) with a, b multiples of 16 (or b = N) are bytes [a K, b K) and the fragment form of those rows:
    what fuse_projections relies on."""
    w = _weight(N, K, seed=3)
    f = fragment_weight(w)
    for a in range(0, N, FRAG_ROWS):
        for b in list(range(a + FRAG_ROWS, N + 1, FRAG_ROWS)) + [N]:
            assert torch.equal(f[a:b], fragment_weight(w[a:b])), (a, b)
    w2 = _weight(24, K, seed=4)
    whole = (N // 16) * 16
    cat = torch.cat([fragment_weight(w[:whole]), fragment_weight(w2)])
    assert torch.equal(unfragment_weight(cat), torch.cat([w[:whole], w2]))


def test_fragment_converts_from_and_to_packed():
    w = _weight(50, 1040, seed=5)
    assert torch.equal(fragment_weight(to_plain(pack_weight(w))), fragment_weight(w))
    assert torch.equal(pack_weight(to_plain(fragment_weight(w))), pack_weight(w))


def test_fragment_refuses_bad_input():
    with pytest.raises(ValueError, match="multiple of 16"):
        fragment_weight(_weight(16, 40))
    with pytest.raises(ValueError, match="int8"):
        fragment_weight(torch.zeros(16, 32))
    with pytest.raises(ValueError, match="fragment layout"):
        unfragment_weight(torch.zeros(16, 2, 16, dtype=torch.int8))
