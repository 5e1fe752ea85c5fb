"""The SIMT emulator: the hand-written CUDA kernels' own source, compiled by the host C++ compiler and run on the CPU.

No development or CI machine here has a GPU, so this is how the CUDA source is tested: ``csrc/<stem>_kernels.cuh``
(device code + launch planning) and ``csrc/<stem>_launch.h`` (the tensor side of a launch) are compiled with
``csrc/simt/simt.h`` instead of nvcc into a small library whose ops, ``arkernels_simt::<op>``, take CPU tensors and
have arkernels' own schemas (copied from the ``arkernels`` namespace here, so they are written once). Blocks run one
at a time, the threads of a block are real threads (barriers, shuffles and tensor-core collectives are checked), and
every global load and store is counted per byte of each named argument (:func:`traffic`).

Usage::

    python -m arkernels.simt build                       # build/simt/arkernels_simt.so (cached; ~1-2 min on 2 cores)
    python -m arkernels.simt build --sanitize thread     # build/simt-thread/... for TSan (LD_PRELOAD libtsan)
    with arkernels.simt.emulate():                       # arkernels.<op> on CPU tensors now runs the CUDA source
        out = arkernels.window_attention(q, k, v, table, lens)
    arkernels.simt.traffic()                             # {"k_cache": (read bytes, written bytes), ...}

``ARKERNELS_SIMT_LIB`` names another build to load (a sanitizer build, or a fault-injected copy of csrc/).
The CPU kernels (csrc/<stem>_cpu.cpp) stay the fast CPU path; the emulator is a test instrument, not installed.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arkernels import _library  # noqa: F401  (defines the arkernels:: schemas we copy)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
# The hand-written CUDA ops the emulator runs (Triton ops run under TRITON_INTERPRET instead).
OPS = ("paged_kv_append", "paged_kv_gather", "window_attention", "w8a16_fragment_matmul")
NAMESPACE = "arkernels_simt"
LIB_NAME = "arkernels_simt.so"

_lib_def = None  # the torch.library.Library holding the copied schemas
_loaded_path = None


def _cuda_include() -> pathlib.Path | None:
    """The CUDA toolkit's headers (cuda_fp16.h & co. have host implementations the emulator uses)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (pathlib.Path(home) / "include" / "cuda_fp16.h").exists():
            return pathlib.Path(home) / "include"
    return None


def default_out(sanitize: str | None = None) -> pathlib.Path:
    return ROOT / "build" / ("simt" if not sanitize else f"simt-{sanitize}")


SANITIZE_FLAGS = {
    None: ["-O2"],
    "thread": ["-O1", "-g", "-fsanitize=thread"],
    "address": ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
                "-fno-omit-frame-pointer"],
}


def build(src: str | os.PathLike = CSRC, out: str | os.PathLike | None = None, sanitize: str | None = None,
          force: bool = False, quiet: bool = False) -> pathlib.Path:
    """Compile ``src/simt/simt_ops.cpp`` (and the kernel headers it includes) into ``out/arkernels_simt.so``.

    Rebuilt only when a file under ``src`` is newer than the library (or ``force``). ``sanitize``: None, "thread"
    or "address" (address + undefined behaviour). Returns the library's path.
    """
    cuda_inc = _cuda_include()
    if cuda_inc is None:
        raise RuntimeError("arkernels.simt: the emulator needs the CUDA toolkit's headers (cuda_fp16.h); set CUDA_HOME")
    os.environ.setdefault("CUDA_HOME", str(cuda_inc.parent))  # read by cpp_extension at import (else: a warning)
    from torch.utils.cpp_extension import include_paths, library_paths

    src = pathlib.Path(src).resolve()
    out = pathlib.Path(out) if out is not None else default_out(sanitize)
    out.mkdir(parents=True, exist_ok=True)
    lib = out / LIB_NAME
    inputs = [p for p in src.rglob("*") if p.suffix in (".h", ".cuh", ".cpp")]
    if lib.exists() and not force and all(p.stat().st_mtime <= lib.stat().st_mtime for p in inputs):
        return lib
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = ["g++", "-std=c++20", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing", "-DARKERNELS_SIMT",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-Wall", "-Wno-unused-function", "-Wno-unknown-pragmas",
           "-Wno-class-memaccess", "-Wno-array-bounds", "-Wno-unused-variable", "-Wno-sign-compare",
           # uninitialised registers (a missing accumulator init) hold a 0xFE.. pattern, as garbage on a GPU would,
           # instead of the zeros of a fresh thread stack
           "-ftrivial-auto-var-init=pattern",
           *SANITIZE_FLAGS[sanitize], f"-I{src}", f"-I{cuda_inc}"]
    cmd += [f"-I{p}" for p in include_paths()]
    cmd += [str(src / "simt" / "simt_ops.cpp"), "-o", str(lib)]
    cmd += [f"-L{p}" for p in library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu"]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"arkernels.simt: build failed ({' '.join(cmd)}):\n{res.stderr[-20000:]}")
    if not quiet:
        print(f"[simt] built {lib} ({sanitize or 'plain'}) in {time.time() - t0:.0f} s", file=sys.stderr)
    return lib


def library_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get("ARKERNELS_SIMT_LIB") or default_out() / LIB_NAME)


