"""Build arkernels: one extension, ``arkernels._C``.

Build knobs (all printed at build time):
  ARKERNELS_CUDA=auto|0|1   auto: build CUDA kernels when a CUDA toolkit is found (a GPU is NOT needed);
                            0: CPU-only; 1: CUDA required, fail loudly when it cannot be built.
  TORCH_CUDA_ARCH_LIST      default "8.0;9.0" (torch's own GPU detection crashes without a GPU).
  CUDA_HOME                 default: the directory above bin/nvcc, else /usr/local/cuda (the nvcc on
                            PATH may be a wrapper script that makes torch guess wrong).
  MAX_JOBS                  parallel compile jobs (torch honours it).
  DEBUG=1                   -O0 -g host code and -lineinfo device code.
"""
import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _say(msg: str) -> None:
    print(f"[arkernels setup] {msg}", file=sys.stderr, flush=True)


def _default_cuda_home():
    for cand in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.exists(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.isdir(os.path.join(root, "include")) and os.path.isdir(os.path.join(root, "lib64")):
            return root
    return None


mode = os.environ.get("ARKERNELS_CUDA", "auto").strip().lower()
if mode not in ("auto", "0", "1"):
    raise SystemExit(f"ARKERNELS_CUDA must be auto, 0 or 1, got {mode!r}")

# Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME at import time.
if mode != "0" and not os.environ.get("CUDA_HOME"):
    home = _default_cuda_home()
    if home:
        os.environ["CUDA_HOME"] = home
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

debug = os.environ.get("DEBUG", "0") == "1"
toolkit = CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc"))
torch_has_cuda = torch.version.cuda is not None
build_cuda = mode == "1" or (mode == "auto" and toolkit and torch_has_cuda)
if mode == "1" and not (toolkit and torch_has_cuda):
    raise SystemExit(
        "ARKERNELS_CUDA=1 but CUDA cannot be built: "
        f"toolkit found={toolkit} (CUDA_HOME={CUDA_HOME}), torch CUDA version={torch.version.cuda}"
    )

cpu_sources = ["csrc/torch_bindings.cpp"] + sorted(glob.glob("csrc/*_cpu.cpp"))
cuda_sources = sorted(glob.glob("csrc/*.cu"))
cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
if build_cuda:
    cxx_flags += ["-DARKERNELS_WITH_CUDA"]
nvcc_flags = ["-O3", "--use_fast_math", "-Xptxas", "-v", "-DARKERNELS_WITH_CUDA",
              "--expt-relaxed-constexpr"]
if debug:
    nvcc_flags += ["-lineinfo"]

_say(f"torch {torch.__version__} (CUDA {torch.version.cuda}), ARKERNELS_CUDA={mode}")
_say(f"CUDA_HOME={CUDA_HOME} toolkit={'yes' if toolkit else 'no'} -> building CUDA kernels: {build_cuda}")
_say(f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']} MAX_JOBS={os.environ.get('MAX_JOBS', 'torch default')} DEBUG={int(debug)}")

if build_cuda:
    ext = CUDAExtension(
        "arkernels._C",
        sources=cpu_sources + cuda_sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
else:
    ext = CppExtension("arkernels._C", sources=cpu_sources, extra_compile_args={"cxx": cxx_flags})

_sources = cpu_sources + (cuda_sources if build_cuda else [])
_say(f"sources: {len(cpu_sources)} C++ (CPU kernels + op schemas)" + (
    f", {len(cuda_sources)} CUDA x {len(os.environ['TORCH_CUDA_ARCH_LIST'].split(';'))} archs "
    "(each CUDA file takes minutes on 2 cores)" if build_cuda else "; no CUDA files"))


class _TimedBuild(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension (ninja: one "[i/n]" line per compile step in the verbose log), saying when the
    compile starts and how long it took."""

    def build_extensions(self):
        import time

        t0 = time.perf_counter()
        _say(f"compiling {len(_sources)} files with ninja (MAX_JOBS={os.environ.get('MAX_JOBS', 'torch default')})")
        super().build_extensions()
        _say(f"compiled and linked arkernels._C in {time.perf_counter() - t0:.0f} s")


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": _TimedBuild},
)
