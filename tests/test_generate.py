"""arkernels.generate: ragged prompts equal stock greedy per prompt, batch invariance under seeds, EOS handling,
block release, streaming, bad arguments; the static decode step of cuda_graphs=True (eager on the CPU: token-identical
to the default path, graph-safe op trace) and its CUDA-graph capture (GPU only); compile=True (that step under
torch.compile: the same tokens, one graph per batch-size bucket)."""
import functools
import math
from collections import defaultdict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import arkernels
from arkernels.cache import SCRATCH_BLOCK
from arkernels.hf.cache_layer import PagedLayer
from arkernels.hf.tiny import FAMILIES, TINY_WINDOW, tiny_model

from arkernels.decode import step as STEP  # the decode step (arkernels.generate is the function)
from arkernels.ops.sampling import SEED_STRIDE, wrap64

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23, 24, 25], [7]]  # ragged, longer than window 5
NEW_TOKENS = 10


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_matches_stock(family):
    model = tiny_model(family)
    ref = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    res = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4)
    assert res.tokens == ref
    assert all(v == 0 for v in res.cache_blocks_in_use.values())  # every block back in the pool
    assert model.config._attn_implementation == "sdpa"  # the attention switch was restored
    assert res.prompt_lens == [len(p) for p in PROMPTS]


def test_generate_batch_invariance_under_seeds():
    model = tiny_model("qwen3")
    kw = dict(max_new_tokens=NEW_TOKENS, temperature=1.3, top_p=0.95, eos_token_id=[])
    batch = arkernels.generate(model, PROMPTS, seed=[11, 12, 13, 14], **kw)
    for i in (0, 2):  # the same prompt and seed alone give the same tokens as inside the batch
        alone = arkernels.generate(model, [PROMPTS[i]], seed=11 + i, **kw)
        assert alone.tokens[0] == batch.tokens[i]
    other = arkernels.generate(model, PROMPTS, seed=[99, 12, 13, 14], **kw)
    assert other.tokens[1:] == batch.tokens[1:]  # a row's seed changes only that row
    assert other.tokens[0] != batch.tokens[0]


def test_generate_eos_stops_row_and_releases_blocks():
    model = tiny_model("llama")
    free = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    eos = free.tokens[1][3]  # row 1 emits this at its 4th step: make it the EOS
    first = {r: next((i for i, t in enumerate(toks) if t == eos), None) for r, toks in enumerate(free.tokens)}
    seen = []
    res = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                             stream=lambda row, tok: seen.append((row, tok)))
    for r, toks in enumerate(free.tokens):
        stop = first[r]
        assert res.tokens[r] == (toks if stop is None else toks[: stop + 1])  # EOS included, nothing after it
        assert res.finished_by_eos[r] == (stop is not None)
    assert len(res.tokens[1]) == 4
    assert sorted(seen) == sorted((r, t) for r, toks in enumerate(res.tokens) for t in toks)
    assert [t for r, t in seen if r == 0] == res.tokens[0]  # streamed in order
    assert all(v == 0 for v in res.cache_blocks_in_use.values())


def test_generate_text_and_tensor_inputs():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    a = arkernels.generate(model, ids, max_new_tokens=3, eos_token_id=[])
    b = arkernels.generate(model, ids.tolist(), max_new_tokens=3, eos_token_id=[])
    assert a.tokens == b.tokens and len(a.tokens[0]) == 3
    assert arkernels.generate(model, [[5]], max_new_tokens=0).tokens == [[]]


def test_generate_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="generate: .*tokenizer"):
        arkernels.generate(model, ["hello"])
    with pytest.raises(ValueError, match="generate: prompt 1"):
        arkernels.generate(model, [[1, 2], []])
    with pytest.raises(ValueError, match="generate: seed"):
        arkernels.generate(model, [[1, 2], [3]], seed=[1, 2, 3])
    with pytest.raises(ValueError, match="generate: max_new_tokens"):
        arkernels.generate(model, [[1, 2]], max_new_tokens=-1)
    with pytest.raises(ValueError, match="generate: seed"):  # checked before the static path is set up
        arkernels.generate(model, [[1, 2], [3]], seed=[1, 2, 3], cuda_graphs=True)


