"""Helpers every benchmark shares: timing (CUDA events on a GPU, perf_counter on the CPU), results as CSV + JSON +
PNG, and the short table printed last."""
from __future__ import annotations

import argparse
import csv
import json
import os
import time

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small sweep that finishes on the CPU in seconds (CI)")
    p.add_argument("--out", default=os.environ.get("ARKERNELS_BENCH_OUT", "bench_out"), help="output folder")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def timeit(fn, *, warmup: int = 3, iters: int = 20, device: str | torch.device | None = None) -> float:
    """Median seconds per call of ``fn()``."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(warmup):
        fn()
    times = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def device_name(device) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def write_results(rows: list[dict], out_dir: str, name: str, *, plot: tuple[str, str, str] | None = None,
                  logx: bool = True, title: str | None = None) -> None:
    """Write ``name.csv`` and ``name.json``; with ``plot=(x, y, series)`` also ``name.png`` (one line per
    distinct value of the ``series`` column)."""
    os.makedirs(out_dir, exist_ok=True)
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if plot is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x, y, series = plot
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in dict.fromkeys(r[series] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[series] == s and r.get(y) is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(s))
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title or name)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], cols: list[str]) -> None:
    """A short fixed-width table of ``cols`` (printed last by every benchmark)."""
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))


def simt_traffic(name: str, fn, necessary: int) -> dict | None:
    """Run ``fn()`` once in the SIMT emulator (the CUDA kernels' own source on the CPU, arkernels/simt.py) and count
    its global-memory bytes: ``{"kernel", "moved_B", "necessary_B", "ratio", per-buffer "<name>_rw"}``. ``necessary``
    is what an ideal kernel must move (each input byte read once, each output byte written once). None without an
    emulator build (python -m arkernels.simt build)."""
    import arkernels.simt

    if not arkernels.simt.available():
        return None
    with arkernels.simt.emulate():
        fn()
    totals = arkernels.simt.traffic()
    moved = sum(r + w for r, w in totals.values())
    row = {"kernel": name, "moved_B": moved, "necessary_B": necessary, "ratio": moved / necessary}
    row.update({f"{k}_rw": f"{r}/{w}" for k, (r, w) in totals.items() if r or w})
    return row
