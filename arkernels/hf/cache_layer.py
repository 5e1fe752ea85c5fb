"""The layers of ``arkernels.hf.cache.PagedCache``: ``PagedLayer`` (one layer's K/V pools and its ``update``, where a
forward's drive protocol is chosen: static, fixed, planned or host; the table of them is in ``arkernels.hf.cache``'s
docstring) and ``PagedStep`` (what one forward hands to the attention function)."""
from __future__ import annotations

import torch

from arkernels.hf.attention import KV_SCALES_ATTR, PAGED_ATTR
from arkernels.cache.table import BlockTable, static_inputs, to_device
from arkernels.cache.fp8 import K_RANGE, V_RANGE, calibrate_kv_scale
from arkernels.ops.paged_kv import paged_kv_append, paged_kv_gather

try:
    from transformers.cache_utils import CacheLayerMixin
except ImportError as e:  # pragma: no cover - transformers is an optional dependency
    raise ImportError("arkernels.hf needs transformers>=5.17: pip install 'arkernels[hf]'") from e


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


def no_dense():
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
