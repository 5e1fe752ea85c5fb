"""transformers' continuous batching (CB) on a patched model: every entry point, stock's greedy tokens, our kernels run.

Runs on whichever transformers is importable (5.24 from the venv; 5.17 with the 5.17 tree first on PYTHONPATH).
CB sizes its cache from free memory unless told: every case passes a small ``ContinuousBatchingConfig`` (4-token
pages, 16 tokens per step, so prompts of up to 14 tokens are split over steps and requests join and leave mid-run).

Proof that our kernels ran: counting wrappers around the functions ``arkernels.hf.cb`` calls (``window_attention``,
``paged_kv_append``, ``sample``); in-place calls are those whose cache is CB's pages (page size 4), gathered ones read
one-row pages. The fused draw is proven per request: a request asking ``top_k=1`` must give the greedy tokens.
"""
import dataclasses
import os

import pytest
import torch

import arkernels
import arkernels.hf.cb as cb
from arkernels.hf.attention import NAME
from arkernels.hf.tiny import tiny_model

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no continuous batching", allow_module_level=True)
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

PAGE = 4
NEW = 5
# ragged prompts, several sharing their first 9 tokens (two full pages: prefix-shareable), one of a single page
PREFIX = [1, 17, 33, 49, 65, 81, 97, 113, 129]
PROMPTS = [PREFIX + [5, 6, 7, 8, 9], [1, 3, 4], PREFIX + [10, 11], [1] + list(range(40, 52)), PREFIX + [12],
           [1, 7], PREFIX + [13, 14, 15, 16]]
# (family, allow_block_sharing): full only (the only kind CB shares prefixes for), sliding only, interleaved,
# per-layer windows
GREEDY_CASES = [("llama", True), ("llama", False), ("mistral", True), ("gemma3_text", True), ("qwen2", True)]
_FIELDS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
_models = {}


def _model(family):
    if family not in _models:
        _models[family] = tiny_model(family)
    return _models[family]


def _cb_config(**kw):
    kw.setdefault("num_blocks", 96)
    kw.setdefault("max_batch_tokens", 16)
    kw["page_size" if "page_size" in _FIELDS else "block_size"] = PAGE  # 5.24 renamed block_size to page_size
    return ContinuousBatchingConfig(**kw)


def _greedy(**kw):
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, **kw)


def _tokens(outputs):
    return {k: v.generated_tokens for k, v in outputs.items()}


