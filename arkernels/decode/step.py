"""The one-token decode step of ``arkernels.generate``: per-step inputs in one device buffer, fed without a host
wait (``DecodeStep``); ``StaticDecode`` pads the rows to batch-size buckets and, on CUDA, captures each bucket's step
in a CUDA graph (``cuda_graphs=True``), optionally under ``torch.compile`` (``compile=True``).
"""
from __future__ import annotations

import numpy as np
import torch


def bucket(n: int, batch: int) -> int:
    """The batch-size bucket of ``n`` active rows: the next power of two, capped at the batch."""
    return min(1 << (n - 1).bit_length(), batch)


_WARMUP = 2  # eager runs of a bucket's step on a side stream before its capture (allocator + Triton JIT warm)


class DecodeStep:
    """The one-token decode step over fixed per-step buffers, fed without a host wait (the default path: eager, no
    padding; ``StaticDecode`` pads to buckets and captures).

    Per batch size ``b`` one int64 buffer ``[7 + groups, b]`` on the model's device holds every per-step input, one
    row each: input ids, position ids, seq_lens after the step, cache row index, sampling seed, sampling step, the
    index of each row in the previous step's output, then the new token's slot in each cache group. The host writes
    rows 1.. into a pinned host buffer (numpy, no tensor built from a list) and sends it with one non-blocking copy;
    the ids (row 0) are gathered on the device from the previous step's output: sampled ids never visit the host on
    their way to the next step. Columns past the active count are padding: id of output 0, position 0, seq_len 0 (the
    attention kernel outputs zeros), row 0, slot -1 (nothing written). ``fetch`` starts the copy of a step's ids to a
    pinned host buffer (non-blocking), ``read`` waits for it: the loop reads step t while step t+1 runs.

    Two pinned plan buffers and two pinned id buffers alternate: the loop reads step t's ids (which follow step t's
    plan copy on the stream) before it writes step t+2's plan into the same buffer.
    """

    pad = False  # pad the active rows up to a batch-size bucket (``StaticDecode``)
    ahead = 64  # tokens of block reservation ahead (full-attention groups): most steps write no table entry

    def __init__(self, model, cache, cache_kw: str, batch: int, seeds: list[int], draw, capture: bool = False,
                 compile: bool = False, token_state: torch.Tensor | None = None):
        self.model, self.cache, self.cache_kw = model, cache, cache_kw
        self.batch, self.seeds, self.draw, self.capture = batch, np.asarray(seeds, dtype=np.int64), draw, capture
        # the step as run and captured: eager, or compiled once per bucket (``b`` is a Python int: dynamo
        # specialises on it, so each bucket gets its own fixed-shape graph; every other host value the trace reads
        # is the same at every step: tests/test_generate.py counts one graph per bucket)
        self.run = torch.compile(self._forward, dynamic=False) if compile else self._forward
        self.device = next(model.parameters()).device
        self.num_groups = len(cache.groups)
        self.allocate_host(batch, pin=self.device.type == "cuda")
        self.plans_np = [p.numpy() for p in self.plans]  # the host writes the plan through these views
        self.plan_tick = self.id_tick = 0
        self.buffers: dict[int, torch.Tensor] = {}  # bucket -> int64 [7 + groups, bucket]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, token ids [b])
        self.pool = None  # one CUDA graph memory pool shared by every bucket (captured largest first)
        self.generation = cache.generation
        self.prev: torch.Tensor | None = None  # the last step's token ids on the device
        # the token rules' history, counted after each step outside the captured / compiled region: warm-up runs and
        # replays of a freshly captured graph recompute a step, and must not count its token twice
        self.token_state = token_state

    def allocate_host(self, batch: int, pin: bool) -> None:
        """The host buffers of the step, two of each (alternated: one may still be copying while the host fills the
        other), pinned on CUDA: ``plans`` (int64 ``[7 + groups, batch]`` flat, the step's inputs) and ``ids`` (the
        fetched token ids) with their ``events``. A subclass with another plan overrides this."""
        self.rows_per_step = 7 + self.num_groups
        self.plans = [torch.empty(self.rows_per_step * batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.ids = [torch.empty(batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pin else None

    def step(self, rows: list[int], src: list[int], positions: list[int], steps: list[int]) -> torch.Tensor:
        """One token for each of ``rows`` (cache rows) at ``positions``, fed the ids at ``src`` of the last fetched
        output (device-side gather); returns int64 ``[len(rows)]`` on the device."""
        n = len(rows)
        b = bucket(n, self.batch) if self.pad else n
        slots = self.cache.begin_static_step(rows, ahead=self.ahead)
        k = self.plan_tick % 2
        self.plan_tick += 1
        plan = self.plans[k][: self.rows_per_step * b].view(self.rows_per_step, b)
        a = self.plans_np[k][: self.rows_per_step * b].reshape(self.rows_per_step, b)
        pos = np.asarray(positions, dtype=np.int64)
        a[:, n:] = 0
        a[0, :n] = 0
        a[1, :n] = pos
        a[2, :n] = pos + 1
        a[3, :n] = rows
        a[4, :n] = self.seeds[rows]
        a[5, :n] = steps
        a[6, :n] = src
        for i, s in enumerate(slots):
            a[7 + i, :n] = s
            a[7 + i, n:] = -1
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = torch.empty((self.rows_per_step, b), dtype=torch.int64, device=self.device)
        buf.copy_(plan, non_blocking=True)
        torch.index_select(self.prev, 0, buf[6], out=buf[0])  # outside any graph: the previous output moves
        out = self._replay(b) if self.capture else self.run(b)
        if self.token_state is not None:
            from arkernels.ops.sampling import update_token_state

            update_token_state(self.token_state, out[:n], buf[3][:n])
        return out[:n]

    def fetch(self, out: torch.Tensor):
        """Start copying ``out`` (int64 ``[n]`` token ids) to the host; it also feeds the next ``step``."""
        self.prev = out
        k = self.id_tick % 2
        self.id_tick += 1
        host = self.ids[k][: out.shape[0]]
        host.copy_(out, non_blocking=True)
        if self.events is None:
            return host, None
        self.events[k].record()
        return host, self.events[k]

    @staticmethod
    def read(handle) -> list[int]:
        """The ids of a ``fetch``, once the copy has landed (the loop's one wait, a step behind the device)."""
        host, event = handle
        if event is not None:
            event.synchronize()
        return host.tolist()

    def _forward(self, b: int) -> torch.Tensor:
        """The static step of bucket ``b`` (what a CUDA graph captures): int64 token ids ``[b]``."""
        buf = self.buffers[b]
        self.cache.set_static_step(buf[3], buf[2].to(torch.int32), [buf[7 + i] for i in range(self.num_groups)])
        logits = self.model(input_ids=buf[0][:, None], position_ids=buf[1][:, None], use_cache=True,
                            **{self.cache_kw: self.cache}).logits[:, -1]
        # padding columns (seq_len 0) get history row -1: no rule, and they are never counted
        return self.draw(logits, buf[4], buf[5], torch.where(buf[2] > 0, buf[3], -1))

    def _replay(self, b: int) -> torch.Tensor:
        if self.cache.generation != self.generation:  # a table or pool moved: every captured graph is stale
            self.graphs.clear()
            self.generation = self.cache.generation
        entry = self.graphs.get(b)
        if entry is None:
            entry = self.graphs[b] = self._capture(b)
        graph, out = entry
        graph.replay()
        return out

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP):
                self.run(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # one pool for every bucket: safe because graphs never run concurrently and are replayed in capture order
        # (the batch only shrinks, so buckets are first used, captured and replayed largest first), and the one
        # value that outlives a replay, its token ids ``out``, stays referenced by ``self.graphs``
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.run(b)
        return graph, out


class StaticDecode(DecodeStep):
    """The decode step of ``cuda_graphs=True``: the active rows padded up to a batch-size bucket, so the step's shapes
    take few values; on CUDA each bucket's step is captured once and replayed.

    The captured region (``_forward``) reads only the bucket's buffer, the cache's block tables and pools, and the
    weights: no ``.tolist()``/``.item()``, no tensor from host data. Re-running a step is harmless (the same K/V to
    the same slots, attention only reads), which is what lets the warm-up runs and the replay of a freshly captured
    graph compute the same step. A graph is stale once the cache reallocates a table or pool
    (``PagedCache.generation``): the graphs are then dropped and recaptured.
    """

    pad = True


def register_static() -> str:
    """The attention implementation of the compiled static step: arkernels' attention registered without a mask
    function, so transformers' mask builders return None at once (``_preprocess_mask_arguments`` gives no mask to an
    implementation without one). With arkernels' own mask function, ``arkernels_mask`` returns sdpa's 4D mask while
    ``torch.compile`` traces, and the attention then asks the static step for dense keys, which it has not (a
    RuntimeError, seen on the tiny Llama). The static step's attention reads its bounds from ``PagedStep`` only."""
    from transformers import AttentionInterface

    from arkernels.hf.attention import arkernels_attention

    AttentionInterface.register(STATIC_NAME, arkernels_attention)
    return STATIC_NAME


STATIC_NAME = "arkernels_static"
