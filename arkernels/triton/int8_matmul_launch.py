"""Host side of the int8_matmul stem's Triton path: the launches of ``quantize_rowwise``, ``int8_matmul`` and
``w8a16_matmul`` (arkernels/triton/int8_matmul.py's kernels; inputs checked by arkernels/ops/int8_matmul.py), the
autotuner's glue (pruning by bucket and shared memory; never a sweep during a CUDA-graph capture, :func:`_launch`),
the decode paths' planned launches (arkernels/triton/int8_matmul_plan.py) and the fused reduce's tickets.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from arkernels.ops.int8_matmul_layout import PACK_K, PACK_ROWS, is_packed
from arkernels.triton.pdl import pdl_supported
from arkernels.triton.tickets import EPOCH_MAX
from arkernels.triton.int8_matmul import (ALL_CONFIGS, FP32_LARGER_M, FP32_SMALL_M, INTERPRET_CONFIGS,
                                          int8_matmul_kernel, quantize_rowwise_kernel, splitk_reduce_kernel,
                                          w8a16_gemv_kernel, w8a16_matmul_kernel, w8a16_splitk_kernel)
from arkernels.triton.int8_matmul_plan import (SMEM_LIMIT, configs_for, m_class, reduce_shape, smem_bytes,
                                               tune_bucket, w8a16_decode_config, w8a16_path)

ONE_PASS_MAX_K = 16384  # rows up to this length stay in registers: one read of x instead of two
REDUCE_BLOCK_N = 1024  # the two-launch path's reduce kernel: columns per program
REDUCES = ("fused", "launch")  # the split-K reduction: by the last program of each tile, or a second launch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """Autotune on a GPU unless ``ARKERNELS_AUTOTUNE=0``: then each shape class launches its first config, with no
    benchmarking sweep (the GPU check's test step: ~70 sweeps over the test grid would not fit its time budget)."""
    return not interpreting() and os.environ.get("ARKERNELS_AUTOTUNE", "1") != "0"


def quantize_rowwise_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` fp32|fp16|bf16 (checked by the caller) -> ``(q int8 [M, K], scale fp32 [M])``."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, scale
    one_pass = K <= ONE_PASS_MAX_K
    block_k = max(16, triton.next_power_of_2(K)) if one_pass else 4096
    num_warps = 4 if block_k <= 2048 else (8 if block_k <= 8192 else 16)
    quantize_rowwise_kernel[(M,)](x, q, scale, K, x.stride(0), x.stride(1), BLOCK_K=block_k, ONE_PASS=one_pass,
                                  num_warps=num_warps)
    return q, scale


def _prune_by_class(configs, named_args, **kwargs):
    bucket = named_args.get("M_CLASS", kwargs.get("M_CLASS"))
    ids = {id(c) for c in configs_for(bucket, kwargs.get("DOT_FP32", False))}
    a = named_args.get("x_ptr", named_args.get("a_ptr"))  # bf16 x doubles the A tile of the w8a16 kernel
    a_bytes = a.element_size() if isinstance(a, torch.Tensor) else 1
    return [c for c in configs if id(c) in ids and smem_bytes(c, a_bytes) <= SMEM_LIMIT]


_int8_matmul_tuned = triton.autotune(configs=ALL_CONFIGS, key=["M_CLASS", "N", "K"],
                                     prune_configs_by={"early_config_prune": _prune_by_class})(int8_matmul_kernel)


def _grid(M, N):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


# The config each autotuned shape settled on, keyed as the autotuner keys it (M bucket, N, K, the tensors' dtypes)
# plus the kernel and its flags: what a launch during a CUDA-graph capture runs.
_TUNED: dict = {}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _config_dict(config) -> dict:
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


def _launch(tuned, kernel, M, N, K, args, flags, config):
    """Launch ``kernel`` for an ``[M, N]`` output: with ``config``, or the autotuner's choice. Never a sweep
    during a CUDA-graph capture: its benchmarking launches and synchronisations would invalidate the capture, so
    a capture runs the config the same shape settled on outside it (tune ahead by running the shape once first,
    as a warm-up before capture does), else the bucket's first config, as ``ARKERNELS_AUTOTUNE=0`` would."""
    bucket = tune_bucket(M)
    key = (id(tuned), bucket, N, K, tuple(str(a.dtype) for a in args if hasattr(a, "dtype")),
           tuple(sorted(flags.items())))
    if config is None and autotuning():
        if not _capturing():
            tuned[_grid(M, N)](*args, bucket, **flags)
            _TUNED[key] = tuned.best_config
            return
        config = _TUNED.get(key)
        config = None if config is None else _config_dict(config)
    if config is not None:
        cfg = dict(config)
    elif interpreting():
        cfg = dict(INTERPRET_CONFIGS[m_class(M)])
    else:  # ARKERNELS_AUTOTUNE=0 or an untuned shape under capture: the bucket's first config, as the autotuner
        cfg = _config_dict(configs_for(bucket, flags.get("DOT_FP32", False))[0])  # would have pruned them
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    kernel[_grid(M, N)(cfg)](*args, bucket, **flags, **cfg, **launch)


def int8_matmul_triton(a, b, a_scale=None, b_scale=None, bias=None, out_dtype=None, *, config=None):
    """a int8 ``[M, K]``, b int8 ``[N, K]`` (checked by the caller) -> ``[M, N]``: int32 when ``out_dtype`` is
    None (no epilogue), else ``out_dtype`` with the fp32 epilogue. ``config``: explicit tile sizes
    (``BLOCK_M/N/K``, ``GROUP_M``, optional ``num_warps``/``num_stages``) instead of autotuning."""
    M, K = a.shape
    N = b.shape[0]
    epilogue = out_dtype is not None
    c = torch.empty((M, N), dtype=out_dtype if epilogue else torch.int32, device=a.device)
    if M == 0 or N == 0:
        return c
    flags = dict(HAS_A_SCALE=a_scale is not None, HAS_B_SCALE=b_scale is not None, HAS_BIAS=bias is not None,
                 EPILOGUE=epilogue)
    # The kernel reads scales and bias at unit stride: a strided or expanded (stride 0) vector is made contiguous
    # here (a no-op for the usual contiguous one), or it would read the wrong elements or past its storage.
    # None -> c, never read: the HAS_* flags compile those loads out.
    vecs = [c if t is None else t.contiguous() for t in (a_scale, b_scale, bias)]
    args = (a, b, c, *vecs, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    _launch(_int8_matmul_tuned, int8_matmul_kernel, M, N, K, args, flags, config)
    return c


_w8a16_matmul_tuned = triton.autotune(configs=ALL_CONFIGS + FP32_SMALL_M + FP32_LARGER_M, key=["M_CLASS", "N", "K"],
                                      prune_configs_by={"early_config_prune": _prune_by_class})(w8a16_matmul_kernel)


def _weight_strides(w) -> tuple[int, int]:
    """(stride_wn, stride_wk) the kernels take: the plain weight's own; packed (contiguous by construction),
    K and 1 (the kernels address it through the layout: these only feed dead code)."""
    return (w.shape[1] * w.shape[2], 1) if is_packed(w) else (w.stride(0), w.stride(1))


def _pack_flags(w, N: int, K: int) -> dict:
    packed = is_packed(w)
    return dict(PACKED=packed, WHOLE_PACK=packed and N % PACK_ROWS == 0 and K % PACK_K == 0)


def _check_packed_tiles(w, block_n: int, k_tile: int) -> None:
    """A packed weight's tiles must start on row groups and stay inside one K chunk (the layout's contract)."""
    if is_packed(w) and (block_n % PACK_ROWS or PACK_K % k_tile):
        raise ValueError(f"w8a16_matmul: a packed weight needs BLOCK_N a multiple of {PACK_ROWS} and K tiles that "
                         f"divide {PACK_K}; got BLOCK_N {block_n}, K tile {k_tile}")


def w8a16_matmul_triton(x, w, w_scale, bias=None, *, config=None, path=None, reduce="fused", pdl=None):
    """x ``[M, K]`` fp16|bf16|fp32, w int8 ``[N, K]`` or packed ``[N, K // 16, 16]``
    (arkernels/ops/int8_matmul_layout.py), w_scale fp32 ``[N]``, bias ``[N]``? (checked by the caller)
    -> ``[M, N]`` in x's dtype. The kernel follows M (:func:`w8a16_path`); ``path`` forces one of "gemv",
    "splitk", "tiled". ``config``: a decode kernel's sizes (:func:`w8a16_decode_config`'s keys) with
    ``path="gemv"`` / ``"splitk"``; without a path, the tiled kernel's tile sizes as for
    :func:`int8_matmul_triton` (that kernel at any M). ``reduce``: how a decode path adds its K splits,
    ``"fused"`` (the last program of each tile, one launch) or ``"launch"`` (a second kernel; the benchmark's
    baseline); both add in split order and give the same bits. ``config`` may name the decode kernel (``"kernel"``:
    ``"gemv"`` or ``"splitk"``, the GEMV class's K loop; default the path's). ``pdl``: False turns programmatic
    dependent launch off for this call (the benchmark's baseline); None (default) and True: where
    :func:`arkernels.triton.pdl.pdl_supported`."""
    if reduce not in REDUCES:
        raise ValueError(f"w8a16_matmul: reduce must be one of {REDUCES}, got {reduce!r}")
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    w_scale = w_scale.contiguous()  # read at unit stride, as are the bias and the scales of int8_matmul
    bias = None if bias is None else bias.contiguous()
    if path is None:
        path = "tiled" if config is not None else w8a16_path(M, x.dtype)
    dot_fp32 = x.dtype == torch.float32 or interpreting()
    if path != "tiled":
        _w8a16_decode(path, x, w, w_scale, bias, out, dot_fp32, config, reduce, pdl is not False)
        return out
    args = (x, w, w_scale, w_scale if bias is None else bias, out, M, N, K, x.stride(0), x.stride(1),
            *_weight_strides(w), out.stride(0), out.stride(1))
    flags = dict(HAS_BIAS=bias is not None, DOT_FP32=dot_fp32, **_pack_flags(w, N, K))
    if config is not None:
        _check_packed_tiles(w, config["BLOCK_N"], config["BLOCK_K"])
    _launch(_w8a16_matmul_tuned, w8a16_matmul_kernel, M, N, K, args, flags, config)
    return out


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: as few, large programs as possible (~0.5 ms per program instance)
    return torch.cuda.get_device_properties(device).multi_processor_count


class _Tickets:
    """The fused reduce's tickets of one (device, stream): an int64 tensor, 0 between launches, and the epoch of
    the next launch. Per stream: launches on one stream run one after another, so they can share tickets (two
    streams could run two launches at once). Grown (a new zeroed tensor) when a grid needs more tiles. A CUDA graph
    keeps the tickets of the stream it was captured on (torch.cuda.graph's default capture stream is one for all
    graphs): graphs captured on one stream must not be replayed concurrently on two streams. Created during a
    capture, the tensor comes from the graph's pool and its zero-fill becomes a node of the graph (harmless: it
    runs before the graph's launches, which find the reset value anyway)."""

    def __init__(self):
        self.tensor, self.epoch, self.retired = None, 0, []

    def take(self, device: torch.device, tiles: int) -> tuple[torch.Tensor, int]:
        if self.tensor is None or self.tensor.numel() < tiles:
            if self.tensor is not None:  # a captured CUDA graph may hold its address: never freed
                self.retired.append(self.tensor)
            self.tensor = torch.zeros(max(tiles, 1 << 14), dtype=torch.int64, device=device)  # 128 KB
        self.epoch = self.epoch % EPOCH_MAX + 1
        return self.tensor, self.epoch


_TICKETS: dict = {}


def _tickets(device: torch.device, tiles: int) -> tuple[torch.Tensor, int]:
    """(tickets, epoch) for a fused launch of ``tiles`` output tiles on ``device``'s current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _TICKETS.setdefault((device, stream), _Tickets()).take(device, tiles)


def _w8a16_decode(path, x, w, w_scale, bias, out, dot_fp32, config, reduce="fused", pdl=True):
    M, K = x.shape
    N = w.shape[0]
    cfg = dict(config) if config is not None else w8a16_decode_config(path, M, N, K, _num_sms(x.device))
    launch = {k: cfg.pop(k) for k in ("num_warps", "num_stages") if k in cfg}
    kernel = cfg.pop("kernel", path)  # the GEMV class's plan may run the split-K kernel's K loop (fewer splits)
    k_per_split = cfg.pop("K_PER_SPLIT", cfg["BLOCK_K"])
    if kernel == "gemv":
        assert k_per_split == cfg["BLOCK_K"] * cfg["K_HALVES"], "gemv: one x slice of K_HALVES * BLOCK_K per program"
    else:
        cfg.pop("K_HALVES", None)
    if M * N >= 1 << 31:  # the partial sums' in-split offsets are int32
        raise ValueError(f"w8a16_matmul: M x N = {M} x {N} outputs is too many for a decode path (< 2^31)")
    split_k = triton.cdiv(K, k_per_split) if K > 0 else 1
    # K == 0: one split of nothing (zeros, then scale and bias), not an empty grid that leaves out unwritten
    grid = (triton.cdiv(N, cfg["BLOCK_N"] * cfg["N_TILES"]), split_k)
    split = split_k > 1
    fused = split and reduce == "fused"
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split else out
    tickets, epoch = _tickets(x.device, grid[0]) if fused else (part, 0)  # never read without FUSED
    bias_arg = w_scale if bias is None else bias  # never read without HAS_BIAS
    _check_packed_tiles(w, cfg["BLOCK_N"], k_per_split if kernel == "gemv" else cfg["BLOCK_K"])
    args = (x, w, w_scale, bias_arg, out, part, tickets, epoch, M, N, K, x.stride(0), x.stride(1),
            *_weight_strides(w), out.stride(0), out.stride(1))
    block, unroll = reduce_shape(M, cfg["BLOCK_N"] * cfg["N_TILES"], split_k, launch.get("num_warps", 4))
    flags = dict(HAS_BIAS=bias is not None, SPLIT=split, FUSED=fused, EVEN_K=K > 0 and K % k_per_split == 0,
                 DOT_FP32=dot_fp32, REDUCE_BLOCK=block if fused else 1, REDUCE_UNROLL=unroll if fused else 1,
                 **_pack_flags(w, N, K))
    if pdl and pdl_supported(x.device):  # the constexpr and the launch attribute together, never one alone
        flags["PDL"] = launch["launch_pdl"] = True
    if kernel == "gemv":
        # only the packed addressing reads it: the plain weight keeps one specialization
        flags["N_EDGE"] = not flags["PACKED"] or N % (cfg["BLOCK_N"] * cfg["N_TILES"]) != 0
        w8a16_gemv_kernel[grid](*args, **flags, **cfg, **launch)
    else:
        w8a16_splitk_kernel[grid](*args, k_per_split, **flags, **cfg, **launch)
    if split and not fused:
        splitk_reduce_kernel[(M, triton.cdiv(N, REDUCE_BLOCK_N))](
            part, w_scale, bias_arg, out, M, N, split_k, out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
            BLOCK_N=REDUCE_BLOCK_N, num_warps=4)