# ---- no host waits in the decode loop --------------------------------------------------------------------------------
FORWARD, HOST_READ = "test::forward", "test::host_read"


def _marked(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return wrapper


def _profiled_generate(model, prompts, monkeypatch, **kw):
    """``arkernels.generate`` under torch.profiler (CPU), with every model forward and every host read of tensor data
    (``.tolist()``, ``.numpy()``; ``.item()`` / ``int()`` / ``bool()`` show as ``aten::_local_scalar_dense``) marked as
    ranges. Returns the result and the trace's events in start order."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(torch.Tensor, "tolist", _marked(HOST_READ, torch.Tensor.tolist))
    monkeypatch.setattr(torch.Tensor, "numpy", _marked(HOST_READ, torch.Tensor.numpy))
    monkeypatch.setattr(model, "forward", _marked(FORWARD, model.forward))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        res = arkernels.generate(model, prompts, **kw)
    return res, sorted(prof.events(), key=lambda e: e.time_range.start)


def _in_arkernels_op(e) -> bool:
    while e.cpu_parent is not None:
        e = e.cpu_parent
        if e.name.startswith("arkernels::"):
            return True
    return False


def _within(e, outer) -> bool:
    return outer.time_range.start <= e.time_range.start and e.time_range.end <= outer.time_range.end


@pytest.mark.parametrize("cuda_graphs,temperature", [(False, 0.0), (False, 1.3), (True, 0.0)])
def test_generate_decode_loop_has_no_host_waits(cuda_graphs, temperature, monkeypatch):
    """In the decode loop (a CPU profiler trace of a whole call, the batch shrinking by EOS): no
    ``aten::_local_scalar_dense`` (an ``.item()``-style sync), at most one host read of device data per step (the
    token ids), each done only after the next step was launched (the host never waits for the step it just
    launched), none inside a forward, and no tensor built from Python data (``aten::lift_fresh``) inside a decode
    forward (on a GPU that is a host-to-device copy mid-step)."""
    model = tiny_model("gemma3_text")  # a full and a sliding group
    kw = dict(max_new_tokens=STATIC_NEW_TOKENS, temperature=temperature, top_p=0.9, seed=[3, 1, 4, 1, 5],
              block_size=STATIC_BLOCK, cuda_graphs=cuda_graphs)
    eos = _staggered_eos(arkernels.generate(model, STATIC_PROMPTS, eos_token_id=[], **kw))
    ref = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, **kw)
    res, events = _profiled_generate(model, STATIC_PROMPTS, monkeypatch, eos_token_id=eos, **kw)
    assert res.tokens == ref.tokens and any(res.finished_by_eos)
    forwards = [e for e in events if e.name == FORWARD]
    prefill, decode = forwards[0], forwards[1:]
    assert len(decode) >= max(len(t) for t in res.tokens) - 1 >= 3
    after = [e for e in events if e.time_range.start >= prefill.time_range.start]
    # (the CPU kernels of arkernels' ops are host code and may read their inputs: on CUDA each is one launch)
    assert not [e for e in after if e.name == "aten::_local_scalar_dense" and not _in_arkernels_op(e)]
    reads = [e for e in after if e.name == HOST_READ]
    assert not [e for e in reads if any(_within(e, f) for f in forwards)]  # no read inside a forward
    assert len(reads) <= len(forwards)  # one read per step (the prefill's ids included), at most
    for i, r in enumerate(reads[: len(decode)]):  # read i (step i's ids) comes after step i + 1 was launched
        assert decode[i].time_range.start < r.time_range.start, f"read {i} waits for the step it just launched"
    lifts = [e for e in after if e.name == "aten::lift_fresh" and any(_within(e, f) for f in decode)]
    assert not lifts, "a decode forward builds a tensor from Python data"


# ---- cuda_graphs=True: the static decode step ---------------------------------------------------------------------
STATIC_PROMPTS = PROMPTS + [[9, 8, 7, 6, 5]]  # 5 rows: buckets 5 (the cap, not a power of two), 4 (padded), 2, 1
STATIC_NEW_TOKENS = 12  # > TINY_WINDOW + block_size: sliding groups free blocks during decode
STATIC_BLOCK = 4
STATIC_CASES = [(f, 0.0) for f in ("llama", "mistral", "qwen3", "gemma3_text")] + [("qwen3", 1.3), ("gemma3_text", 0.8)]
# Ops that read device memory on the host, or bake host data into the step as a constant: a CUDA graph capture
# fails on the first kind and silently replays stale values with the second.
POISON = 7.0  # finite: a correct kernel gives masked keys weight 0, and 0 * 7 = 0
HOST_OPS = ("aten.item", "aten._local_scalar_dense", "aten.lift_fresh", "aten.is_nonzero", "aten.equal",
            "aten.nonzero", "aten.masked_select", "aten.resolve_conj", "aten.resolve_neg")  # resolve_*: .tolist()


def _staggered_eos(free) -> list[int]:
    """EOS ids that end rows 0, 2 and 4 of an EOS-free run at steps 2, 5 and 8 at the latest: the batch shrinks
    through several buckets, some padded."""
    return [free.tokens[r][s] for r, s in ((0, 2), (2, 5), (4, 8))]


class _OpTrace(TorchDispatchMode):
    """Every op of a region with its non-tensor arguments (tensors as shape + dtype)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        desc = tree_map(lambda a: (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        self.ops.append((str(func), repr(desc)))
        return func(*args, **kwargs)


@pytest.fixture
def static_steps(monkeypatch):
    """Records each static step: bucket, active rows, its op trace, its buffer's address, the cache's blocks in use."""
    calls = []
    forward, step = STEP.StaticDecode._forward, STEP.StaticDecode.step

    def traced_forward(self, b):
        with _OpTrace() as trace:
            out = forward(self, b)
        calls[-1].update(bucket=b, trace=trace.ops, cache=self.cache, buffer=self.buffers[b].data_ptr(),
                         out_shape=tuple(out.shape), blocks=dict(self.cache.blocks_in_use), generation=self.cache.generation)
        return out

    def counted_step(self, rows, *args):
        calls.append(dict(rows=list(rows)))
        return step(self, rows, *args)

    monkeypatch.setattr(STEP.StaticDecode, "_forward", traced_forward)
    monkeypatch.setattr(STEP.StaticDecode, "step", counted_step)
    return calls


@pytest.mark.parametrize("family,temperature", STATIC_CASES)
def test_generate_static_decode_matches_dynamic(family, temperature, static_steps):
    model = tiny_model(family)
    kw = dict(max_new_tokens=STATIC_NEW_TOKENS, temperature=temperature, top_p=0.9, seed=[3, 1, 4, 1, 5],
              block_size=STATIC_BLOCK)
    eos = _staggered_eos(arkernels.generate(model, STATIC_PROMPTS, eos_token_id=[], **kw))
    ref = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, **kw)
    res = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, cuda_graphs=True, **kw)
    assert res.tokens == ref.tokens
    assert res.finished_by_eos == ref.finished_by_eos
    assert res.decode_tokens == ref.decode_tokens == sum(len(t) for t in ref.tokens) - len(STATIC_PROMPTS)
    assert all(v == 0 for v in res.cache_blocks_in_use.values())  # every block back in the pool
    assert model.config._attn_implementation == "sdpa"
    assert len(static_steps) == max(len(t) for t in ref.tokens) - 1  # one static step per decode step
    for c in static_steps:
        n = len(c["rows"])
        assert c["bucket"] == min(1 << (n - 1).bit_length(), len(STATIC_PROMPTS)) and c["out_shape"] == (c["bucket"],)


def test_generate_static_decode_is_graph_safe(static_steps, monkeypatch):
    """What a capture needs, checked on the CPU: no host reads and no host constants inside the step, the same op
    sequence with the same scalar arguments at every step of a bucket (a replay re-runs exactly those), one fixed
    buffer per bucket, and tables/pools that never move; sliding groups stay bounded by their window; padding rows
    write nothing (the pools are poisoned with a finite sentinel: the pad token's K/V may well be zeros)."""
    init = PagedLayer.lazy_initialization

    def poisoned(self, key_states, value_states):
        init(self, key_states, value_states)
        self.k_pool.fill_(POISON)
        self.v_pool.fill_(POISON)

    monkeypatch.setattr(PagedLayer, "lazy_initialization", poisoned)
    model = tiny_model("gemma3_text")  # one full and one sliding group
    kw = dict(max_new_tokens=STATIC_NEW_TOKENS, temperature=1.5, top_p=0.9, seed=[3, 1, 4, 1, 5],
              block_size=STATIC_BLOCK, cuda_graphs=True)
    eos = _staggered_eos(arkernels.generate(model, STATIC_PROMPTS, eos_token_id=[], **kw))
    static_steps.clear()
    res = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, **kw)
    by_bucket = defaultdict(list)
    for c in static_steps:
        by_bucket[c["bucket"]].append(c)
    assert len(by_bucket) >= 3 and any(len(c["rows"]) < c["bucket"] for c in static_steps)  # padded buckets ran
    for b, calls in by_bucket.items():
        ops = calls[0]["trace"]
        assert ops and not [op for op, _ in ops if op.startswith(HOST_OPS)]
        assert any(op.startswith("arkernels.window_attention") for op, _ in ops)
        assert all(c["trace"] == ops for c in calls), f"bucket {b}: the step's ops changed between steps"
        assert len({c["buffer"] for c in calls}) == 1
    assert {c["generation"] for c in static_steps} == {0}
    per_row = -(-(TINY_WINDOW - 1 + 1) // STATIC_BLOCK) + 1  # blocks a row's window spans at most
    assert max(c["blocks"][TINY_WINDOW] for c in static_steps) <= len(STATIC_PROMPTS) * per_row
    assert all(v == 0 for v in res.cache_blocks_in_use.values())
    for layer in static_steps[-1]["cache"].layers:  # padding rows (slot -1) wrote nothing, not even scratch
        assert (layer.k_pool[SCRATCH_BLOCK] == POISON).all() and (layer.v_pool[SCRATCH_BLOCK] == POISON).all()


def test_generate_static_bucket():
    assert [STEP.bucket(n, 5) for n in range(1, 6)] == [1, 2, 4, 4, 5]
    assert [STEP.bucket(n, 64) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 64, 64]


@pytest.mark.cuda
def test_generate_cuda_graphs_capture_and_replay(monkeypatch):
    # bf16 and head_dim 64: what the CUDA attention kernel supports
    model = tiny_model("gemma3_text", dtype=torch.bfloat16, head_dim=64).cuda()
    kw = dict(max_new_tokens=STATIC_NEW_TOKENS, temperature=0.8, seed=[3, 1, 4, 1, 5], block_size=STATIC_BLOCK,
              cuda_graphs=True)
    eos = _staggered_eos(arkernels.generate(model, STATIC_PROMPTS, eos_token_id=[], **kw))
    with monkeypatch.context() as m:  # the same static steps run eagerly: the same kernels on the same shapes
        m.setattr(STEP.StaticDecode, "_replay", STEP.StaticDecode._forward)
        ref = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, **kw)
    captured = []
    capture = STEP.StaticDecode._capture

    def counted(self, b):
        captured.append(b)
        return capture(self, b)

    monkeypatch.setattr(STEP.StaticDecode, "_capture", counted)
    res = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, **kw)
    assert res.tokens == ref.tokens
    assert len(captured) == len(set(captured)) >= 2  # one capture per bucket, replayed after
    assert all(v == 0 for v in res.cache_blocks_in_use.values())