def available() -> bool:
    """True when an emulator library is built (or named by ARKERNELS_SIMT_LIB) and loads."""
    try:
        load()
    except (OSError, RuntimeError):
        return False
    return True


def load(path: str | os.PathLike | None = None) -> None:
    """Define arkernels_simt::<op> with arkernels' schemas and load the emulator library (once per process)."""
    global _lib_def, _loaded_path
    path = pathlib.Path(path) if path is not None else library_path()
    if _loaded_path is not None:
        if path.resolve() != _loaded_path:
            raise RuntimeError(f"arkernels.simt: {_loaded_path} is loaded already; one emulator build per process")
        return
    if not path.exists():
        raise RuntimeError(f"arkernels.simt: no emulator library at {path}; run `python -m arkernels.simt build`")
    if _lib_def is None:
        _lib_def = torch.library.Library(NAMESPACE, "FRAGMENT")
        for op in OPS:
            schema = str(getattr(torch.ops.arkernels, op).default._schema)
            _lib_def.define(schema.split("::", 1)[1])
    torch.ops.load_library(str(path))
    _loaded_path = path.resolve()


class _Emulate(TorchDispatchMode):
    """Routes arkernels::<op> (for the hand-written CUDA ops) to arkernels_simt::<op>; everything else runs as is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "arkernels" and func._opname in OPS:
            return getattr(getattr(torch.ops, NAMESPACE), func._opname).default(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def emulate(device: str | None = None, block_order: int | None = None, visibility: bool | None = None,
            pdl: bool | None = None, cluster: bool | None = None):
    """Within the block, arkernels' CUDA ops called on CPU tensors run their CUDA source in the emulator.

    ``device``: "sm_80", "sm_89" or "sm_90" (default: the current one, initially sm_90): the SM count and shared
    memory limit launch planning sees. ``block_order``: 0 runs each grid's blocks in linear order, any other value
    in a permutation drawn from that seed (default: the current setting, initially 0). ``visibility``: True (the
    initial setting) makes a block's global stores visible to the blocks after it only once a release ordered them
    (``__threadfence`` or ``dev::atomic_add_release`` / ``dev::fence_acq_rel`` by the storing thread, or by another
    thread of its block after a ``__syncthreads``; the rest land when the launch ends), and reports a load of another
    block's published bytes that no acquire ordered (csrc/simt/simt.h); False: every store at once, no report.
    ``pdl``: True (the initial setting) makes the kernels' launches programmatic dependent launches on an sm_90 device
    (csrc/pdl.cuh), in which a thread's global access before its ``griddepcontrol.wait``, or a thread that exits
    without one, is reported; False: plain launches (ARKERNELS_PDL=0 at process start does the same).
    ``cluster``: True (the initial setting) lets launch planning take thread-block clusters on an sm_90 device
    (csrc/cluster.cuh: decode's split-KV combine through distributed shared memory); False: none (ARKERNELS_CLUSTER=0
    at process start does the same).
    Every tensor an emulated op allocates (outputs, scratch) starts out poisoned (0xFF bytes: NaN).
    """
    load()
    ns = getattr(torch.ops, NAMESPACE)
    previous, previous_order, previous_vis = ns.get_device(), ns.get_block_order(), ns.get_visibility()
    previous_pdl, previous_cluster = ns.get_pdl(), ns.get_cluster()
    if device is not None:
        ns.set_device(device)
    if block_order is not None:
        ns.set_block_order(block_order)
    if visibility is not None:
        ns.set_visibility(visibility)
    if pdl is not None:
        ns.set_pdl(pdl)
    if cluster is not None:
        ns.set_cluster(cluster)
    try:
        with _Emulate():
            yield
    finally:
        ns.set_device(previous)
        ns.set_block_order(previous_order)
        ns.set_visibility(previous_vis)
        ns.set_pdl(previous_pdl)
        ns.set_cluster(previous_cluster)


def mma_probe(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bf16: bool) -> torch.Tensor:
    """One emulated ``mma.sync.m16n8k16`` (csrc/device_mma.cuh under the emulator): per-lane registers ``a`` int32
    ``[32, 4]``, ``b`` int32 ``[32, 2]`` (16-bit pairs, low half first), ``c`` fp32 ``[32, 4]`` -> ``d`` fp32 ``[32, 4]``."""
    load()
    return getattr(torch.ops, NAMESPACE).mma_probe(a, b, c, bf16)


def ldmatrix_probe(tile: torch.Tensor, n: int, trans: bool) -> torch.Tensor:
    """One emulated ``ldmatrix.x{n}[.trans]``: lane l gives row l of ``tile`` (int16 ``[32, 8]``: row r of matrix m is
    row 8m + r) and receives int32 ``[32, n]``."""
    load()
    return getattr(torch.ops, NAMESPACE).ldmatrix_probe(tile, n, trans)


def abort_block_of_next_launch(block: int) -> None:
    """Make the next emulated kernel launch abort on one block: block ``block`` (linear id, x fastest, as
    ``x + gx * (y + gy * z)``) never runs, as if it had trapped; the other blocks run as usual. One-shot."""
    load()
    getattr(torch.ops, NAMESPACE).abort_block_of_next_launch(block)


def traffic() -> dict[str, tuple[int, int]]:
    """Global-memory bytes of the last emulated op call: ``{argument name: (read, written)}``, plus the scratch buffers
    the launch code names (window_attention decode: "part_out", "part_lse", "split_counters"); "other" counts bytes
    outside every named buffer (the outputs the op allocated)."""
    names, reads, writes = getattr(torch.ops, NAMESPACE).traffic_totals()
    return {n: (r, w) for n, r, w in zip(names, reads, writes)}


def traffic_map(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-byte (read count, write count) int32 tensors over the storage of argument ``name`` in the last call."""
    return getattr(torch.ops, NAMESPACE).traffic_map(name)


def launches() -> list[dict[str, object]]:
    """The kernel launches of the last emulated op call, in order: ``{"grid": (x, y, z), "threads": n, "smem": dynamic
    shared-memory bytes, "pdl": a programmatic dependent launch (csrc/pdl.cuh), "triggered": CTAs that executed
    griddepcontrol.launch_dependents, "cluster": blocks per thread-block cluster (1: none), "dsmem": bytes loaded and
    stored through distributed shared memory}`` each (what tests check the launch planning against)."""
    flat = getattr(torch.ops, NAMESPACE).launch_log()
    return [{"grid": tuple(flat[i:i + 3]), "threads": flat[i + 3], "smem": flat[i + 4], "pdl": bool(flat[i + 5]),
             "triggered": flat[i + 6], "cluster": flat[i + 7], "dsmem": flat[i + 8]} for i in range(0, len(flat), 9)]


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arkernels.simt", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the emulator library")
    b.add_argument("--src", default=str(CSRC), help="the csrc folder to compile (default: this checkout's)")
    b.add_argument("--out", default=None, help="output folder (default build/simt[-SANITIZER])")
    b.add_argument("--sanitize", choices=["thread", "address"], default=None)
    b.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    print(build(args.src, args.out, args.sanitize, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
