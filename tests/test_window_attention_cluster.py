"""window_attention decode's split-KV combine in a thread-block cluster (sm_90, issue 34 item 3) in the SIMT emulator:
the split CTAs of a column combine their partials through distributed shared memory (csrc/
window_attention_decode_cluster.cuh), against the fp64 reference and the global combine, that the cluster path really
ran (the launch log's cluster size and DSMEM bytes; no global partial, lse or counter byte touched), and where it does
not apply (sm_80, more than 16 splits that cannot be capped, clusters switched off)."""
import pytest
import torch

from arkernels.ops.window_attention import window_attention
from conftest import SIMT_DEVICES
from test_window_attention import _check, _paged

# (splits, lens, Hq, Hkv, head_dim, window, fp8, softcap, dtype, block size): the table holds splits x 128 keys, so on
# the emulated H200 (264 CTAs per wave) the planner gives exactly `splits` splits. B = 1 and B > 1; GQA 1, 4, 10
# (10 rows of a 16-row CTA); head dims 64, 80 (20 slots of 4 dims per row), 128; windows; fp8 caches; softcap; a row
# shorter than one split (every split but the first empty: weight 0); block sizes 16 and 13.
CASES = [
    (2, [256], 4, 1, 64, 0, False, 0.0, torch.bfloat16, 16),
    (3, [300, 5], 8, 2, 128, 0, False, 0.0, torch.float16, 16),
    (5, [630, 1, 333], 20, 2, 80, 0, False, 2.5, torch.bfloat16, 13),
    (8, [1024], 32, 8, 128, 0, False, 0.0, torch.bfloat16, 16),
    (8, [1000, 40], 8, 2, 64, 900, True, 0.0, torch.bfloat16, 16),
    (13, [1664, 900], 4, 4, 64, 0, True, 0.0, torch.float16, 13),
    (16, [2048], 8, 2, 128, 0, False, 0.0, torch.float16, 16),
    (16, [2000, 7, 1500], 6, 2, 80, 1950, False, 0.0, torch.bfloat16, 16),
]


def _case(case, gen):
    splits, lens, hq, hkv, d, window, fp8, softcap, dtype, block_size = case
    k, v, table = _paged(lens, block_size, hkv, d, torch.float32 if fp8 else dtype, "cpu", gen)
    width = splits * 128 // block_size  # the table's capacity: (splits - 1) x 128 < keys <= splits x 128
    assert max(lens) <= width * block_size and (splits - 1) * 128 < width * block_size
    wide = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = min(width, table.shape[1])
    wide[:, :used] = table[:, :used]
    query = torch.randn(len(lens), hq, d, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scales = {}
    if fp8:  # powers of two: the 16-bit copy of the dequantized cache is exact, the reference runs on it
        k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 8).to(torch.float8_e4m3fn)
        scales = {"k_scale": torch.tensor([0.25]), "v_scale": torch.tensor([0.125])}
        kc, vc = k8, v8
        k, v = k8.to(dtype) * 0.25, v8.to(dtype) * 0.125
    else:
        kc, vc = k, v

    def run():
        return window_attention(query, kc, vc, wide, lens_t, window=window, softcap=softcap, return_lse=True,
                                **scales)

    def check(out, lse):
        _check(out, lse, query, k, v, wide, lens, None, window, d ** -0.5, softcap)

    return run, check