def test_generate_num_return_sequences_fork_the_prompt():
    model = tiny_model("gemma3_text")  # sliding + full groups: both fork
    prompts = [PROMPTS[0], PROMPTS[2]]
    kw = dict(max_new_tokens=NEW_TOKENS, temperature=1.3, eos_token_id=[], block_size=4)
    res = arkernels.generate(model, prompts, seed=[11, 12], num_return_sequences=3, **kw)
    assert len(res.tokens) == 6 and res.prompt_lens == [9, 9, 9, 6, 6, 6]
    single = arkernels.generate(model, prompts, seed=[11, 12], **kw)
    assert res.tokens[0] == single.tokens[0] and res.tokens[3] == single.tokens[1]  # sample 0 = the plain call
    assert len({tuple(t) for t in res.tokens[:3]}) == 3  # own seed streams: 3 different samples at temperature 1.3
    # each sample equals that prompt generated alone with the sample's seed: forked blocks hold the prompt exactly
    seed_1 = wrap64(11 + SEED_STRIDE)
    alone = arkernels.generate(model, [prompts[0]], seed=seed_1, **kw)
    assert alone.tokens[0] == res.tokens[1]
    assert all(v == 0 for v in res.cache_blocks_in_use.values())
    greedy = arkernels.generate(model, prompts, num_return_sequences=2, max_new_tokens=NEW_TOKENS, eos_token_id=[],
                                block_size=4)
    assert greedy.tokens[0] == greedy.tokens[1] and greedy.tokens[2] == greedy.tokens[3]
    with pytest.raises(ValueError, match="num_return_sequences"):
        arkernels.generate(model, prompts, num_return_sequences=0)


