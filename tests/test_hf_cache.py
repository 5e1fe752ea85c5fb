"""PagedCache against transformers' DynamicCache over random update sequences: the same K/V handed to attention,
the same get_seq_length / get_mask_sizes per layer, sliding layers' blocks bounded by the window."""
import math

import pytest
import torch
from transformers import DynamicCache

from arkernels.hf.attention import PAGED_ATTR
from arkernels.hf.cache import PagedCache
from arkernels.hf.tiny import TINY_WINDOW, tiny_model

BATCH, HKV, HEAD_DIM = 3, 2, 16
BLOCK_SIZES = [4, 5]  # 5: a block size that does not divide anything nicely
UPDATE_SEQUENCES = [[7, 1, 1, 3, 1, 1, 1, 6, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1], [13, 1, 1, 1, 1]]
FAMILIES = ["llama", "mistral", "gemma3_text"]  # full only, sliding only, interleaved


def _kv(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(BATCH, HKV, tokens + 2, HEAD_DIM, generator=g)[:, :, 1:-1]  # non-contiguous, as q/k/v views are
    return k, torch.randn(BATCH, HKV, tokens, HEAD_DIM, generator=g)


def _update_every_layer(cache, ref, config, step, tokens, paged):
    """One update of every layer in both caches: the same lengths and mask sizes before it, the same K/V after
    (exact: data movement). A paged layer's K/V is compared through ``dense()``."""
    for layer in range(config.num_hidden_layers):
        assert cache.get_seq_length(layer) == ref.get_seq_length(layer)
        for q in (1, tokens):
            assert cache.get_mask_sizes(q, layer) == ref.get_mask_sizes(q, layer)
        k, v = _kv(tokens, seed=100 * step + layer)
        rk, rv = ref.update(k, v, layer)
        pk, pv = cache.update(k, v, layer)
        if paged:
            info = getattr(pk, PAGED_ATTR)
            assert pk.dim() == 4 and info.seq_lens.tolist() == [cache.get_seq_length(layer)] * BATCH
            pk, pv = info.dense()  # on a fixed cache: an attention asking for dense K/V, not compileable from here on
            assert not cache.is_compileable
        assert torch.equal(pk, rk) and torch.equal(pv, rv)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("updates", UPDATE_SEQUENCES)
@pytest.mark.parametrize("paged", [False, True])
def test_paged_cache_matches_dynamic(family, block_size, updates, paged):
    config = tiny_model(family).config
    ref = DynamicCache(config=config)
    cache = PagedCache(config, block_size=block_size, paged_attention=paged)  # no max_length: pools must grow
    assert not cache.is_compileable
    for step, tokens in enumerate(updates):
        _update_every_layer(cache, ref, config, step, tokens, paged)
        for window, used in cache.blocks_in_use.items():
            if window:  # out-of-window blocks went back: W - 1 old keys + this update, one straddled block more
                assert used <= BATCH * (math.ceil((window - 1 + tokens) / block_size) + 1)
    assert cache.get_seq_length() == ref.get_seq_length() == sum(updates)
    cache.reset()
    assert all(used == 0 for used in cache.blocks_in_use.values())


def test_sliding_blocks_return_to_pool():
    config = tiny_model("mistral").config
    cache = PagedCache(config, block_size=2, max_length=64)
    used = []
    for step in range(40):
        k, v = _kv(1, step)
        cache.update(k, v, 0)
        cache.update(k, v, 1)
        used.append(cache.blocks_in_use[TINY_WINDOW])
    # window 5 with blocks of 2: at most 3 blocks per row live, however long the sequence gets
    assert max(used) <= BATCH * 3 and used[-1] == used[-10]


def test_paged_cache_refuses_what_it_cannot_do():
    config = tiny_model("llama").config
    cache = PagedCache(config, block_size=4)
    k, v = _kv(3, 0)
    cache.update(k, v, 0)
    for call in (lambda: cache.layers[0].crop(-1), lambda: cache.layers[0].reorder_cache(torch.tensor([0, 1, 2]))):
        with pytest.raises(RuntimeError, match="PagedCache"):  # layers share tables: only the cache can do it
            call()
    with pytest.raises(RuntimeError, match="every layer must see every forward"):
        cache.update(*_kv(1, 1), 0)  # layer 0 starts a new forward (length 4) ...
        cache.update(*_kv(2, 1), 1)  # ... layer 1 still at 3 gets 2 tokens: 5 != 4
    with pytest.raises(ValueError, match="block_size"):
        PagedCache(config, block_size=0)
    from transformers import Llama4TextConfig

    from transformers import Qwen3NextConfig

    with pytest.raises(NotImplementedError, match="layer 0 is a 'linear_attention' layer"):
        PagedCache(Qwen3NextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    # chunked layers (Llama 4) are cached as transformers caches them: a sliding layer of attention_chunk_size
    chunked = Llama4TextConfig(num_hidden_layers=2, attention_chunk_size=8, layer_types=None, no_rope_layers=[1, 1])
    cache, ref = PagedCache(chunked, block_size=4, paged_attention=False), DynamicCache(config=chunked)
    for t, pos in ((11, 0), (1, 11), (1, 12)):
        for layer in range(2):
            got, want = cache.update(*_kv(t, pos), layer), ref.update(*_kv(t, pos), layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for layer in range(2):
            assert cache.layers[layer].get_mask_sizes(1) == ref.layers[layer].get_mask_sizes(1)
        assert cache.get_seq_length() == ref.get_seq_length()


# beam search / rollback against DynamicCache: (tokens, op) per step; op: ("reorder", idx), ("crop", n) or None
BEAM_STEPS = [(7, ("reorder", [0, 0, 2])), (1, ("reorder", [1, 1, 1])), (1, None), (2, ("reorder", [2, 0, 1])),
              (3, ("crop", 2)), (1, ("reorder", [0, 2, 2])), (1, ("crop", 0)), (4, ("crop", 3)), (1, None)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 5])
def test_paged_cache_beams_and_crop_match_dynamic(family, block_size):
    config = tiny_model(family).config
    ref = DynamicCache(config=config)
    cache = PagedCache(config, block_size=block_size, paged_attention=False)
    ref.activate_past_recording()  # what generate does before assisted decoding: sliding layers can roll back
    cache.activate_past_recording()
    layers = config.num_hidden_layers
    for step, (tokens, op) in enumerate(BEAM_STEPS):
        used_before = dict(cache.blocks_in_use)
        for layer in range(layers):
            k, v = _kv(tokens, seed=100 * step + layer)
            kv_length = ref.get_mask_sizes(tokens, layer)[0]
            rk, rv = ref.update(k, v, layer)
            pk, pv = cache.update(k, v, layer)
            # while recording, 5.17's sliding layer returns its whole recorded past; the mask covers only the last
            # kv_length keys, which is what 5.24 returns and what the paged cache hands over
            assert pk.shape[2] == kv_length
            assert torch.equal(pk, rk[:, :, -kv_length:]) and torch.equal(pv, rv[:, :, -kv_length:])
            assert cache.get_mask_sizes(1, layer) == ref.get_mask_sizes(1, layer)
        if op is not None:
            kind, arg = op
            if kind == "reorder":
                copied = cache.bytes_copied
                cache.reorder_cache(torch.tensor(arg))
                ref.reorder_cache(torch.tensor(arg))
                assert cache.bytes_copied == copied  # a reorder moves no K/V byte
                assert sum(cache.blocks_in_use.values()) <= sum(used_before.values()) + BATCH * 2 * layers
            else:
                cache.crop(torch.tensor(-arg))  # transformers 5.17 passes a 0-d tensor
                ref.crop(-arg)
        for layer in range(layers):
            assert cache.get_seq_length(layer) == ref.get_seq_length(layer)
            # the readable cache: what the DynamicCache layer holds, gathered on demand
            assert torch.equal(cache.layers[layer].keys, ref.layers[layer].keys)
            assert torch.equal(cache.layers[layer].values, ref.layers[layer].values)
    # copy-on-write copied at most one partial block per row per layer per step, never a whole cache
    elem = HKV * HEAD_DIM * 4 * 2 * block_size
    assert 0 < cache.bytes_copied <= len(BEAM_STEPS) * BATCH * layers * elem
    cache.reset()
    assert all(used == 0 for used in cache.blocks_in_use.values())


def test_paged_cache_batch_repeat_interleave_forks():
    config = tiny_model("gemma3_text").config
    ref, cache = DynamicCache(config=config), PagedCache(config, block_size=4, paged_attention=False)
    for step, tokens in enumerate([9, 1]):
        for layer in range(2):
            k, v = _kv(tokens, seed=step * 10 + layer)
            ref.update(k, v, layer)
            cache.update(k, v, layer)
    used = dict(cache.blocks_in_use)
    ref.batch_repeat_interleave(2)
    cache.batch_repeat_interleave(2)
    assert cache.blocks_in_use == used  # forked: the same blocks, more owners
    ref.batch_select_indices(torch.tensor([5, 0, 3]))
    cache.batch_select_indices(torch.tensor([5, 0, 3]))
    for layer in range(2):
        k, v = _kv(1, seed=99 + layer)
        assert all(torch.equal(a, b) for a, b in zip(cache.update(k, v, layer), ref.update(k, v, layer)))
    with pytest.raises(RuntimeError, match="does not track past states"):  # transformers' rule for sliding layers
        _crop_unrecorded(config)


def _crop_unrecorded(config):
    cache = PagedCache(config, block_size=4, paged_attention=False)
    for layer in range(2):
        cache.update(*_kv(TINY_WINDOW + 1, layer), layer)
    cache.crop(-1)


# fixed shapes (compileable=True): (updates, max_length): one-token updates after the first fit the reservation; a
# later multi-token update may not, and the cache then hands its groups to the host path mid-sequence
FIXED_SEQUENCES = [([7, 1, 1, 1, 1, 1, 1, 1], 14), ([13, 1, 1, 1, 3, 1], 16), ([1, 1, 1, 1, 1, 1, 1], 7),
                   ([6, 1, 1, 9, 1], 8)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("updates,max_length", FIXED_SEQUENCES)
@pytest.mark.parametrize("paged", [False, True])
def test_fixed_paged_cache_matches_dynamic(family, block_size, updates, max_length, paged):
    config = tiny_model(family).config
    ref = DynamicCache(config=config)
    cache = PagedCache(config, block_size=block_size, max_length=max_length, paged_attention=paged, compileable=True)
    assert cache.is_compileable == paged  # dense views are sized on the host: only the paged form compiles
    seen, within, was_fixed = 0, True, True
    for step, tokens in enumerate(updates):
        within = within and seen + tokens <= max_length
        _update_every_layer(cache, ref, config, step, tokens, paged)
        seen += tokens
        # fixed shapes while every update stays within max_length (and no one asked for dense K/V); once on the host
        # path, never back
        fixed = all(g.fixed for g in cache.groups.values())
        if paged:  # the dense() above asked on the first update: the host path from the second
            assert fixed == (step == 0)
        else:
            assert fixed or not within
        assert was_fixed or not fixed
        was_fixed = fixed
        for g in cache.groups.values():
            if g.fixed:  # lengths on the device and on the host agree (the device ones are what a compiled step reads)
                assert g.dev_lens.tolist() == g.lens == [seen] * BATCH
        for window, used in cache.blocks_in_use.items():
            if window:  # a ring (fixed) or freed blocks (host path): bounded by the window either way
                assert used <= BATCH * (math.ceil((window - 1 + max(updates)) / block_size) + 1)
    for layer in range(config.num_hidden_layers):  # the readable cache after either path
        assert torch.equal(cache.layers[layer].keys, ref.layers[layer].keys)
    cache.reset()
    assert not cache.is_compileable and all(used == 0 for used in cache.blocks_in_use.values())


def test_fixed_paged_cache_reserves_once_and_unfixes_for_beams():
    """Every block of the call reserved at the first update, none taken after (the table and pools never move); a
    reorder first hands the groups to the host path (copy-on-write needs it), and the result still reads like stock."""
    config = tiny_model("gemma3_text").config
    ref = DynamicCache(config=config)
    cache = PagedCache(config, block_size=4, max_length=20, paged_attention=False, compileable=True)
    tables = None
    for step, tokens in enumerate([9, 1, 1, 1, 1, 1]):
        for layer in range(2):
            k, v = _kv(tokens, seed=step * 10 + layer)
            ref.update(k, v, layer)
            cache.update(k, v, layer)
        now = {w: (g.table.data_ptr(), g.allocator.num_free, cache.layers[0].k_pool.data_ptr())
               for w, g in cache.groups.items()}
        assert tables is None or now == tables
        tables = now
    assert cache.blocks_in_use[0] == BATCH * 5  # ceil(20 / 4) blocks per row, full attention
    assert cache.blocks_in_use[TINY_WINDOW] == BATCH * ((TINY_WINDOW + 9 - 2) // 4 + 2)  # the ring
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    ref.reorder_cache(torch.tensor([2, 2, 0]))
    assert not cache.is_compileable
    for step in range(3):
        for layer in range(2):
            k, v = _kv(1, seed=500 + step * 10 + layer)
            assert all(torch.equal(a, b) for a, b in zip(cache.update(k, v, layer), ref.update(k, v, layer)))
    with pytest.raises(ValueError, match="compileable=True needs max_length"):
        PagedCache(config, compileable=True)
