"""What runs for a shape in the int8_matmul stem: the autotune bucket of M and the configs it tries, the w8a16
kernel that serves M rows, the decode kernels' tile sizes and splits (planned for whole waves), the fused reduce's
shape, whether a weight gets 16-byte loads. Pure functions of (shape, dtype, SM count): no device query and no
autotuning, so every plan is testable without a GPU. The kernels and their configs: arkernels/triton/int8_matmul.py;
the launches: arkernels/triton/int8_matmul_launch.py.
"""
from __future__ import annotations

import torch
import triton

from arkernels.triton.int8_matmul import CONFIGS_BY_CLASS, FP32_DOT_CONFIGS_BY_CLASS, LARGE_M

TUNE_MAX_M = 8192  # the last power-of-two tuning bucket of M; anything larger shares LARGE_M
GEMV_MAX_M = 4  # x rows held in registers across N tiles (GEMV) up to here; more rows: split-K's K loop
DECODE_MAX_M = 16  # the decode paths' limit: one 16-row tile (mma's smallest M), the weight read once
# Programs per SM that a split-K wave is planned with (the GEMV's count is resident_programs' of its own plan).
PROGRAMS_PER_SM = {"splitk": 2}
# sm_90 per-SM limits that decide how many programs are resident at once (CUDA occupancy rules): 64K registers,
# allocated per warp in units of 256; 228 KB of shared memory, 1 KB of it reserved per block; 32 blocks; 64 warps.
SM90_LIMITS = dict(registers=65536, register_unit=256, smem=228 * 1024, smem_per_block=1024, blocks=32, warps=64)
# The GEMV's budget per thread: the offline sm_90 compiles of its plans stay at or under it (a test checks), so the
# residency the plan counts from it is never more than the hardware's.
GEMV_REGISTERS = 64
GEMV_N_TILES = (2, 4)  # weight tiles per program, all in flight at once: num_stages = N_TILES + 1 (triton keeps
# num_stages - 1 tiles in flight; one tile is a folded loop, no pipeline, so no cp.async at all)
LITTLE_BYTES = 23 * 1024  # loads in flight per SM that saturate HBM (~4.3 TB/s x ~0.7 us / 132 SMs: Little's law)
# The GEMV class's K loop (several PACK_K chunks per split): w8a16_splitk_kernel at these tiles. 2 x 8 KB of weight
# in flight per program; 32 KB of shared memory, so 6 programs per SM (shared memory binds; 80 registers allow 6)
GEMV_LOOP = dict(BLOCK_N=32, BLOCK_K=256, num_stages=3)
GEMV_LOOP_REGISTERS = 80  # budget (offline sm_90, K = 14336 in one split: 57 packed, 72 plain; tests check <=)
GEMV_SMEM_EXTRA = 2048  # the epilogue's scratch, beside the weight tiles and the x slice (offline sm_90 compile)
WAVE_SLACK = 0.05  # plans within this much wave efficiency of the best one count as equal: the fewest programs wins
REDUCE_LOADS_PER_THREAD = 32  # the fused reduce's partial loads in flight per thread (registers: the GEMV uses ~56)


def m_class(M: int) -> int:
    """Config family of M: 1, 16 (<= 16), 64 (<= 64) or LARGE_M. Which configs a bucket may try."""
    for bound in (1, 16, 64):
        if M <= bound:
            return bound
    return LARGE_M


def tune_bucket(M: int) -> int:
    """Autotune bucket of M (the value of the kernels' M_CLASS key): 1, 16 for 2..16 (decode batch sizes share one
    sweep), the next power of two for 17..8192, LARGE_M above."""
    if M <= 16:
        return m_class(M)
    return triton.next_power_of_2(M) if M <= TUNE_MAX_M else LARGE_M


def configs_for(bucket: int, dot_fp32: bool = False) -> list:
    """The configs a tuning bucket tries: its family's, less the tiles taller than the bucket (the family's
    first is always kept: BLOCK_M 16, 32 or 64 <= the smallest bucket of that family, checked by the tests)."""
    family = (FP32_DOT_CONFIGS_BY_CLASS if dot_fp32 else CONFIGS_BY_CLASS)[m_class(bucket)]
    return [c for c in family if c.kwargs["BLOCK_M"] <= max(bucket, 16)]


SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block


def smem_bytes(config, a_bytes: int) -> int:
    """Pipelined operand tiles of a config: num_stages x (A tile at ``a_bytes`` per element + int8 B tile). It
    separates the configs triton 3.6 fits into sm_90's 227 KB from those it does not (offline compile: w8a16 bf16
    256x128x128 x3 stages needs 256 KB, 128x256x128 x4 288 KB; both fit at int8, 144 / 192 KB)."""
    kw = config.kwargs
    return config.num_stages * kw["BLOCK_K"] * (kw["BLOCK_M"] * a_bytes + kw["BLOCK_N"])