# ---- compile=True: the static decode step under torch.compile ------------------------------------------------------
COMPILE_CASES = [("llama", 0.0), ("qwen3", 1.3)]  # qwen3: a full and a sliding group; seeded top-p sampling


@pytest.mark.parametrize("family,temperature", COMPILE_CASES)
def test_generate_compiled_static_step(family, temperature, monkeypatch):
    """compile=True: the same tokens as the eager static step, one dynamo graph per batch-size bucket (no graph
    break, no recompile over 11 decode steps that cross block boundaries, nor in a later call whose prompts have other
    lengths), and the compiled code is reused by a later call (a fresh cache, the same model)."""
    from torch._dynamo.utils import counters

    buckets = []
    step = STEP.StaticDecode.step

    def counted_step(self, rows, *args):
        buckets.append(STEP.bucket(len(rows), self.batch))
        return step(self, rows, *args)

    monkeypatch.setattr(STEP.StaticDecode, "step", counted_step)
    model = tiny_model(family)
    kw = dict(max_new_tokens=STATIC_NEW_TOKENS, temperature=temperature, top_p=0.9, seed=[3, 1, 4, 1, 5],
              block_size=STATIC_BLOCK)
    eos = _staggered_eos(arkernels.generate(model, STATIC_PROMPTS, eos_token_id=[], **kw))
    ref = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, cuda_graphs=True, **kw)
    torch._dynamo.reset()
    counters.clear()
    buckets.clear()
    try:
        res = arkernels.generate(model, STATIC_PROMPTS, eos_token_id=eos, compile=True, **kw)
        assert res.tokens == ref.tokens and res.finished_by_eos == ref.finished_by_eos
        assert len(buckets) == STATIC_NEW_TOKENS - 1 and len(set(buckets)) >= 3
        assert model.config._attn_implementation == "sdpa"  # the static step's attention switch was restored
        assert all(v == 0 for v in res.cache_blocks_in_use.values())
        assert counters["stats"]["unique_graphs"] == len(set(buckets))  # one compile per bucket, none per step
        assert not counters["graph_break"]
        # other prompt lengths (longer by 3, so other block boundaries), no EOS: bucket 5 only, compiled already
        longer = [[40, 41, 42] + p for p in STATIC_PROMPTS]
        ref2 = arkernels.generate(model, longer, eos_token_id=[], cuda_graphs=True, **kw)
        graphs = counters["stats"]["unique_graphs"]
        res2 = arkernels.generate(model, longer, eos_token_id=[], compile=True, **kw)
        assert res2.tokens == ref2.tokens
        assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
    finally:
        torch._dynamo.reset()