class _Counter:
    """Counting wrappers around the kernels arkernels.hf.cb calls (monkeypatched on that module)."""

    def __init__(self, monkeypatch):
        self.attn, self.in_place, self.gathered, self.append, self.sample = 0, 0, 0, 0, 0
        self.tables = []  # the block tables of in-place calls (prefix-sharing check)
        self.storages = set()  # the storages in-place calls read
        attn, append, draw = cb.window_attention, cb.paged_kv_append, cb.sample

        def window_attention(q, k_cache, v_cache, block_table, *a, **kw):
            self.attn += 1
            if k_cache.shape[1] == PAGE:
                self.in_place += 1
                self.storages.add(k_cache.untyped_storage().data_ptr())
                self.tables.append((block_table.clone(), kw["cu_seqlens_q"].clone(), a[0].clone()))
            else:
                self.gathered += 1
            return attn(q, k_cache, v_cache, block_table, *a, **kw)

        def paged_kv_append(*a, **kw):
            self.append += 1
            return append(*a, **kw)

        def sample(*a, **kw):
            self.sample += 1
            return draw(*a, **kw)

        monkeypatch.setattr(cb, "window_attention", window_attention)
        monkeypatch.setattr(cb, "paged_kv_append", paged_kv_append)
        monkeypatch.setattr(cb, "sample", sample)

    def shared_pages(self) -> bool:
        """Whether two sequences of one batch read the same page (a prefix-shared block)."""
        for table, _, seq_lens in self.tables:
            pages = set()
            for row, n in zip(table[:-1].tolist(), seq_lens[:-1].tolist()):  # the last row owns the padding tail
                used = set(row[: -(-n // PAGE)])
                if pages & used:
                    return True
                pages |= used
        return False


@pytest.fixture
def counter(monkeypatch):
    return _Counter(monkeypatch)


@pytest.fixture
def patched():
    """Patch a model for one test; undo afterwards even if the test fails."""
    handles = []

    def _patch(model, **kw):
        handles.append(arkernels.patch(model, **kw))
        return handles[-1]

    yield _patch
    for h in handles:
        h.undo()


@pytest.mark.parametrize("family,sharing", GREEDY_CASES)
def test_generate_batch_greedy_matches_stock(family, sharing, counter, patched):
    model = _model(family)
    config = dict(allow_block_sharing=sharing)
    stock = _tokens(model.generate_batch(PROMPTS, generation_config=_greedy(),
                                         continuous_batching_config=_cb_config(**config)))
    assert counter.attn == 0  # stock CB never reaches our functions
    patched(model)
    ours = _tokens(model.generate_batch(PROMPTS, generation_config=_greedy(),
                                        continuous_batching_config=_cb_config(**config)))
    assert ours == stock
    assert all(len(t) == NEW for t in ours.values())
    assert model.config._attn_implementation == NAME  # CB's stop() gave our plain name back
    layer_types = set(getattr(model.config, "layer_types", None) or [])
    has_full = family == "llama" or "full_attention" in layer_types
    has_sliding = family == "mistral" or "sliding_attention" in layer_types
    assert counter.attn > 0
    assert (counter.in_place > 0) == has_full and (counter.append > 0) == has_full  # CB's pages, written by us
    assert (counter.gathered > 0) == has_sliding
    if family == "llama":  # CB shares prefix blocks only when every layer is full attention
        assert counter.shared_pages() == sharing


def test_full_layers_read_cb_storage(counter, patched):
    """In place means CB's own cache memory: every in-place call reads a storage of the cache CB allocated."""
    model = tiny_model("llama")
    patched(model)
    model.generate_batch(PROMPTS, generation_config=_greedy(), continuous_batching_config=_cb_config(),
                         persistent_manager=True)
    cache = model._cached_continuous_batching_manager.batch_processor.cache
    tensors = [cache.cache_tensor] if hasattr(cache, "cache_tensor") else cache.key_cache  # 5.24: one flat tensor
    assert counter.in_place > 0
    assert counter.storages <= {t.untyped_storage().data_ptr() for t in tensors}
    model.destroy_cached_continuous_batching_manager()


def test_forked_requests_match_stock(counter, patched):
    """``num_return_sequences``: CB forks a request after its prefill (children share or copy its blocks). Sampled
    with ``top_k=1`` (greedy refuses ``num_return_sequences``): stock's processors and our draw both keep the maximum."""
    model = _model("llama")
    gen = GenerationConfig(do_sample=True, top_k=1, num_return_sequences=2, max_new_tokens=NEW, eos_token_id=-1)
    stock = _tokens(model.generate_batch(PROMPTS[:3], generation_config=gen, continuous_batching_config=_cb_config()))
    patched(model)
    ours = _tokens(model.generate_batch(PROMPTS[:3], generation_config=gen, continuous_batching_config=_cb_config()))
    assert ours == stock and counter.in_place > 0 and counter.sample > 0
    # 5.24's generate_batch returns the children (req_i__child#0); 5.17's returns the parents only
    assert len(ours) == (6 if any("__child#" in k for k in ours) else 3)


def _session(model, requests, generation_config, cb_config):
    """init_continuous_batching + add_request while it runs: two requests first, the rest once one result is out."""
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=n, **kw) for p, n, kw in requests[:2]]
        results = {}
        first = manager.get_result(timeout=60)
        assert first is not None
        if first.is_finished():
            results[first.request_id] = first
        ids += [manager.add_request(p, max_new_tokens=n, **kw) for p, n, kw in requests[2:]]
        while len(results) < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None, "CB stopped before every request finished"
            if r.is_finished():
                results[r.request_id] = r
    finally:
        manager.stop(block=True)
    return [results[i].generated_tokens for i in ids]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_init_continuous_batching_requests_added_while_running(family, counter, patched):
    model = _model(family)
    requests = [(p, n, {}) for p, n in zip(PROMPTS, (3, 6, 2, 5, 4, 6, 3))]
    stock = _session(model, requests, _greedy(), _cb_config())
    patched(model)
    ours = _session(model, requests, _greedy(), _cb_config())
    assert ours == stock
    assert [len(t) for t in ours] == [n for _, n, _ in requests]  # requests left at different steps
    assert counter.in_place > 0
    assert model.config._attn_implementation == NAME


def test_generate_cache_implementation_paged(counter, patched):
    model = _model("gemma3_text")
    ids = torch.tensor([PROMPTS[0], PROMPTS[3] + [60]])  # two rows of 14 tokens
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, cache_implementation="paged")
    stock = model.generate(ids, continuous_batching_config=_cb_config(), **kw)
    patched(model)
    ours = model.generate(ids, continuous_batching_config=_cb_config(), **kw)
    assert torch.equal(ours, stock) and ours.shape[-1] == ids.shape[1] + NEW
    assert counter.in_place > 0 and counter.gathered > 0