def weight_unaligned_reason(w: torch.Tensor) -> str | None:
    """Why the int8 weight ``w [N, K]`` misses the kernels' 16-byte vector loads along K, or None. Triton
    specializes pointers and integer arguments on divisibility by 16 and strides equal to 1: an aligned,
    K-contiguous weight whose rows are a multiple of 16 bytes gets those hints (and 16-byte loads) with nothing
    more; any other view compiles to byte loads, about 4x slower for a memory-bound decode. A packed weight
    (``[N, K // 16, 16]``) is contiguous by its checks: only its start can be off."""
    if w.dim() == 2 and w.shape[0] > 1 and w.stride(1) != 1:
        return f"not K-contiguous (strides {tuple(w.stride())})"
    if w.dim() == 2 and (w.stride(0) % 16 or w.shape[1] % 16):
        return f"rows of {w.shape[1]} bytes at a stride of {w.stride(0)}: not multiples of 16"
    if w.data_ptr() % 16:
        return f"its data starts {w.data_ptr() % 16} bytes past a 16-byte boundary"
    return None


def w8a16_path(M: int, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which w8a16 kernel serves M rows: ``"gemv"`` (M <= 4), ``"splitk"`` (5..16) or ``"tiled"`` (the autotuned
    tile kernel; always for fp32 x, which has no tensor-core dot: its own shallow-K FMA tiles compile without
    spills, the decode kernels' fp32 dots would not be). A pure function of a shape: no host sync."""
    if dtype == torch.float32 or M > DECODE_MAX_M:
        return "tiled"
    return "gemv" if M <= GEMV_MAX_M else "splitk"


def reduce_shape(M: int, cols: int, split_k: int, num_warps: int = 4) -> tuple[int, int]:
    """(BLOCK, UNROLL) of the fused reduce over ``M x cols`` outputs and ``split_k`` splits: as many splits per
    trip as exist (up to 16, a power of two), then as many outputs per step as keep REDUCE_LOADS_PER_THREAD loads
    in flight per thread. M = 1, 28 splits of 32 columns: (32, 16), 2 trips; M = 16, 4 splits of 64: (1024, 4)."""
    unroll = min(16, triton.next_power_of_2(max(split_k, 1)))
    threads = 32 * num_warps
    block = min(triton.next_power_of_2(M * cols), max(threads, threads * REDUCE_LOADS_PER_THREAD // unroll))
    return block, unroll


def resident_programs(registers: int, smem: int, num_warps: int, limits: dict = SM90_LIMITS) -> int:
    """Programs of ``num_warps`` warps, ``registers`` per thread and ``smem`` bytes of shared memory each that an SM
    holds at once: the least of what its registers (per warp, rounded up to the allocation unit), its shared memory
    (plus the per-block reservation), its block and its warp limits allow. 64 registers, 4 warps, 24 KB: 8."""
    unit = limits["register_unit"]
    per_warp = -(-registers * 32 // unit) * unit
    by_regs = (limits["registers"] // per_warp) // num_warps
    by_smem = limits["smem"] // (smem + limits["smem_per_block"])
    return max(0, min(by_regs, by_smem, limits["blocks"], limits["warps"] // num_warps))


def gemv_smem(n_tiles: int, block_n: int, k_per_split: int, block_m: int = 16, x_bytes: int = 2) -> int:
    """Shared memory of a GEMV program as triton lays it out (offline sm_90 compile; a test compares): num_stages - 1
    = N_TILES buffers of one ``[K_PER_SPLIT, BLOCK_N]`` int8 tile, the x slice ``[BLOCK_M, K_PER_SPLIT]`` on its way
    to the dot's register layout, GEMV_SMEM_EXTRA. 2 tiles of 16 KB: 51200 B."""
    return n_tiles * block_n * k_per_split + block_m * k_per_split * x_bytes + GEMV_SMEM_EXTRA


def wave_efficiency(programs: int, wave: int) -> float:
    """Busy fraction of the program slots over the waves a grid occupies: ``programs / (waves * wave)``; 1.0 when
    the grid is a whole number of waves (896 programs on a wave of 528: 0.85, the second wave 70% idle)."""
    return programs / (triton.cdiv(programs, wave) * wave)


def _fewest_programs_near_best(candidates: list[tuple[int, dict]], wave: int) -> dict:
    """``candidates``: (programs, config). The config with the fewest programs among those whose wave efficiency
    is within WAVE_SLACK of the best (fewer programs: more x reuse, fewer partial sums, fewer tickets)."""
    best = max(wave_efficiency(p, wave) for p, _ in candidates)
    near = [(p, i) for i, (p, _) in enumerate(candidates) if wave_efficiency(p, wave) >= best - WAVE_SLACK]
    return candidates[min(near)[1]][1]


def _gemv_chunk_config(N: int, K: int, num_sms: int) -> dict:
    """The per-chunk GEMV (``w8a16_gemv_kernel``): one split per PACK_K chunk of K, N_TILES from GEMV_N_TILES, each
    counted with the waves of its own residency; near the best wave efficiency, the most resident programs (warps to
    hide the dot's latencies: 2 programs of 4 warps leave 2 warps per scheduler), then the fewest programs."""
    block_k = max(32, min(256, triton.next_power_of_2(K)))
    halves = 2 if K > block_k else 1
    block_n = max(16, min(32, triton.next_power_of_2(N)))
    n_blocks = triton.cdiv(N, block_n)
    split_k = max(1, triton.cdiv(K, halves * block_k))  # K = 0: one split of nothing
    plans = []
    for t in GEMV_N_TILES:
        if t > 1 and t >= 2 * n_blocks and plans:
            break  # no tile group wider than twice the columns
        resident = resident_programs(GEMV_REGISTERS, gemv_smem(t, block_n, halves * block_k), 4)
        programs = triton.cdiv(n_blocks, t) * split_k
        plans.append((wave_efficiency(programs, resident * num_sms), resident, -programs, t))
    best = max(p[0] for p in plans)
    n_tiles = max(p[1:] for p in plans if p[0] >= best - WAVE_SLACK)[-1]
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, N_TILES=n_tiles, K_HALVES=halves,
                K_PER_SPLIT=halves * block_k, num_warps=4, num_stages=n_tiles + 1, kernel="gemv")


def gemv_loop_smem(block_n: int = GEMV_LOOP["BLOCK_N"], block_k: int = GEMV_LOOP["BLOCK_K"],
                   stages: int = GEMV_LOOP["num_stages"], block_m: int = 16, x_bytes: int = 2) -> int:
    """Shared memory of the GEMV class's K loop (``w8a16_splitk_kernel`` at GEMV_LOOP) as triton lays it out (offline
    sm_90 compile; a test compares): num_stages - 1 buffers of one int8 ``[BLOCK_K, BLOCK_N]`` weight tile and one
    ``[BLOCK_M, BLOCK_K]`` x tile (the epilogue's scratch reuses them). 3 stages of 256 x 32: 32768 B."""
    return (stages - 1) * block_k * (block_n + block_m * x_bytes)


def gemv_split_options(N: int, K: int, num_sms: int) -> list[dict]:
    """The plans the GEMV class (M <= 4) may take for an ``N x K`` weight: the per-chunk GEMV (one split per PACK_K
    chunk), and, where K has more than one chunk, the K loop over all of them (one split: no workspace, no ticket,
    no reduce). No split count in between: the loop re-stages its x tile every 256 columns (cp.async + LDS) and
    recomputes its addresses, 314 SASS per warp per 8 KB step in one split, 367 with a split's workspace and ticket,
    against the per-chunk GEMV's 559 per 16 KB tile (offline sm_90, packed); over a whole 4096-deep K that is ~0.16
    warp-instructions per weight byte (the per-chunk GEMV's ~0.167), but ~0.20-0.23 at 2-4 splits, where each
    program's prologue and ticket cover only 4-8 steps, of the ~0.24 that HBM speed allows (docs/kernels.md). Each
    option carries its
    ``splits``, ``programs``, weight bytes ``in_flight`` per program, programs ``resident`` per SM
    (:func:`resident_programs` of its register budget and shared memory) and ``cfg``."""
    chunk = _gemv_chunk_config(N, K, num_sms)
    chunks = triton.cdiv(K, chunk["K_PER_SPLIT"]) if K > 0 else 1
    tile = chunk["BLOCK_N"] * chunk["K_PER_SPLIT"]
    options = [dict(splits=chunks, programs=triton.cdiv(N, chunk["BLOCK_N"] * chunk["N_TILES"]) * chunks,
                    in_flight=chunk["N_TILES"] * tile, cfg=chunk,
                    resident=resident_programs(GEMV_REGISTERS, gemv_smem(chunk["N_TILES"], chunk["BLOCK_N"],
                                                                         chunk["K_PER_SPLIT"]), 4))]
    if chunks > 1:
        block_n, block_k = GEMV_LOOP["BLOCK_N"], GEMV_LOOP["BLOCK_K"]
        cfg = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, N_TILES=1, K_PER_SPLIT=chunks * chunk["K_PER_SPLIT"],
                   num_warps=4, num_stages=GEMV_LOOP["num_stages"], kernel="splitk")
        options.append(dict(splits=1, programs=triton.cdiv(N, block_n), cfg=cfg,
                            in_flight=(GEMV_LOOP["num_stages"] - 1) * block_k * block_n,
                            resident=resident_programs(GEMV_LOOP_REGISTERS, gemv_loop_smem(), 4)))
    return options


def _gemv_config(N: int, K: int, num_sms: int) -> dict:
    """The GEMV class's plan: split K only where N alone cannot fill the machine (the LM heads: 128256 x 4096 on 132
    SMs is 4008 programs of 32 columns, 30 per SM). An option *fills* it when the
    programs resident at once give every SM at least the LITTLE_BYTES of weight loads in flight that saturate HBM:
    ``need = cdiv(LITTLE_BYTES, bytes in flight per program)`` programs per SM, no more than the SM holds
    (``resident``), and ``programs >= num_sms x need``. Its balance is how evenly whole programs spread over the SMs
    (:func:`wave_efficiency` at SM granularity: with HBM saturated by every SM's resident programs, the SM that gets
    the most programs sets the time). Among the options that fill, those within WAVE_SLACK of the best balance; of
    those, the fewest splits (no workspace, no tickets), the per-chunk GEMV first on a tie. None fills (every
    projection of Llama-3-8B: N / 32 column tiles <= 448 for 132 SMs x 2 needed per SM... see docs/kernels.md): the
    per-chunk GEMV, whose grid has the most programs."""
    options = gemv_split_options(N, K, num_sms)
    need = {id(o): triton.cdiv(LITTLE_BYTES, o["in_flight"]) for o in options}
    full = [o for o in options if need[id(o)] <= o["resident"] and o["programs"] >= num_sms * need[id(o)]]
    if not full:
        return options[0]["cfg"]
    best = max(wave_efficiency(o["programs"], num_sms) for o in full)
    near = [o for o in full if wave_efficiency(o["programs"], num_sms) >= best - WAVE_SLACK]
    return min(near, key=lambda o: o["splits"])["cfg"]  # min keeps the first (the per-chunk GEMV) on a tie


def w8a16_decode_config(path: str, M: int, N: int, K: int, num_sms: int) -> dict:
    """Tile sizes and split of a decode kernel, a pure function of (path, M, N, K, SM count): no autotuning and
    no device query, so the bits do not depend on a sweep and the plan is testable without a GPU. The ``kernel``
    key names the jit kernel that runs it (``"gemv"``: ``w8a16_gemv_kernel``, ``"splitk"``: ``w8a16_splitk_kernel``).

    gemv (M <= 4, the same plan for every M there, so a row's bits do not depend on its batch; :func:`_gemv_config`):
    split K only where N alone cannot fill the machine. Either the per-chunk GEMV: weight tiles of 2 x 256 (K) by 32
    (N) (16 KB, two dots sharing an accumulator), SPLIT_K = cdiv(K, 512) (one chunk of the packed layout per split),
    N_TILES weight tiles per program sharing its x slice, all in flight at once on a num_stages = N_TILES + 1
    cp.async pipeline; or the K loop (the split-K kernel at GEMV_LOOP's 32-column tiles, 256 deep, 3 stages)
    over whole chunks, down to one split. BLOCK_M 16 (the dot's smallest; rows past M are never read). The figures
    per shape are in docs/kernels.md. The workspace is at most 1.6% (M = 1) to 6.2% (M = 4) of the weight bytes.
    splitk: 16 x 64 x 128 tensor-core tiles, 4 stages; SPLIT_K the count, up to the K tiles, whose grid of
    cdiv(N, 64) x SPLIT_K fills whole waves of 2 x SMs best, unless the workspace would pass 10% of the weight
    bytes (K = 4096 at M = 16: 3 splits, 192 programs).
    """
    if path == "gemv":
        return _gemv_config(N, K, num_sms)
    block_k = max(16, min(128, triton.next_power_of_2(K)))
    block_n = 64
    k_blocks = max(1, triton.cdiv(K, block_k))
    # the workspace (written, then read: 2 x splits x M x N x 4 B) stays under 10% of the weight bytes N x K; this
    # binds for K = 4096 at M = 16 (3 splits: 192 programs)
    max_splits = max(1, min(k_blocks, K // (80 * M)))
    n_cols = triton.cdiv(N, block_n)
    plans = {}  # K_PER_SPLIT -> programs (several split counts round to the same K range)
    for s in range(1, max_splits + 1):
        k_per_split = triton.cdiv(k_blocks, s) * block_k
        plans[k_per_split] = n_cols * triton.cdiv(K, k_per_split) if K > 0 else n_cols
    k_per_split = _fewest_programs_near_best([(p, kps) for kps, p in plans.items()],
                                             PROGRAMS_PER_SM["splitk"] * num_sms)
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, N_TILES=1, K_PER_SPLIT=k_per_split, num_warps=4,
                num_stages=4, kernel="splitk")