@pytest.mark.cuda
def test_generate_compiled_static_step_cuda_graphs():
    # compile=True on CUDA: the compiled step captured per bucket; bf16 / head_dim 64 as the CUDA kernel needs. Not
    # run yet (no GPU here): Inductor's fused bf16 norms may round differently from eager, which this would show
    model = tiny_model("gemma3_text", dtype=torch.bfloat16, head_dim=64).cuda()
    kw = dict(max_new_tokens=STATIC_NEW_TOKENS, eos_token_id=[], block_size=STATIC_BLOCK)
    ref = arkernels.generate(model, STATIC_PROMPTS, cuda_graphs=True, **kw)
    torch._dynamo.reset()
    try:
        res = arkernels.generate(model, STATIC_PROMPTS, compile=True, **kw)
    finally:
        torch._dynamo.reset()
    assert res.tokens == ref.tokens


def test_generate_logprobs_past_the_vocabulary_refuses():
    """No top-n beyond the vocabulary (vLLM refuses past its max_logprobs): the whole vocabulary is the most."""
    model = tiny_model("llama")
    vocab = model.get_input_embeddings().num_embeddings
    res = arkernels.generate(model, [[5, 6]], max_new_tokens=1, logprobs=vocab)
    assert len(res.logprobs[0][0].top) == vocab
    with pytest.raises(ValueError, match=f"generate: logprobs={vocab + 1} asks for more top tokens than the "
                                         f"vocabulary's {vocab}"):
        arkernels.generate(model, [[5, 6]], max_new_tokens=1, logprobs=vocab + 1)


