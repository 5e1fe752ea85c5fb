"""window_attention decode's split-KV tail (issue 26) in the SIMT emulator: completion counters no failed launch can
poison (an epoch per launch), the combine's partial reads (each partial byte read exactly once), and the launch
planner's one-wave split count. The global combine's tests run with thread-block clusters off (on sm_90 the planner
otherwise takes the cluster combine, tests/test_window_attention_cluster.py)."""
import pytest
import torch

from arkernels.ops.window_attention import window_attention
from conftest import SIMT_DEVICES
from test_window_attention import _check, _paged


def _decode(device, gen, lens, hq, hkv, d=64, dtype=torch.bfloat16, window=0, block_size=16):
    k, v, table = _paged(lens, block_size, hkv, d, dtype, device, gen)
    query = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)

    def run():
        return window_attention(query, k, v, table, lens_t, window=window, return_lse=True)

    def check(out, lse):
        _check(out, lse, query, k, v, table, lens, None, window, d ** -0.5, 0.0)

    return run, check


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("aborted", ["last", "first"])
def test_window_attention_decode_aborted_launch_poisons_nothing(device, aborted):
    """A launch that aborts on one split CTA (it never runs: a trap, an illegal address, a cancelled graph) between
    good launches on the same stream's counters leaves nothing that mis-combines the calls after it: those match the
    fp64 reference, for the same shapes, for fewer columns and for more. (With counters reset by their last CTA, the
    aborted column's counter stays at num_splits - 1 and the next launch's first CTA of that column combines
    partials nobody wrote yet.)"""
    import arkernels.simt

    gen = torch.Generator().manual_seed(7)
    no_cluster = arkernels.simt.emulate(cluster=False)
    no_cluster.__enter__()
    run, check = _decode(device, gen, [900, 700], hq=4, hkv=2)
    check(*run())
    grid = arkernels.simt.launches()[0]["grid"]
    assert grid[0] > 1, grid  # split-KV
    # A CTA of column (sequence 1, KV head 1): the highest split (the last to count in linear order) or split 0.
    split = grid[0] - 1 if aborted == "last" else 0
    block = split + grid[0] * (1 + grid[1] * 1)
    arkernels.simt.abort_block_of_next_launch(block)
    run()  # its output is undefined (a column never combined); what matters is what it leaves behind
    for _ in range(2):
        check(*run())
    fewer, check_fewer = _decode(device, gen, [500], hq=4, hkv=2)
    check_fewer(*fewer())
    more, check_more = _decode(device, gen, [900, 700, 300], hq=4, hkv=2)
    check_more(*more())
    check(*run())
    assert arkernels.simt.launches()[0]["cluster"] == 1
    no_cluster.__exit__(None, None, None)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("heads,d", [((6, 2), 64), ((32, 2), 128)])
def test_window_attention_decode_combine_reads(device, heads, d):
    """The fused split-KV combine reads every byte of every split's partials (fp32 out and lse) exactly once, and
    every split writes its partials exactly once; each split CTA touches its column's counter with two atomics (the
    epoch's max, then the count). 16 heads of D 128 (8 KB of partial per split) need several rounds of the combine's
    shared memory; 3 heads of D 64 fit in one."""
    import arkernels.simt

    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq + d)
    run, check = _decode(device, gen, [2000, 1300], hq=hq, hkv=hkv, d=d)
    with arkernels.simt.emulate(cluster=False):
        check(*run())
    (splits, cols_y, batch), = [launch["grid"] for launch in arkernels.simt.launches()]
    assert splits > 1
    for name in ("part_out", "part_lse"):
        reads, writes = arkernels.simt.traffic_map(name)
        assert reads.numel() == splits * batch * hq * (d if name == "part_out" else 1) * 4
        assert bool((reads == 1).all()), f"{name}: bytes read {reads.unique().tolist()} times, want once"
        assert bool((writes == 1).all()), f"{name}: bytes written {writes.unique().tolist()} times, want once"
    reads, writes = arkernels.simt.traffic_map("split_counters")
    used = batch * cols_y * 8  # bytes of the launch's counters
    assert bool((reads[:used] == 2 * splits).all()) and bool((writes[:used] == 2 * splits).all())
    assert int(reads[used:].sum()) == int(writes[used:].sum()) == 0


