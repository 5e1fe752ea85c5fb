"""The emulator's own model: what it must see that a sequential CPU run would hide.

- Memory visibility between blocks: a block's global stores reach the blocks that run after it only through a
  release (__threadfence, or one thread's release after a __syncthreads: csrc/simt/simt.h, g_visibility), and a
  load of another block's published bytes is reported unless an acquire orders it, so the publish / release /
  count / acquire / last-block-reads protocol of decode's split-KV combine is wrong without either half.
- Poisoned allocations: what an op allocates (outputs, scratch) is NaN until written.
- Programmatic dependent launch (csrc/pdl.cuh): on sm_90 a kernel's launch may overlap the one before it, so a global
  access before griddepcontrol.wait, or a thread that exits without one, is reported; on sm_80 launches are plain.
- Thread-block clusters (csrc/simt/simt_cluster.h): a cluster's blocks run at once, each with its own shared memory,
  read and written by the others through DSMEM between cluster barriers; an access no barrier orders, an access to an
  exited block (or an exit before another block's access), a rank outside the cluster are reported, and launches a
  GPU refuses are refused.
"""
import pytest
import torch

from conftest import SIMT_DEVICES


def _fence_probe(blocks, fence):
    import arkernels.simt

    arkernels.simt.load()
    return torch.ops.arkernels_simt.fence_probe(blocks, fence)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 5])
def test_fenced_stores_reach_the_last_block(device, block_order):
    import arkernels.simt

    blocks = 6
    want = 32.0 * sum(range(1, blocks + 1))
    with arkernels.simt.emulate(block_order=block_order):
        total, slots = _fence_probe(blocks, True)
    assert float(total) == want
    assert torch.equal(slots, torch.arange(1, blocks + 1).float().repeat_interleave(32))


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 5])
def test_unfenced_stores_are_invisible_to_other_blocks_until_the_launch_ends(device, block_order):
    import arkernels.simt

    blocks = 6
    with arkernels.simt.emulate(block_order=block_order):
        total, slots = _fence_probe(blocks, False)
        # the last block sees only its own stores: the others were taken back when their blocks ended ...
        assert float(total) in {32.0 * k for k in range(1, blocks + 1)}
        assert float(total) != 32.0 * sum(range(1, blocks + 1))
        # ... and landed when the launch ended
        assert torch.equal(slots, torch.arange(1, blocks + 1).float().repeat_interleave(32))
        with arkernels.simt.emulate(visibility=False):  # the old model: every store at once, the bug hidden
            total, _ = _fence_probe(blocks, False)
        assert float(total) == 32.0 * sum(range(1, blocks + 1))


def _release_probe(blocks, mode):
    import arkernels.simt

    arkernels.simt.load()
    return torch.ops.arkernels_simt.release_probe(blocks, mode)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 5])
def test_one_threads_release_after_the_barrier_publishes_the_whole_block(device, block_order):
    """__syncthreads, then thread 0's release add; the last block's thread 0 acquires, then __syncthreads: every
    lane of the last block sees every block's stores (a release is cumulative through the barrier)."""
    import arkernels.simt

    blocks = 6
    with arkernels.simt.emulate(block_order=block_order):
        sums, slots = _release_probe(blocks, 0)
    assert torch.equal(sums, torch.full((32,), float(sum(range(1, blocks + 1)))))
    assert torch.equal(slots, torch.arange(1, blocks + 1).float().repeat_interleave(32))


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("mode", [1, 3], ids=["relaxed_count", "release_before_the_barrier"])
def test_stores_no_release_ordered_stay_invisible(device, mode):
    """A relaxed count publishes nothing; a release before the barrier publishes only the releasing thread's own
    stores: the last block then sums its own slot (and, mode 3, lane 0 every block's)."""
    import arkernels.simt

    blocks = 6
    with arkernels.simt.emulate(block_order=5):
        sums, slots = _release_probe(blocks, mode)
    full = float(sum(range(1, blocks + 1)))
    lanes = sums[1:] if mode == 3 else sums
    assert all(float(x) in {float(k) for k in range(1, blocks + 1)} for x in lanes)
    if mode == 3:
        assert float(sums[0]) == full
    assert torch.equal(slots, torch.arange(1, blocks + 1).float().repeat_interleave(32))  # landed at the end


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_a_load_of_published_data_without_an_acquire_is_reported(device):
    import arkernels.simt

    with arkernels.simt.emulate(block_order=5):
        with pytest.raises(RuntimeError, match="no acquire after the count"):
            _release_probe(6, 2)
        sums, _ = _release_probe(6, 0)  # and the error does not stick to the next launch
    assert float(sums[0]) == 21.0


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_op_allocations_are_poisoned(device):
    import arkernels.simt

    arkernels.simt.load()
    for n in (1, 7, 4096):
        assert bool(torch.isnan(torch.ops.arkernels_simt.alloc_probe(n)).all())