SAMPLED = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=NEW, eos_token_id=-1)


@pytest.mark.parametrize("per_request", [False, True])
def test_sampling_fused_and_seeded(per_request, counter, patched):
    """CB's seed (``ContinuousBatchingConfig.seed``, CB's only seed: it has no per-request one) makes our draws
    reproducible; another seed draws other tokens; the fused draw replaced CB's processors."""
    model = _model("llama")
    patched(model)
    configs = [_cb_config(seed=s, per_request_processors=per_request) for s in (7, 7, 8)]
    runs = [_tokens(model.generate_batch(PROMPTS, generation_config=GenerationConfig(**SAMPLED),
                                         continuous_batching_config=c)) for c in configs]
    assert counter.sample > 0
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    vocab = model.config.vocab_size
    assert all(0 <= t < vocab for toks in runs[0].values() for t in toks)


def test_per_request_parameters_reach_the_fused_draw(counter, patched):
    """Per-request ``top_k=1`` requests give the greedy tokens; requests of the same session without it sample."""
    model = _model("llama")
    greedy = _tokens(model.generate_batch(PROMPTS, generation_config=_greedy(),
                                          continuous_batching_config=_cb_config()))
    patched(model)
    config = _cb_config(seed=3, per_request_processors=True)
    requests = [(p, NEW, {"top_k": 1} if i % 2 == 0 else {"temperature": 1.5}) for i, p in enumerate(PROMPTS)]
    ours = _session(model, requests, GenerationConfig(**SAMPLED), config)
    assert counter.sample > 0
    for i, toks in enumerate(ours):
        if i % 2 == 0:
            assert toks == greedy[f"req_{i}"]
    assert any(ours[i] != greedy[f"req_{i}"] for i in range(1, len(PROMPTS), 2))


def test_logprobs_keep_stock_processors(counter, patched):
    """``return_logprobs``: a one-hot row would report log-probability 0, so CB's own processors draw."""
    model = _model("llama")
    patched(model)
    out = model.generate_batch(PROMPTS[:3], generation_config=GenerationConfig(**SAMPLED),
                               continuous_batching_config=_cb_config(seed=1, return_logprobs=True))
    assert counter.sample == 0 and counter.attn > 0
    logprobs = [lp for r in out.values() for lp in r.logprobs]
    assert logprobs and all(lp <= 0 for lp in logprobs) and any(lp < 0 for lp in logprobs)


def test_undo_restores_stock_cb(counter):
    model = tiny_model("gemma3_text")
    stock = _tokens(model.generate_batch(PROMPTS, generation_config=_greedy(),
                                         continuous_batching_config=_cb_config()))
    before = (model.config._attn_implementation, dict(model.__dict__))
    handle = arkernels.patch(model)
    assert "init_continuous_batching" in model.__dict__
    # a persistent manager kept from a patched session must not survive undo (it holds our hooks)
    model.generate_batch(PROMPTS[:2], generation_config=_greedy(), continuous_batching_config=_cb_config(),
                         persistent_manager=True)
    assert getattr(model, "_cached_continuous_batching_manager", None) is not None
    handle.undo()
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    assert model.config._attn_implementation == before[0]
    assert set(model.__dict__) == set(before[1])
    calls = counter.attn
    again = _tokens(model.generate_batch(PROMPTS, generation_config=_greedy(),
                                         continuous_batching_config=_cb_config()))
    assert again == stock and counter.attn == calls