# The emulator's device table (csrc/simt/simt.h): SMs and the per-block shared-memory opt-in limit, bytes.
GPUS = {"sm_80": (108, 166912), "sm_89": (142, 101376), "sm_90": (132, 232448)}
# (batch, Hq, Hkv, head_dim, table capacity in keys, window): B=1 8k and 32k with a 4096 window (the rows),
# a batch that fills the wave by itself, one just below it, GQA 20 (two CTAs per KV head), a short table.
PLANS = [(1, 32, 8, 128, 8192, 0), (1, 32, 8, 128, 32768, 4096), (32, 32, 8, 128, 8192, 0),
         (4, 8, 8, 64, 2048, 0), (1, 20, 1, 64, 4096, 0), (2, 4, 2, 96, 4096, 0), (3, 6, 2, 64, 128, 0)]


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("cluster", [False, True])
def test_window_attention_decode_one_wave(device, gpu, cluster):
    """The split count is sized to one wave, as FlashInfer sizes its grid (blocks per SM x SMs): CTAs per SM from the
    planned shared memory (the 1 KB per-block reservation included, at most 3: the register bound), splits =
    min(64, wave // columns, ceil(keys / 128)), 1 when the columns fill the wave alone or the table holds <= 128 keys;
    so columns x splits never exceeds the wave. The table capacity (not seq_lens) bounds the keys: the sequences here
    are short, so the emulator runs the planned grid cheaply, and the output is checked too.
    With clusters (sm_90 only): a plan of <= 16 splits is one cluster per column as planned; more splits are capped to
    16 where columns x 16 still cover >= 90% of the SMs (decode_cluster_splits), else the global combine keeps them."""
    import arkernels.simt

    sms, optin = GPUS[gpu]
    gen = torch.Generator().manual_seed(3)
    got = {}
    with arkernels.simt.emulate(gpu, cluster=cluster):
        for plan in PLANS:
            batch, hq, hkv, d, cap, window = plan
            block_size = 16
            lens = [5 + 7 * b for b in range(batch)]
            k, v, table = _paged(lens, block_size, hkv, d, torch.float16, device, gen)
            wide = torch.full((batch, cap // block_size), -1, dtype=torch.int32)
            wide[:, :table.shape[1]] = table
            query = torch.randn(batch, hq, d, generator=gen).half()
            lens_t = torch.tensor(lens, dtype=torch.int32)
            out, lse = window_attention(query, k, v, wide, lens_t, window=window, return_lse=True)
            _check(out, lse, query, k, v, wide, lens, None, window, d ** -0.5, 0.0)
            (splits, cols_y, cols_z), = [launch["grid"] for launch in arkernels.simt.launches()]
            smem = arkernels.simt.launches()[0]["smem"]
            columns = batch * hkv * -(-(hq // hkv) // 16)
            assert cols_y * cols_z == columns
            wave = min((optin + 1024) // (smem + 1024), 3) * sms
            keys = min(window, cap) if window else cap
            want = 1 if columns >= wave or keys <= 128 else min(64, wave // columns, -(-keys // 128))
            want_cluster = 1
            if cluster and gpu == "sm_90" and want > 1:
                if want <= 16:
                    want_cluster = want
                elif columns * 16 * 10 >= sms * 9:
                    want = want_cluster = 16
            assert splits == want, (gpu, batch, hq, hkv, d, cap, window, smem, splits, want)
            assert arkernels.simt.launches()[0]["cluster"] == want_cluster
            assert splits == 1 or columns * splits <= wave
            got[plan] = splits
    if gpu == "sm_90" and not cluster:  # the B=1 rows: 2 CTAs per SM (108.8 KB each) x 132 SMs / 8 KV heads
        # = 33; the 4096 window: 32 splits of 128 keys; 256 columns of B=32 fill the wave alone
        assert (got[PLANS[0]], got[PLANS[1]], got[PLANS[2]]) == (33, 32, 1)
    if gpu == "sm_90" and cluster:  # B=1, 8 KV heads: 8 x 16 = 128 CTAs on 132 SMs, clusters of 16; GQA 20/1 (2
        # columns): 16 splits would leave 100 SMs idle, so the global combine keeps its 32 (4096 keys / 128)
        assert (got[PLANS[0]], got[PLANS[1]], got[PLANS[2]], got[PLANS[4]]) == (16, 16, 1, 32)