def _pdl_probe(order):
    import arkernels.simt

    arkernels.simt.load()
    return torch.ops.arkernels_simt.pdl_probe(order)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("order, what", [(1, "load"), (2, "store"), (3, "exited without griddepcontrol.wait")])
def test_pdl_access_before_the_wait_is_reported_on_sm_90_only(device, order, what):
    import arkernels.simt

    with arkernels.simt.emulate(device="sm_90"):
        with pytest.raises(RuntimeError, match=what):
            _pdl_probe(order)
        # plain launches (sm_80, or PDL off) have no predecessor to overlap: nothing to report
        want = torch.zeros(32) if order == 3 else torch.arange(1, 33).float()
        with arkernels.simt.emulate(pdl=False):
            assert torch.equal(_pdl_probe(order), want)
        assert not arkernels.simt.launches()[0]["pdl"]
    with arkernels.simt.emulate(device="sm_80"):
        assert torch.equal(_pdl_probe(order), want)
        assert not arkernels.simt.launches()[0]["pdl"]


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_pdl_wait_first_is_clean_and_the_trigger_counted(device):
    import arkernels.simt

    with arkernels.simt.emulate(device="sm_90"):
        assert torch.equal(_pdl_probe(0), torch.arange(1, 33).float())
        assert arkernels.simt.launches() == [{"grid": (1, 1, 1), "threads": 32, "smem": 0, "pdl": True,
                                              "triggered": 1, "cluster": 1, "dsmem": 0}]


def _cluster_probe(blocks, cluster, mode, nonportable=False):
    import arkernels.simt

    arkernels.simt.load()
    return torch.ops.arkernels_simt.cluster_probe(blocks, cluster, mode, nonportable)


def _probe_values(blocks):
    return (100 * torch.arange(blocks).float()[:, None] + torch.arange(32).float()[None, :])


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("blocks, cluster, block_order", [(8, 4, 0), (8, 4, 3), (12, 3, 0), (16, 16, 0), (6, 1, 0)])
def test_cluster_blocks_read_each_other_through_dsmem(device, blocks, cluster, block_order):
    """Each block of a cluster loads its neighbour's shared memory (rank + 1) after a cluster barrier, and stores into
    it (mode 4): the values are the neighbour's, in every block order; ranks and cluster sizes are reported right,
    and the launch log counts the cluster and the DSMEM bytes."""
    import arkernels.simt

    want = _probe_values(blocks)
    nb = torch.arange(blocks)
    nxt = (nb // cluster) * cluster + (nb % cluster + 1) % cluster
    prv = (nb // cluster) * cluster + (nb % cluster - 1) % cluster
    with arkernels.simt.emulate(device="sm_90", block_order=block_order):
        out, info = _cluster_probe(blocks, cluster, 0, nonportable=cluster > 8)
        assert torch.equal(out, want[nxt])
        assert torch.equal(info, (nb % cluster + 100 * cluster).int())
        launch, = arkernels.simt.launches()
        assert (launch["cluster"], launch["dsmem"]) == (cluster, blocks * 32 * 4)
        out, _ = _cluster_probe(blocks, cluster, 4, nonportable=cluster > 8)
        assert torch.equal(out, want[prv])


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("mode, what", [(1, "no cluster barrier between the store and the load"),
                                        (2, "may still access its shared memory"),
                                        (3, "rank 4 in a cluster of 4 blocks"),
                                        (5, "no cluster barrier between the store and the load")])
def test_cluster_access_no_barrier_orders_is_reported(device, mode, what):
    """A load of another block's bytes written after the loader's last cluster barrier (mode 1: a flag polled with no
    barrier; mode 5: only a relaxed barrier between, which publishes nothing), a block that exits with no cluster barrier after another block's last access to it (mode 2), a rank
    outside the cluster (mode 3): each reported, whatever the threads' timing (decided from barrier counts)."""
    import arkernels.simt

    with arkernels.simt.emulate(device="sm_90"):
        for _ in range(3):
            with pytest.raises(RuntimeError, match=what):
                _cluster_probe(8, 4, mode)
        out, _ = _cluster_probe(8, 4, 0)  # and the error does not stick to the next launch
    assert not bool(torch.isnan(out).any())


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("blocks, cluster, nonportable, gpu, what", [
    (16, 16, False, "sm_90", "more than 8 blocks without cudaFuncAttributeNonPortableClusterSizeAllowed"),
    (32, 32, True, "sm_90", "more than 16 blocks"),
    (12, 8, True, "sm_90", "not a multiple of the cluster"),
    (8, 4, False, "sm_80", "need sm_90"),
])
def test_cluster_launches_a_gpu_refuses_are_refused(device, blocks, cluster, nonportable, gpu, what):
    import arkernels.simt

    with arkernels.simt.emulate(device=gpu):
        with pytest.raises(RuntimeError, match=what):
            _cluster_probe(blocks, cluster, 0, nonportable)