def _columns(case):
    splits, lens, hq, hkv = case[:4]
    return len(lens) * hkv * -(-(hq // hkv) // 16)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"s{c[0]}-b{len(c[1])}-{c[2]}x{c[3]}-d{c[4]}" for c in CASES])
def test_window_attention_decode_cluster_grid(device, case):
    """The cluster combine (on) and the global combine (off) against the fp64 reference, and against each other:
    the same partials merged in another order (fp32 sums), so equal to a few ulps of the output type."""
    import arkernels.simt

    splits = case[0]
    gen = torch.Generator().manual_seed(splits * 31 + len(case[1]))
    run, check = _case(case, gen)
    results = {}
    for cluster in (True, False):
        with arkernels.simt.emulate(device="sm_90", cluster=cluster):
            out, lse = run()
            launch, = arkernels.simt.launches()
        check(out, lse)
        assert launch["grid"][0] == splits and launch["pdl"]
        assert launch["cluster"] == (splits if cluster else 1)
        results[cluster] = (out, lse)
    (a, la), (b, lb) = results[True], results[False]
    assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(la, lb, atol=1e-5, rtol=1e-5, equal_nan=False)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("block_order", [0, 3, 11])
def test_window_attention_decode_cluster_ran(device, block_order):
    """The cluster path really ran: every column one cluster of `splits` blocks, the DSMEM bytes exactly the
    combine's (each CTA loads every split's lse of its rows and, for its own output slots, every split's 16 bytes),
    no global scratch (partials, lse, counters) registered or touched, and every output and lse byte written exactly
    once (the bytes outside the named buffers: out and lse, which the op allocates). Clusters in any order."""
    import arkernels.simt

    case = (8, [1024, 1024], 8, 2, 64, 0, False, 0.0, torch.bfloat16, 16)  # every split has keys
    splits, lens, hq, hkv, d = case[:5]
    gen = torch.Generator().manual_seed(5)
    run, check = _case(case, gen)
    with arkernels.simt.emulate(device="sm_90", block_order=block_order):
        out, lse = run()
        launch, = arkernels.simt.launches()
        traffic = arkernels.simt.traffic()
    check(out, lse)
    hc = hq // hkv
    columns = _columns(case)
    lse_bytes = splits * hc * splits * 4  # per column: each of its CTAs, every split's lse of the hc rows
    part_bytes = hc * d * 4 * splits      # per column: every 16-byte slot of the output, from every split
    assert launch["cluster"] == splits and launch["dsmem"] == columns * (lse_bytes + part_bytes)
    for name in ("part_out", "part_lse", "split_counters"):
        assert name not in traffic, traffic
    assert traffic["other"] == (0, out.numel() * out.element_size() + lse.numel() * 4)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("gpu, case", [
    ("sm_80", CASES[3]),                                                   # no clusters before sm_90
    ("sm_90", (64, [4096], 20, 1, 64, 0, False, 0.0, torch.float16, 16)),  # 2 columns: 64 splits, not capped
])
def test_window_attention_decode_global_path_where_no_cluster(device, gpu, case):
    """sm_80, and more than 16 splits where 16 would leave most SMs idle, take the global combine: a plain launch,
    the partials and counters in global memory (each partial byte read once), the output right."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(9)
    run, check = _case(case, gen)
    with arkernels.simt.emulate(device=gpu):
        out, lse = run()
        launch, = arkernels.simt.launches()
        reads, _ = arkernels.simt.traffic_map("part_lse")
    check(out, lse)
    assert launch["grid"][0] > 16 or gpu == "sm_80"
    assert launch["cluster"] == 1 and launch["dsmem"] == 0 and launch["grid"][0] > 1
    assert reads.numel() > 0 and bool((reads == 1).all())


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_window_attention_decode_cluster_capped_plan(device):
    """B = 1, 32/8 heads, 8k keys (the issue's row): the one-wave plan's 33 splits become 16 in clusters of 16 (8
    columns x 16 = 128 CTAs cover >= 90% of 132 SMs), switched off: 33 with the global combine. Only the plan is
    checked on the full table (8 keys per sequence: the emulator runs the 128-CTA grid cheaply)."""
    import arkernels.simt

    gen = torch.Generator().manual_seed(11)
    k, v, table = _paged([8], 16, 8, 128, torch.bfloat16, "cpu", gen)
    wide = torch.full((1, 8192 // 16), -1, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    query = torch.randn(1, 32, 128, generator=gen).bfloat16()
    lens = torch.tensor([8], dtype=torch.int32)
    for cluster, want in ((True, (16, 16)), (False, (33, 1))):
        with arkernels.simt.emulate(device="sm_90", cluster=cluster):
            out, lse = window_attention(query, k, v, wide, lens, return_lse=True)
            launch, = arkernels.simt.launches()
        assert (launch["grid"][0], launch["cluster"]) == want
        _check(out, lse, query, k, v, wide, [8], None, 0, 128 ** -0.5, 0.0)


@pytest.mark.parametrize("device", SIMT_DEVICES)
def test_window_attention_decode_cluster_aborted_launch(device):
    """A launch that aborts on one CTA (a trap ends its cluster) leaves nothing behind on the cluster path (no
    counters, no global partials): the calls after it match the reference."""
    import arkernels.simt

    case = CASES[4]
    gen = torch.Generator().manual_seed(13)
    run, check = _case(case, gen)
    with arkernels.simt.emulate(device="sm_90"):
        check(*run())
        grid = arkernels.simt.launches()[0]["grid"]
        arkernels.simt.abort_block_of_next_launch(grid[0] * grid[1] + 1)  # sequence 1's first column, split 1
        run()
        for _ in range(2):
            check(*run())
