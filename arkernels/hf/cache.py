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

Four drive protocols, chosen per forward in ``PagedLayer.update`` by these flags (first match wins):

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

from arkernels.hf.attention import KV_SCALES_ATTR, PAGED_ATTR
from arkernels.cache.table import BlockTable, static_inputs, to_device
from arkernels.cache.fp8 import K_RANGE, V_RANGE, calibrate_kv_scale, kv_cache_dtype_of, per_layer_scales
from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather

try:
    from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache
except ImportError as e:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("arkernels.hf needs transformers>=5.17: pip install 'arkernels[hf]'") from e

try:
    from packaging.version import Version
    import transformers as _tf

    _LEGACY_POSITIVE_CROP = Version(_tf.__version__) < Version("5.18")  # 5.17: crop(n > 0) = keep n positions
except Exception:  # pragma: no cover
    _LEGACY_POSITIVE_CROP = False


class PagedStep:
    """What one forward of one group hands to the attention function (attached to the K pool as ``_arkernels_paged``).

    block_table int32 ``[rows, capacity]``; seq_lens int32 ``[rows]`` (lengths after this forward); cu_seqlens_q int32
    ``[rows+1]`` and max_q_len when a row has more than one query (None for one query per row); kv_start int32
    ``[rows]`` (keys before it are invisible) or None.
    """

    __slots__ = ("block_table", "seq_lens", "cu_seqlens_q", "max_q_len", "kv_start", "_dense")

    def __init__(self, block_table, seq_lens, cu_seqlens_q, max_q_len, kv_start, dense):
        self.block_table, self.seq_lens = block_table, seq_lens
        self.cu_seqlens_q, self.max_q_len, self.kv_start = cu_seqlens_q, max_q_len, kv_start
        self._dense = dense

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, value)`` ``[B, Hkv, S, D]`` as a DynamicCache layer would hand them over (fallback paths)."""
        return self._dense()


def _no_dense():
    raise RuntimeError("PagedCache: a static decode step has no dense fallback (it expects attention_mask=None)")


class PagedLayer(CacheLayerMixin):
    """One layer of ``PagedCache``: K/V pools ``[num_blocks, block_size, Hkv, D]`` addressed by its group's table."""

    # generate() auto-compiles the decode forward of a compileable cache: only a fixed-shape PagedCache
    # (compileable=True) is, per instance, until it hands its groups to the host path
    is_compileable = False
    is_croppable = True  # crop releases whole blocks; sliding layers follow DynamicSlidingWindowLayer's rules

    def __init__(self, group: BlockTable, cache: "PagedCache"):
        super().__init__()
        self.group = group
        self.cache = cache
        self.is_sliding = group.window > 0
        if self.is_sliding:
            self.sliding_window = group.window
        self.length = 0  # positions written by this layer (rows advance together in model.generate)
        self.k_pool: torch.Tensor | None = None
        self.v_pool: torch.Tensor | None = None
        self.first_in_group = not group.owners  # a fixed forward's slots are computed once, by this layer
        group.owners.append(self)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        g = self.group
        batch, hkv, tokens, dim = key_states.shape
        if self.cache.plan is not None:  # arkernels.generate: rows are the planned sequences
            batch = self.cache.num_rows
        if self.cache.fixed:  # every group at once: the first forward's host half (at layer 0) counts them all
            for group in self.cache.groups.values():
                if group.allocator is None:
                    group.init_fixed(batch, tokens, key_states)
        elif g.allocator is None:
            g.init(batch, tokens, key_states)
        self.device, self.dtype = key_states.device, key_states.dtype
        shape = (g.allocator.num_blocks, g.block_size, hkv, dim)
        pool_dtype = self.cache.kv_dtype or key_states.dtype
        self.k_pool = torch.zeros(shape, dtype=pool_dtype, device=key_states.device)
        self.v_pool = torch.zeros(shape, dtype=pool_dtype, device=value_states.device)
        self.k_scale = self.v_scale = None
        if pool_dtype == torch.float8_e4m3fn:  # scales: the user's, else calibrated on this first update (prefill)
            ks, vs = self.cache.kv_scales[0][self.layer_idx], self.cache.kv_scales[1][self.layer_idx]
            dev = key_states.device
            self.k_scale = (calibrate_kv_scale(key_states, K_RANGE) if ks is None
                            else torch.tensor([ks], dtype=torch.float32, device=dev))
            self.v_scale = (calibrate_kv_scale(value_states, V_RANGE) if vs is None
                            else torch.tensor([vs], dtype=torch.float32, device=dev))
            setattr(self.k_pool, KV_SCALES_ATTR, (self.k_scale, self.v_scale))
        if g.fixed:
            static_inputs(self.k_pool, self.v_pool, dynamic=((self.k_pool, 0), (self.v_pool, 0)))
            # built here, eagerly: created inside a compiled step it would be new state that the next step's guards see
            self._decode_step = PagedStep(g.table, g.dev_lens, None, None, None, lambda: self._dense_fixed(1))
        self.is_initialized = True

    def grow_pools(self, num_blocks: int) -> None:
        if self.k_pool is None:
            return
        for name in ("k_pool", "v_pool"):
            old = getattr(self, name)
            new = torch.zeros((num_blocks, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[: old.shape[0]] = old
            setattr(self, name, new)
        if self.k_scale is not None:
            setattr(self.k_pool, KV_SCALES_ATTR, (self.k_scale, self.v_scale))

    def copy_block(self, old: int, new: int) -> int:
        """Copy-on-write for the group's ``BlockTable``: block ``old``'s K and V into block ``new``; the bytes copied."""
        if self.k_pool is None:
            return 0
        self.k_pool[new].copy_(self.k_pool[old])
        self.v_pool[new].copy_(self.v_pool[old])
        return 2 * self.k_pool[new].numel() * self.k_pool.element_size()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, Hkv, T, D]`` new keys/values; returns the pools (paged attention) or dense ``[B, Hkv, S, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        g, cache = self.group, self.cache
        batch, hkv, tokens, dim = key_states.shape
        if g.static is not None:  # static decode: tensor ops only, nothing read from the host
            # (begin_static_step bumped cache.version: a Python int changed here would be a torch.compile guard
            # that fails every step)
            slots, step = g.static
            paged_kv_append(key_states.transpose(1, 2).reshape(-1, hkv, dim),
                            value_states.transpose(1, 2).reshape(-1, hkv, dim), self.k_pool, self.v_pool, slots,
                            k_scale=self.k_scale, v_scale=self.v_scale, check=False)
            setattr(self.k_pool, PAGED_ATTR, step)
            return self.k_pool, self.v_pool
        if cache.fixed:
            return self._update_fixed(key_states, value_states)
        cache.version += 1
        if cache.plan is not None:
            rows, q_lens = cache.plan
            if g.plan is not cache.plan:
                g.advance(*cache.plan)
                g.plan = cache.plan
                g.step = None
        else:
            if self.length == g.lens[0]:  # the first layer of this group to see this forward
                rows, q_lens = list(range(batch)), [tokens] * batch
                g.advance(rows, q_lens)
                g.step = None
            elif self.length + tokens != g.lens[0]:
                raise RuntimeError(
                    f"PagedCache: layer {self.layer_idx} got {tokens} tokens at length {self.length} but its group is "
                    f"at {g.lens[0]}: every layer must see every forward")
            rows, q_lens = g.plan
            self.length += tokens
        k = key_states.transpose(1, 2).reshape(-1, hkv, dim)
        v = value_states.transpose(1, 2).reshape(-1, hkv, dim)
        paged_kv_append(k, v, self.k_pool, self.v_pool, g.slots, k_scale=self.k_scale, v_scale=self.v_scale,
                        check=False)
        if g.step is None:
            g.step = self._make_step(rows, q_lens, tokens)
        if cache.paged_attention:
            step = g.step
            k_pool, v_pool = self.k_pool, self.v_pool
            setattr(k_pool, PAGED_ATTR, PagedStep(step.block_table, step.seq_lens, step.cu_seqlens_q, step.max_q_len,
                                                 step.kv_start, lambda: self._dense(rows, tokens)))
            return k_pool, v_pool
        return self._dense(rows, tokens)

    def _update_fixed(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A forward of a fixed-shape cache: the host half (lengths the host reports: the groups' at layer 0, each
        layer's own) runs eagerly, unless ``PagedCache.begin_forward`` ran it before a compiled forward; the device
        half (slots, lengths on the device) once per group. Inside torch.compile nothing here reads a value that
        changes between steps."""
        g, cache = self.group, self.cache
        batch, hkv, tokens, dim = key_states.shape
        # (host_ahead: begin_forward did this forward's host half, for a compiled call that runs eagerly after all)
        if not torch.compiler.is_compiling() and not cache.host_ahead:
            if self.layer_idx == 0 and not cache.fixed_forward(tokens):  # does not fit: the host path from here on
                return self.update(key_states, value_states)
            self.length += tokens
        if self.first_in_group:
            g.advance_fixed_device(tokens)
        paged_kv_append(key_states.transpose(1, 2).reshape(-1, hkv, dim),
                        value_states.transpose(1, 2).reshape(-1, hkv, dim), self.k_pool, self.v_pool, g.slots,
                        k_scale=self.k_scale, v_scale=self.v_scale, check=False)
        if not cache.paged_attention:
            return self._dense(list(range(batch)), tokens)
        if tokens == 1:
            step = self._decode_step  # the same table and lengths tensors every decode step
        else:
            step = PagedStep(g.table, g.dev_lens, g.fixed_cu, tokens, None, lambda: self._dense_fixed(tokens))
        setattr(self.k_pool, PAGED_ATTR, step)
        return self.k_pool, self.v_pool

    def _dense_fixed(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of a fixed forward for an attention that needs them (a 4D mask): they are sized from the host's
        lengths, which a compiled step cannot read, so the cache stops being compileable (see ``leave_fixed``)."""
        self.cache.leave_fixed()
        return self._dense(list(range(len(self.group.lens))), tokens)

    def _make_step(self, rows, q_lens, tokens) -> PagedStep:
        g, dev = self.group, self.k_pool.device
        full = len(rows) == g.table.shape[0] and rows == list(range(len(rows)))
        table = g.table if full else g.table[to_device(rows, torch.int64, dev)]
        seq_lens = to_device([g.lens[r] for r in rows], torch.int32, dev)
        cu, max_q = None, None
        if any(n != 1 for n in q_lens):
            cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(q_lens).cumsum(0)
            cu, max_q = cu.to(dev), max(q_lens)
        kv_start = self.cache.kv_start
        if kv_start is not None and not full:
            kv_start = kv_start[torch.tensor(rows, device=kv_start.device)]
        return PagedStep(table, seq_lens, cu, max_q, kv_start, None)

    def _dense(self, rows, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        """What a DynamicLayer / DynamicSlidingWindowLayer returns from the same update (rows advance together)."""
        length = self.group.lens[rows[0]]
        start = max(length - tokens - self.group.window + 1, 0) if self.group.window else 0
        return self._gather(rows, start, length)

    def _gather(self, rows: list[int], start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``[len(rows), Hkv, length - start, D]`` keys/values of positions ``start .. length-1`` (zeros past a
        shorter row's length)."""
        g, bs = self.group, self.group.block_size
        first_block = start // bs
        table = g.table[torch.tensor(rows, device=g.table.device), first_block:].contiguous()
        lens = torch.tensor([max(min(g.lens[r], length) - first_block * bs, 0) for r in rows], dtype=torch.int32,
                            device=table.device)
        fp8 = self.k_scale is not None  # fp8 pools: dequantized to the model's dtype
        k, v = paged_kv_gather(self.k_pool, self.v_pool, table, lens, length - first_block * bs, check=False,
                               k_scale=self.k_scale, v_scale=self.v_scale, out_dtype=self.dtype if fp8 else None)
        skip = start - first_block * bs
        return k[:, :, skip:], v[:, :, skip:]

    # ---- readable cache: what DynamicLayer / DynamicSlidingWindowLayer hold, gathered on demand --------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """Dense ``[rows, Hkv, S, D]`` keys, as a DynamicLayer holds them (sliding: the last ``min(S, W - 1)``
        positions, as DynamicSlidingWindowLayer keeps); None before the first update.

        Cost: one ``paged_kv_gather`` of this layer's K and V (``2 * rows * S * Hkv * D`` elements written to a new
        tensor) on first access after any change to the cache; ``values`` then comes from the same gather. Nothing
        in the decode path reads it: it is for code that inspects, copies or saves the returned cache."""
        return self._stored()[0]

    @keys.setter
    def keys(self, value) -> None:
        self._set_stored(value)

    @property
    def values(self) -> torch.Tensor | None:
        """Dense ``[rows, Hkv, S, D]`` values; see ``keys`` (same gather, same cost)."""
        return self._stored()[1]

    @values.setter
    def values(self, value) -> None:
        self._set_stored(value)

    def _set_stored(self, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets None; anything else would be silently lost
            raise AttributeError("PagedCache: keys / values are read-only views of the paged pools")

    def _stored(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        g = self.group
        if not getattr(self, "is_initialized", False) or g.allocator is None or not g.rows:
            return None, None
        version = self.cache.version
        cached = self.__dict__.get("_stored_cache")
        if cached is not None and cached[0] == version:
            return cached[1]
        length = max(g.lens)
        start = min(g.kept_from, length) if g.window else 0
        out = self._gather(list(range(len(g.rows))), start, length)
        self.__dict__["_stored_cache"] = (version, out)
        return out

    # ---- what transformers asks ------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        W = self.group.window
        if not W:
            return self.length + query_length, 0
        kv_offset = max(self.length - W + 1, 0)
        kv_length = (W - 1 if self.length >= W else self.length) + query_length
        return kv_length, kv_offset

    def get_max_length(self) -> int:
        return self.group.window if self.group.window else -1

    def reset(self) -> None:
        self.cache.reset()

    def offload(self):
        raise NotImplementedError("PagedCache: offloading is not supported")

    def prefetch(self):
        raise NotImplementedError("PagedCache: offloading is not supported")

    # layers of a group share one block table: these act on the whole cache (PagedCache's methods), never per layer
    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("PagedCache: crop the cache (PagedCache.crop), not one layer: layers share block tables")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("PagedCache: reorder the cache (PagedCache.reorder_cache), not one layer")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise RuntimeError("PagedCache: call PagedCache.batch_repeat_interleave, not one layer's")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise RuntimeError("PagedCache: call PagedCache.batch_select_indices, not one layer's")

    @property
    def record_past(self) -> bool:
        return self.group.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self.group.record_past = bool(value)

    def activate_past_recording(self) -> None:
        self.group.record_past = True


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

    def begin_static_step(self, rows: list[int], ahead: int = 0) -> list[list[int]]:
        """Host half of a static one-token decode step for ``rows`` (outside any CUDA graph): frees out-of-window
        blocks, reserves one slot per row (and, in full-attention groups, the blocks of each row's next ``ahead``
        tokens whenever it needs a new one: fewer table writes). Returns, per group (in ``self.groups`` order), the
        slot of each row, computed from the host's block lists (nothing is read back from the device)."""
        out = []
        ones = [1] * len(rows)
        self.version += 1  # the step's layers append: the dense views are stale from here
        for g in self.groups.values():
            g.advance(rows, ones, make_slots=False, ahead=ahead)
            bs, blocks = g.block_size, g.rows
            out.append([blocks[r][p // bs] * bs + p % bs for r, p in zip(rows, g.forward_start)])
        return out

    def set_static_step(self, row_index: torch.Tensor, seq_lens: torch.Tensor, slots: list[torch.Tensor]) -> None:
        """Device half of a static decode step: tensor ops only, so it can run inside a CUDA graph capture.

        Args:
            row_index: int64 ``[bucket]``: the cache row of each batch row (padding rows: any valid row).
            seq_lens: int32 ``[bucket]``: lengths after this step; 0 for padding rows (the kernel outputs zeros).
            slots: per group, int64 ``[bucket]``: where each batch row's new K/V go; -1 for padding (skipped).
        """
        if not self.paged_attention:
            raise RuntimeError("PagedCache: a static decode step needs paged_attention=True")
        kv_start = None if self.kv_start is None else self.kv_start.index_select(0, row_index)
        for g, s in zip(self.groups.values(), slots):
            g.static = (s, PagedStep(g.table.index_select(0, row_index), seq_lens, None, None, kv_start,
                                     _no_dense))

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
