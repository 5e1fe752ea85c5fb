"""A paged KV cache as a transformers ``Cache`` built from ``CacheLayerMixin`` layers.

Layout (vLLM / FlashInfer NHD): each layer owns K and V pools ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Layers that see the same positions share one ``arkernels.cache.table.BlockTable`` (block lists, lengths, the int32
table ``[rows, capacity]``, copy-on-write, window freeing, the fixed-shape reservation): all full-attention layers form
one group, the sliding layers of one window W another (vLLM's hybrid allocator). The layers are the table's pool
owners: it asks them to grow their pools and to copy a block; this module adds only what transformers and the
attention function see (``PagedLayer.update``, ``PagedStep``, the ``Cache`` API).

A sliding group returns to its pool every block that falls wholly out of the window before it reserves new slots, so
its memory stays bounded by ``W - 1 + new tokens`` per row, as transformers' ``DynamicSlidingWindowLayer`` is; freed
table entries point at block 0, a scratch block that is never handed out, so a kernel that reads them anyway reads
memory it owns.

Four drive protocols, chosen per forward in ``PagedLayer.update`` (``arkernels.hf.cache_layer``) by these flags
(first match wins):

========  ====================================  ============================================  ==========================
protocol  caller                                flags that steer it                           host half | device half
========  ====================================  ============================================  ==========================
static    arkernels.generate(cuda_graphs=True)  ``static`` (per group: set_static_step sets   begin_static_step |
          decode steps                          it, end_static clears it)                     set_static_step, update
fixed     model.generate, compileable=True      ``fixed`` (unfix clears it for good);         fixed_forward (layer 0) or
          (arkernels.patch: greedy, sampling)   ``host_ahead`` (begin_forward did the host    begin_forward | update
                                                half); ``leaving`` (dense K/V asked: unfix    (advance_fixed_device)
                                                at the next forward)
planned   arkernels.generate (eager steps)      ``plan`` (begin_step / set_rows; the group's  all in update: a group's
                                                ``plan is cache.plan``: already advanced)     first layer advances it
host      model.generate (eager), any caller    none of them (``layer.length == lens[0]``:    all in update: a group's
          of Cache.update                       the group's first layer in this forward)      first layer advances it
========  ====================================  ============================================  ==========================

- host: every layer's ``update`` receives ``[B, Hkv, T, D]`` and all rows advance by T; the first layer of a group to
  see a forward reserves the slots, the others reuse them.
- planned: ``begin_step(rows, q_lens)`` plans one forward over a subset of rows with ragged query lengths (packed
  prefill ``[1, sum(q_lens)]`` or decode ``[len(rows), 1]``), then the layers follow the plan.
- static: ``begin_static_step(rows)`` does the host half of a one-token step (frees / reserves blocks, returns each
  row's slot per group) outside any graph; ``set_static_step(row_index, seq_lens, slots)`` is the device half, tensor
  ops only (graph-safe): every layer then appends at ``slots`` and attends through
  ``block_table.index_select(0, row_index)``, for a padded batch whose extra rows have slot -1 (nothing written) and
  seq_len 0 (the kernel outputs zeros). The block tables and pools must then stay where they are: ``generation``
  counts their reallocations (a captured graph is stale after one).
- fixed: the first forward reserves every block of the call (``max_length`` per row; a sliding group a ring of
  blocks that logical block i reuses as ``i % ring``) and builds the table and each position's slot once; a forward's
  device half is then a gather of the slots at the rows' lengths and an in-place advance of those lengths (no host
  data, no sync: what torch.compile traces and a CUDA graph replays), its host half (the lengths ``get_seq_length``
  reports) runs eagerly, inside ``update`` or, before a compiled forward, in ``begin_forward``. Reorders, rollback, a
  forward longer than the reservation or a request for dense K/V move the cache to the host path (``unfix``) for good.

Can two become one? host and planned: yes, in principle: host is planned with the implicit plan
``(range(B), [T] * B)`` derived by the group's first layer; what keeps them apart is only who makes the plan and
host's check that every layer sees every forward (``layer.length``), so they could share one branch without changing
behaviour (not done here: ``update``'s two branches also differ in when ``layer.length`` advances, which
``get_seq_length`` reports mid-forward). static and fixed: not without a cost: both split a step into a host half and
a graph-safe device half, but fixed reserves the whole call up front for rows that advance together, while static
serves ragged rows that finish, fork and grow (blocks reserved per step, ``ahead`` at a time); folding static into
fixed would reserve ``max_length`` for every row of ``arkernels.generate`` up front.

Beam search, parallel samples and rollback (transformers' ``Cache`` API), per group:
- ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``: a permutation (with repeats) of
  block-table rows plus reference counts (``BlockAllocator.fork``); no K/V byte moves. The next write into a shared,
  partly filled last block copies that one block first (copy-on-write, ``bytes_copied``): at most one block per beam
  per layer per step, where ``DynamicCache`` copies the whole cache on every reorder.
- ``crop``: lengths shrink, whole blocks past the new length return to the pool; sliding groups follow
  ``DynamicSlidingWindowLayer``'s rules (only while recording their past, which generate turns on for assisted
  decoding; a recording group keeps its out-of-window blocks until the crop).
- ``layer.keys`` / ``layer.values``: dense tensors gathered on demand (see ``PagedLayer.keys`` for the cost).

``get_seq_length`` and ``get_mask_sizes`` agree with ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` for the same
updates: transformers sizes its masks and positions from them.
"""
from __future__ import annotations