def test_undo_stops_a_running_session(counter):
    """undo() while a session runs on our functions: the session is flushed and stopped, then stock is back."""
    model = tiny_model("llama")
    handle = arkernels.patch(model)
    manager = model.init_continuous_batching(generation_config=_greedy(), continuous_batching_config=_cb_config())
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=NEW)
    handle.undo()
    assert not manager.is_running()
    assert model.config._attn_implementation == "sdpa" and "init_continuous_batching" not in model.__dict__
    result = manager.get_result(request_id=rid, timeout=1)
    assert result is not None and result.is_finished() and len(result.generated_tokens) == NEW


def test_unpatched_models_keep_stock_cb(counter, patched):
    """The CB names are registered globally, but only a patched model's session selects them."""
    patched(_model("llama"))
    other = tiny_model("llama", seed=1)
    out = other.generate_batch(PROMPTS[:2], generation_config=_greedy(), continuous_batching_config=_cb_config())
    assert len(out) == 2 and counter.attn == 0 and other.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("window", [0, 3])
def test_attend_padded_tail_rows(window):
    """CUDA graphs / compile pad CB's packed queries past the last sequence: the real rows are what they are
    unpadded, and the padding rows stay finite (they go through the rest of the layer)."""
    torch.manual_seed(0)
    hq, hkv, d, num_pages = 4, 2, 16, 9
    k_pages, v_pages = torch.randn(num_pages, PAGE, hkv, d), torch.randn(num_pages, PAGE, hkv, d)
    q_lens, kv_lens = [3, 1, 4], [7, 9, 4]
    cu_q = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    table = torch.tensor([[2, 5, 0], [1, 3, 8], [4, 0, 0]], dtype=torch.int32)
    query = torch.randn(1, hq, 8 + 5, d)  # 5 padding rows
    args = dict(window=window, scaling=d ** -0.5, softcap=0.0)
    padded = cb._attend(query, k_pages, v_pages, table, cu_k, cu_q, 8 + 5, **args)
    exact = cb._attend(query[:, :, :8], k_pages, v_pages, table, cu_k, cu_q, max(q_lens), **args)
    assert padded.shape == (1, 13, hq, d)
    torch.testing.assert_close(padded[:, :8], exact, rtol=0, atol=0)
    assert torch.isfinite(padded).all()
    from arkernels.reference.window_attention import window_attention_ref

    ref, _ = window_attention_ref(query[0, :, :8].transpose(0, 1), k_pages, v_pages, table,
                               torch.tensor(kv_lens, dtype=torch.int32), window=window, scale=d ** -0.5,
                               cu_seqlens_q=cu_q)
    torch.testing.assert_close(exact[0], ref.to(exact.dtype), rtol=1e-5, atol=1e-5)
    assert sum(q_lens) == 8


def test_block_table_from_cb_slots():
    """Page j of sequence b is the page of slot ``index[cu_k[b] + j * page]``: CB's read_index order."""
    pages = [[6, 2, 9], [3], [7, 1]]
    lens = [10, 2, 5]
    index = torch.cat([torch.tensor([p[i // PAGE] * PAGE + i % PAGE for i in range(n)]) for p, n in zip(pages, lens)])
    cu_k = torch.tensor([0, 10, 12, 17], dtype=torch.int32)
    table = cb._block_table(index, cu_k, max(lens), PAGE)
    assert table.dtype == torch.int32 and table.shape == (3, 3)
    for b, (p, n) in enumerate(zip(pages, lens)):
        assert table[b, : len(p)].tolist() == p


@pytest.mark.skipif(os.environ.get("ARKERNELS_SLOW_TESTS") != "1",
                    reason="CB's compiled varlen path costs ~100 s on 2 CPU cores (stock too); ARKERNELS_SLOW_TESTS=1")
def test_compiled_padded_path(counter, patched):
    """CB's compile mode pads the batch to static shapes (its CUDA-graph layout): tokens stay stock's."""
    from transformers import CompileConfig

    model = _model("gemma3_text")
    stock = _tokens(model.generate_batch(PROMPTS[:2], generation_config=_greedy(),
                                         continuous_batching_config=_cb_config()))
    patched(model)
    config = _cb_config(varlen_compile_config=CompileConfig(backend="eager", fullgraph=False),
                        q_padding_interval_size=8, kv_padding_interval_size=16)
    ours = _tokens(model.generate_batch(PROMPTS[:2], generation_config=_greedy(), continuous_batching_config=config))
    assert ours == stock and counter.attn > 0