def test_generate_refuses_a_prompt_with_every_token_banned():
    """Nothing left to draw (stock's multinomial raises; the fused sampler would return token 0): refused before the
    prefill, naming the prompt. One token left is enough, and it is what the row emits."""
    model = tiny_model("llama")
    vocab = model.get_input_embeddings().num_embeddings
    all_but_7 = [t for t in range(vocab) if t != 7]
    res = arkernels.generate(model, [[5, 6]], max_new_tokens=3, suppress_tokens=all_but_7, eos_token_id=[])
    assert res.tokens == [[7, 7, 7]]
    with pytest.raises(ValueError, match="generate: prompt 0: bad_words_ids, suppress_tokens and logit_bias ban every "
                                         f"token of the vocabulary \\({vocab}\\)"):
        arkernels.generate(model, [[5, 6]], max_new_tokens=1, suppress_tokens=all_but_7, logit_bias={7: -math.inf})
    with pytest.raises(ValueError, match="generate: prompt 1: bad_words_ids"):
        arkernels.generate(model, [[5, 6], [4]], max_new_tokens=1, suppress_tokens=all_but_7,
                           logit_bias=[{}, {7: -math.inf}])
    with pytest.raises(ValueError, match="generate: prompt 0: every token but the EOS ids is banned and "
                                         "min_new_tokens masks"):
        arkernels.generate(model, [[5, 6]], max_new_tokens=2, suppress_tokens=all_but_7, eos_token_id=7,
                           min_new_tokens=1)