import torch

from arkernels.cache.table import BlockTable
from arkernels.cache.fp8 import kv_cache_dtype_of, per_layer_scales
from arkernels.hf.cache_layer import PagedLayer, PagedStep, no_dense

try:
    from transformers.cache_utils import Cache, DynamicCache
except ImportError as e:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("arkernels.hf needs transformers>=5.17: pip install 'arkernels[hf]'") from e

try:
    from packaging.version import Version
    import transformers as _tf

    _LEGACY_POSITIVE_CROP = Version(_tf.__version__) < Version("5.18")  # 5.17: crop(n > 0) = keep n positions
except Exception:  # pragma: no cover
    _LEGACY_POSITIVE_CROP = False


def _layer_windows(config) -> list[int]:
    """Per layer: 0 for full attention, W for a sliding window of W keys or a chunked layer of W-position chunks
    (the same rule DynamicCache applies)."""
    config = config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kw = get_layer_types_and_kwargs(config)
        if isinstance(kw, dict):  # 5.17: one kwargs dict for every layer; 5.24: one per layer
            kw = [kw] * len(types)
    except ImportError:  # older 5.x: infer as DynamicCache(config=...) does
        n = config.num_hidden_layers
        types = getattr(config, "layer_types", None) or (
            ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"] * n)
        kw = [{"sliding_window": config.sliding_window} if t == "sliding_attention" else {} for t in types]
    windows = []
    for i, (t, k) in enumerate(zip(types, kw)):
        if t == "full_attention":
            windows.append(0)
        elif t == "sliding_attention":
            windows.append(int(k["sliding_window"]))
        elif t == "chunked_attention":
            # transformers caches a chunked layer (Llama 4) as a sliding layer of W = attention_chunk_size: same
            # blocks kept, same mask sizes; the chunk rule itself is the attention kernel's (chunk_size)
            windows.append(int(k.get("sliding_window") or config.attention_chunk_size))
        else:
            raise NotImplementedError(
                f"PagedCache: layer {i} is a {t!r} layer; supported: full_attention, sliding_attention, "
                "chunked_attention")
    return windows


class PagedCache(DynamicCache):
    """Paged K/V for every layer of a decoder, usable as ``past_key_values`` / ``cache`` of a transformers model.

    Args:
        config: the model config (layer types and windows as ``DynamicCache(config=...)`` reads them).
        block_size: tokens per block.
        max_length: the longest a row gets (prompt + new tokens); sizes the pools up front. Without it the pools grow
            (doubling) when a forward needs more blocks than are free.
        num_blocks: blocks per group (overrides the sizing from max_length).
        paged_attention: hand the attention function the pools in place (the attention implementation must be
            arkernels'); False returns dense ``[B, Hkv, S, D]`` keys that any attention implementation can use.
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" / ``torch.float8_e4m3fn``: pools of e4m3 with a
            K and a V scale per layer (vLLM's convention; dense views are dequantized to the model's dtype).
        k_scale, v_scale: fp8 only: a float for every layer, one float per layer, or None: calibrated per layer on
            its first update (the prefill): ``max(absmax / 200, 1e-6)`` for K, ``/ 100`` for V (vLLM's defaults:
            headroom for later tokens; ``arkernels.cache.fp8.calibrate_kv_scale``).
        compileable: fixed shapes for one ``model.generate`` call (needs ``max_length``): every block reserved at the
            first forward, lengths advanced on the device, ``is_compileable`` True (with ``paged_attention``) until
            the cache moves to the host path (a reorder, a crop, a forward longer than ``max_length``, dense K/V asked).
    """

    def __init__(self, config, *, block_size: int = 16, max_length: int | None = None, num_blocks: int | None = None,
                 paged_attention: bool = True, kv_cache_dtype: str | torch.dtype = "auto",
                 k_scale: float | list[float] | None = None, v_scale: float | list[float] | None = None,
                 compileable: bool = False):
        if block_size <= 0:
            raise ValueError(f"PagedCache: block_size must be > 0, got {block_size}")
        if compileable and (max_length is None or max_length <= 0 or num_blocks is not None):
            raise ValueError("PagedCache: compileable=True needs max_length (> 0: every block of the call is reserved "
                             f"up front) and no num_blocks; got max_length={max_length}, num_blocks={num_blocks}")
        windows = _layer_windows(config)
        self.kv_dtype = kv_cache_dtype_of("PagedCache", kv_cache_dtype)  # None: the model's dtype
        self.kv_scales = (per_layer_scales("PagedCache", "k_scale", k_scale, len(windows), self.kv_dtype),
                          per_layer_scales("PagedCache", "v_scale", v_scale, len(windows), self.kv_dtype))
        self.groups: dict[int, BlockTable] = {}
        for w in windows:
            if w not in self.groups:
                self.groups[w] = BlockTable(w, block_size, max_length, num_blocks)
        self.paged_attention = paged_attention
        self.plan: tuple[list[int], list[int]] | None = None
        self.num_rows = 0
        self.kv_start: torch.Tensor | None = None
        self.version = 0  # +1 on every change that the dense keys/values views must see
        # a DynamicCache to user code (isinstance checks, iteration over (keys, values)), but built as a plain Cache:
        # DynamicCache adds only its layer-building __init__ and __iter__ (which reads the gathered keys / values);
        # generate tests type(...) is DynamicCache, so it still treats this cache as a custom one
        Cache.__init__(self, layers=[PagedLayer(self.groups[w], self) for w in windows])
        for i, layer in enumerate(self.layers):
            layer.layer_idx = i
        self.fixed = self.leaving = False
        self.host_ahead = 0  # tokens of the coming forward whose host half begin_forward already did
        self.decode_steps = 0  # one-token forwards served with fixed shapes
        self.step_counter = None  # or an object whose ``steps`` counts them too (arkernels.patch's compile="auto")
        self.eager_call = False  # arkernels.patch: the "auto" rule keeps this call eager (transformers compiles not)
        self.compiled_forwards = 0  # forwards a compiled decode step served (arkernels.patch's compiled call)
        # model.generate's masks for this call's one-token forwards (arkernels.patch): the padding of a call's rows
        # does not change between its decode steps, so they are built once (left padding as kv_start) and reused
        self.decode_masks = None
        if compileable:
            self._set_fixed(True)

    # ---- fixed shapes (compileable=True): what model.generate's compiled decode step runs on ----------------------
    def _set_fixed(self, on: bool) -> None:
        self.fixed = on
        self._set_compileable(on and self.paged_attention)  # dense K/V views read host lengths: eager only

    def _set_compileable(self, on: bool) -> None:
        for layer in self.layers:
            layer.is_compileable = on  # instance attribute: transformers reads cache.is_compileable from the layers

    def end_call(self) -> None:
        """The ``model.generate`` call this fixed cache was made for returned: a cache no compiled forward ran on
        reports ``is_compileable`` False from now on (what the call did: transformers' own default cache is not
        compileable, and its tests read the returned cache so); its fixed shapes stay (a continuation runs eagerly)."""
        if self.fixed and not self.compiled_forwards:
            self._set_compileable(False)
        self.eager_call = False

    def leave_fixed(self) -> None:
        """Asked mid-forward (an attention function wanted dense K/V: a mask our kernel cannot express): no longer
        compileable from now on; the groups move to the host path at the start of the next forward."""
        self.leaving = True
        self._set_compileable(False)

    def fixed_forward(self, tokens: int) -> bool:
        """Host half of a forward of ``tokens`` tokens per row on a fixed cache, groups' part: the lengths the host
        reports advance (each layer advances its own as it sees the forward). False, and the cache is on the host path
        from then on (``unfix``), when the forward does not fit what was reserved (a longer continuation of a returned
        cache)."""
        if self.leaving or not all(g.fits(tokens) for g in self.groups.values() if g.allocator is not None):
            self.unfix()
            return False
        for g in self.groups.values():
            g.advance_fixed_host(tokens)
        if tokens == 1:
            self.decode_steps += 1
            if self.step_counter is not None:
                self.step_counter.steps += 1
        if tokens > 1:
            self.decode_masks = None  # a new prompt (a continuation): its padding is its own
        self.version += 1
        return True

    def begin_forward(self, tokens: int) -> bool:
        """Before a compiled forward (whose traced ``update`` only does device work): its host half, here, eagerly.
        Returns False when the cache cannot serve it with fixed shapes (it is then on the host path: run the forward
        eagerly). A no-op True before the first forward (the prefill initializes the reservation eagerly)."""
        if not self.fixed:
            return False
        if not self.layers[0].is_initialized:
            return True
        if not self.fixed_forward(tokens):
            return False
        for layer in self.layers:
            layer.length += tokens
        self.host_ahead = tokens
        return True

    def end_forward(self) -> None:
        """After a forward that ``begin_forward`` prepared (a compiled call that ran eagerly consumed it already)."""
        self.host_ahead = 0

    def unfix(self) -> None:
        """Leave fixed shapes for good: the groups take the host path (blocks freed and reserved per forward), which
        serves every forward shape, beams and rollback; ``is_compileable`` becomes False."""
        if not self.fixed:
            return
        for g in self.groups.values():
            if g.allocator is not None:
                g.unfix()
        self._set_fixed(False)
        self.leaving = False
        self.decode_masks = None
        self.version += 1

    # ---- arkernels.generate's interface ----------------------------------------------------------------
    def begin_step(self, rows: list[int], q_lens: list[int]) -> None:
        """Plan the next forward: ``q_lens[i]`` new tokens for row ``rows[i]`` (packed in that order)."""
        self.unfix()  # arkernels.generate plans ragged rows: the host path
        self.plan = (list(rows), list(q_lens))

    def begin_static_step(self, rows: list[int], ahead: int = 0, tokens: int = 1) -> list[list[int]]:
        """Host half of a static decode step of ``tokens`` new positions per row (outside any CUDA graph): frees
        out-of-window blocks, reserves the slots (and, in full-attention groups, the blocks of each row's next
        ``ahead`` tokens whenever it needs a new one: fewer table writes). Returns, per group (in ``self.groups``
        order), the slots row by row (``tokens`` per row), computed from the host's block lists (nothing is read back
        from the device)."""
        out = []
        self.version += 1  # the step's layers append: the dense views are stale from here
        for g in self.groups.values():
            g.advance(rows, [tokens] * len(rows), make_slots=False, ahead=ahead)
            bs, blocks = g.block_size, g.rows
            out.append([blocks[r][(p + j) // bs] * bs + (p + j) % bs
                        for r, p in zip(rows, g.forward_start) for j in range(tokens)])
        return out

    def set_static_step(self, row_index: torch.Tensor, seq_lens: torch.Tensor, slots: list[torch.Tensor],
                        cu_seqlens_q: torch.Tensor | None = None, max_q_len: int | None = None) -> None:
        """Device half of a static decode step: tensor ops only, so it can run inside a CUDA graph capture.

        Args:
            row_index: int64 ``[bucket]``: the cache row of each batch row (padding rows: any valid row).
            seq_lens: int32 ``[bucket]``: lengths after this step; 0 for padding rows (the kernel outputs zeros).
            slots: per group, int64 ``[bucket * q]``: where each batch row's new K/V go; -1 for padding (skipped).
            cu_seqlens_q: int32 ``[bucket + 1]`` (``0, q, 2q, ...``) and ``max_q_len`` = q when each row has
                ``q > 1`` queries (a speculative step's verification); None for one query per row.
        """
        if not self.paged_attention:
            raise RuntimeError("PagedCache: a static decode step needs paged_attention=True")
        kv_start = None if self.kv_start is None else self.kv_start.index_select(0, row_index)
        for g, s in zip(self.groups.values(), slots):
            g.static = (s, PagedStep(g.table.index_select(0, row_index), seq_lens, cu_seqlens_q, max_q_len,
                                     kv_start, no_dense))

    def end_static(self) -> None:
        """Back to the planned (dynamic) path."""
        for g in self.groups.values():
            g.static = None

    @property
    def generation(self) -> int:
        """Changes whenever a block table or a pool is reallocated (CUDA graphs captured before are stale)."""
        return sum(g.generation for g in self.groups.values())

    def set_rows(self, num_rows: int) -> None:
        self.unfix()  # arkernels.generate plans ragged rows: the host path
        self.num_rows = num_rows
        self.plan = ([], [])

    def release_row(self, r: int) -> None:
        for g in self.groups.values():
            if g.allocator is not None:
                g.release_row(r)

    def truncate_row(self, r: int, new_len: int) -> None:
        """``arkernels.generate``'s speculative steps: row ``r`` back to ``new_len`` positions in every group (the
        rejected drafts' K/V dropped by length; whole blocks past it return to the pool)."""
        for g in self.groups.values():
            g.truncate_row(r, new_len)
        self.version += 1

    def fork_row(self, src: int, dst: int) -> None:
        """``arkernels.generate``: row ``dst`` continues from row ``src``'s cache (parallel samples of one prompt share
        its blocks; a shared, partly filled last block is copied when a row first writes to it)."""
        for g in self.groups.values():
            if g.allocator is not None:
                g.fork_row(src, dst)
        if self.kv_start is not None:
            self.kv_start[dst] = self.kv_start[src]
        self.version += 1

    def row_length(self, r: int) -> int:
        g = next(iter(self.groups.values()))
        return g.lens[r] if g.lens else 0

    # ---- beam search, parallel samples, assisted decoding (transformers' Cache API) ----------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues old row ``beam_idx[i]``. A permutation of block-table rows plus reference
        counts: beams that share a block share it; no K/V byte moves here. A shared, partly filled last block is
        copied when a beam first writes to it (one block per layer per such beam, counted in ``bytes_copied``)."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows ``indices`` (in that order, repeats allowed), sharing their blocks; see ``reorder_cache``."""
        idx = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        self.unfix()  # reorders and rollbacks run on the host path
        for g in self.groups.values():
            g.select_rows(idx)
        if self.kv_start is not None:
            self.kv_start = self.kv_start[torch.tensor(idx, device=self.kv_start.device)]
        self.version += 1

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows (beams, ``num_return_sequences``) that share the row's blocks (a fork:
        reference counts, no K/V copy)."""
        rows = max((len(g.rows) for g in self.groups.values()), default=0)
        self.batch_select_indices([r for r in range(rows) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` positions of every row (assisted / prompt-lookup decoding roll back
        rejected candidates): lengths shrink, whole blocks past the new length return to the pool, nothing is copied.

        The rules are transformers': a positive value is an absolute length on transformers < 5.18 and an error
        after; a sliding layer that has reached its window can only be cropped while recording its past
        (``activate_past_recording``, which generate calls for assisted decoding), and ``crop(0)`` then releases what
        fell out of the window."""
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17 passes a 0-d tensor
        self.unfix()
        length = self.get_seq_length()
        if tokens_to_remove > 0:
            if not _LEGACY_POSITIVE_CROP:
                raise ValueError(
                    f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. Please use a "
                    "negative integer to remove that number of tokens from the cache instead.")
            if tokens_to_remove >= length:
                return
            tokens_to_remove = tokens_to_remove - length
        n = abs(tokens_to_remove)
        for g in self.groups.values():
            if g.window and g.lens and max(g.lens) >= g.window and not g.record_past:
                raise RuntimeError(
                    "`crop` was called, but the current layer does not track past states, and the sliding window size "
                    "was already reached. Call `activate_past_recording` before `crop` to be able to rollback the "
                    "cache.")
        for g in self.groups.values():
            if g.allocator is not None and g.lens:
                g.truncate(max(max(g.lens) - n, 0))
        for layer in self.layers:
            layer.length = max(layer.length - n, 0)
        self.version += 1

    @property
    def bytes_copied(self) -> int:
        """K/V bytes copied so far by copy-on-write (all layers, K and V); DynamicCache's reorder copies the whole
        cache every beam step instead."""
        return sum(g.bytes_copied for g in self.groups.values())

    # ---- bookkeeping -----------------------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> dict[int, int]:
        """Blocks held by rows, per group (key: window, 0 = full attention)."""
        return {w: g.blocks_in_use for w, g in self.groups.items()}

    def reset(self) -> None:
        self.unfix()
        for g in self.groups.values():
            for r in range(len(g.rows)):
                g.release_row(r)
            g.plan = g.step = g.static = None
        for layer in self.layers:
            layer.length = 0
        self.kv_start = None
        self.version += 1
