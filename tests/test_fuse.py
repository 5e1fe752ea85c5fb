"""arkernels.fuse_projections on tiny random models of every supported family (fp32): logits and greedy tokens of the
fused model equal the unfused one (model.generate, arkernels.generate, with arkernels.patch), one fused call per group
per forward, undo restores the original module and parameter objects; Int8Linear parts (w8a16, w8a8) fused equal
unfused; groups that cannot be fused are left alone with a reason. The default (fuse="auto": on for the compiled /
captured decode steps, and under patch's tiered compile from its first compiled call): every family the capability
check accepts gives the unfused tokens, the model unchanged."""
import pytest
import torch
from torch import nn

import arkernels
from arkernels.fuse import GROUPS, ProjectionSlice
from arkernels.hf.capability import check_model
from arkernels.hf.tiny import FAMILIES, CannotBuild, build_family, causal_lm_types, tiny_model
from arkernels.quant import W8A8_MIN_M, Int8Linear

# batch 2, row 0 left padded by 3; 11 positions > the tiny window of 5; prefill has 22 rows >= W8A8_MIN_M (17), so
# w8a8 runs its int8 tensor-core path in prefill and the weight-only path in decode (2 rows)
INPUT_IDS = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
ATTENTION_MASK = (INPUT_IDS != 0).long()
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [7]]  # ragged, for arkernels.generate
NEW_TOKENS = 10
GROUPS_PER_LAYER = len(GROUPS)  # qkv and gate/up
# fp32 logits: each output channel is the same dot product fused or not; only the GEMM's blocking of the reduction
# may differ (measured: 0.0 on this CPU for every family). 1e-5 absolute on logits of magnitude ~1 is a few ulps.
FP32_ATOL = 1e-5


def _greedy(model, **kw):
    return model.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, **kw)


@torch.no_grad()
def _logits(model):
    return model(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK).logits


def _count_fused_calls(model) -> list[int]:
    """A forward hook on every fused layer; returns the shared call counter."""
    calls = [0]
    for m in model.modules():
        for _, fused_name in GROUPS:
            fused = m.__dict__.get("_modules", {}).get(fused_name)
            if fused is not None:
                fused.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_fuse_greedy_identical(family):
    model = tiny_model(family)
    ref_logits, ref = _logits(model), _greedy(model)
    ref_ark = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4).tokens
    handle = arkernels.fuse_projections(model)
    try:
        layers = model.config.num_hidden_layers
        assert len(handle.fused) == GROUPS_PER_LAYER * layers and not handle.skipped
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.k_proj, ProjectionSlice) and isinstance(attn.qkv_proj, nn.Linear)
        # GQA: k and v are narrower than q (4 query heads, 2 kv heads of 16)
        assert (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features) == (64, 32, 32)
        assert (attn.qkv_proj.bias is not None) == (family == "qwen2")  # Qwen2's q/k/v carry biases
        calls = _count_fused_calls(model)
        logits = _logits(model)
        # the saving really happens: one fused call per group per layer, not one per part
        assert calls[0] == GROUPS_PER_LAYER * layers
        out = _greedy(model)
        res = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4)
    finally:
        handle.undo()
    torch.testing.assert_close(logits, ref_logits, atol=FP32_ATOL, rtol=0)
    assert torch.equal(out, ref)
    assert res.tokens == ref_ark


def test_fuse_undo_restores_exactly():
    model = tiny_model("qwen2")  # q/k/v biases: every tensor kind travels through the fused layer
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _greedy(model)
    handle = arkernels.fuse_projections(model)
    assert "model.layers.0.self_attn.qkv_proj.weight" in model.state_dict()
    assert "model.layers.0.mlp.gate_proj.weight" not in model.state_dict()
    # while fused the originals are views of the fused tensors: no second copy of the projection weights
    fused_bytes = sum(p.numel() for p in model.parameters())
    assert fused_bytes == sum(p.numel() for p in params.values())
    with pytest.raises(RuntimeError, match="already fused"):
        arkernels.fuse_projections(model)
    handle.undo()
    handle.undo()  # idempotent
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(model.get_submodule(n) is m for n, m in modules.items() if n)  # the same module objects
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)  # the same Parameter objects
    new_state = model.state_dict()
    assert new_state.keys() == state.keys() and all(torch.equal(new_state[k], state[k]) for k in state)
    # each restored tensor owns its storage again (none is a slice of a fused tensor)
    q, k = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj
    assert q.weight.untyped_storage().data_ptr() != k.weight.untyped_storage().data_ptr()
    assert q.weight.untyped_storage().nbytes() == q.weight.numel() * 4
    assert torch.equal(_greedy(model), ref)
    arkernels.fuse_projections(model).undo()  # fusable again after undo


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_fuse_int8_layouts(mode):
    """The fused layer's weight is the parts' weights concatenated in the parts' own layout (w8a16: packed, read here
    by the reference's own unpacking; the concatenation of whole 16-row groups is the packed concatenation), the
    parts' tensors stay views of it while fused, and undo gives each part its own weight back. A packed part whose
    out_features is not a multiple of 16 (not the last) would split a row group: that group is left alone."""
    from arkernels.reference.int8_matmul import unpack_weight_ref

    torch.manual_seed(1)
    parent = nn.Module()
    parts = [Int8Linear.from_linear(nn.Linear(48, n), mode) for n in (64, 32, 40)]
    plain = [p.plain_weight().clone() for p in parts]
    for name, p in zip(("q_proj", "k_proj", "v_proj"), parts):
        setattr(parent, name, p)
    with arkernels.fuse_projections(parent):
        fused = parent.qkv_proj.weight
        assert fused.shape[0] == 136 and torch.equal(parent.qkv_proj.weight_format, parts[0].weight_format)
        got = unpack_weight_ref(fused) if mode == "w8a16" else fused
        assert torch.equal(got, torch.cat(plain))
        assert all(p.weight.data_ptr() == fused[a:b].data_ptr() for p, (a, b) in zip(parts, [(0, 64), (64, 96),
                                                                                            (96, 136)]))
    assert all(torch.equal(p.plain_weight(), w) for p, w in zip(parts, plain))
    odd = nn.Module()
    for name, n in zip(("q_proj", "k_proj", "v_proj"), (40, 32, 32)):
        setattr(odd, name, Int8Linear.from_linear(nn.Linear(48, n), mode))
    with arkernels.fuse_projections(odd) as handle:
        if mode == "w8a16":
            assert handle.skipped == {"qkv_proj": "packed int8 parts whose out_features is not a multiple of 16 "
                                                  "(all but the last)"}
        else:
            assert handle.fused == ["qkv_proj"]


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_fuse_int8_identical(mode):
    # layer level, both row counts (decode M 4 and prefill M 32 >= W8A8_MIN_M): the int8 weight, fp32 scale and bias
    # of each channel are concatenated unchanged and the activations are quantized per row (the same for every
    # part), so each output element is the same int32 accumulation times the same scales: exact equality
    torch.manual_seed(0)
    parts = [Int8Linear.from_linear(nn.Linear(48, n), mode) for n in (64, 32, 32)]
    parent = nn.Module()
    for name, p in zip(("q_proj", "k_proj", "v_proj"), parts):
        setattr(parent, name, p)
    for m in (4, W8A8_MIN_M + 15):
        x = torch.randn(m, 48)
        ref = [p(x) for p in parts]
        handle = arkernels.fuse_projections(parent)
        assert isinstance(parent.qkv_proj, Int8Linear) and parent.qkv_proj.mode == mode
        assert parent.qkv_proj.weight.dtype == torch.int8 and parent.qkv_proj.weight_scale.dtype == torch.float32
        out = [parent.q_proj(x), parent.k_proj(x), parent.v_proj(x)]
        handle.undo()
        assert all(parent.get_submodule(n) is p for n, p in zip(("q_proj", "k_proj", "v_proj"), parts))
        for a, b in zip(out, ref):
            assert torch.equal(a, b)
    # model level: a quantized tiny model fused gives the same logits and greedy tokens
    model = tiny_model("qwen2")
    arkernels.quantize(model, mode)
    ref_logits, ref = _logits(model), _greedy(model)
    with arkernels.fuse_projections(model) as handle:
        assert len(handle.fused) == 4 and isinstance(model.model.layers[1].mlp.gate_up_proj, Int8Linear)
        logits, out = _logits(model), _greedy(model)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fuse_with_patch(family):
    model = tiny_model(family)
    ref = _greedy(model)
    attn_before = model.config._attn_implementation
    q_before = model.model.layers[0].self_attn.q_proj
    with arkernels.patch(model, block_size=4, fuse=True):
        assert isinstance(model.model.layers[0].self_attn.q_proj, ProjectionSlice)
        out = _greedy(model)
    assert torch.equal(out, ref)
    assert model.model.layers[0].self_attn.q_proj is q_before  # the patch handle undid the fusion too
    assert model.config._attn_implementation == attn_before
    assert not hasattr(model.model.layers[0].self_attn, "qkv_proj")


def test_fuse_any_call_pattern_and_skips():
    torch.manual_seed(1)
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = nn.Linear(16, 24), nn.Linear(16, 24)
    other = nn.Module()  # mixed types: left alone, with the reason
    other.gate_proj, other.up_proj = nn.Linear(16, 24), Int8Linear.from_linear(nn.Linear(16, 24))
    root = nn.Sequential(parent, other)
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    ref_gx, ref_ux, ref_uy = parent.gate_proj(x), parent.up_proj(x), parent.up_proj(y)
    with arkernels.fuse_projections(root) as handle:
        assert handle.fused == ["0.gate_up_proj"] and "types" in handle.skipped["1.gate_up_proj"]
        assert isinstance(other.gate_proj, nn.Linear)
        # a part asked twice, parts on different inputs, an input modified in place between parts: all recompute
        assert torch.equal(parent.up_proj(x), ref_ux)
        assert torch.equal(parent.up_proj(y), ref_uy)
        assert torch.equal(parent.up_proj(x), ref_ux)
        x2 = x.clone()
        parent.gate_proj(x2)
        x2.copy_(y)
        assert torch.equal(parent.up_proj(x2), ref_uy)
        assert torch.equal(parent.gate_proj(x), ref_gx)
        assert torch.equal(parent.gate_proj.weight, parent.gate_up_proj.weight[:24])


def _compiled_ops(model) -> tuple[torch.Tensor, list[str]]:
    """Logits of one forward under torch.compile(fullgraph=True) (a recording backend: any graph break raises) and
    the ops of the traced graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend, fullgraph=True)(input_ids=INPUT_IDS[1:], use_cache=False).logits
    return logits, [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("quant", [None, "w8a16"])
def test_fuse_compiles_without_graph_breaks(quant):
    # the compiled static step (issue 14) traces the model with torch.compile: the slices must not break the graph,
    # and the traced graph must hold the fused matmuls (2 layers x 7 projections -> 2 x 4; plus lm_head, never int8)
    model = tiny_model("qwen2")
    if quant:
        arkernels.quantize(model, quant)
    matmul = "w8a16" if quant else "linear"
    ref, ops = _compiled_ops(model)
    with arkernels.fuse_projections(model):
        out, fused_ops = _compiled_ops(model)
    torch._dynamo.reset()
    layers, lm_head = model.config.num_hidden_layers, 0 if quant else 1
    assert sum(matmul in o for o in ops) == 7 * layers + lm_head
    assert sum(matmul in o for o in fused_ops) == 4 * layers + lm_head
    torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=0)


def test_fuse_static_step():
    # arkernels.generate(cuda_graphs=True): the fixed-shape decode step (eager on the CPU), fused vs unfused
    model = tiny_model("mistral")
    kw = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4, cuda_graphs=True)
    ref = arkernels.generate(model, PROMPTS, **kw).tokens
    with arkernels.fuse_projections(model):
        assert arkernels.generate(model, PROMPTS, **kw).tokens == ref


# ---- the default: fused on the compiled / captured decode steps (fuse="auto") ---------------------------------------
FAMILY_PROMPTS = [[5, 6, 7, 8, 9], [(7 * i + 3) % 250 + 3 for i in range(13)]]  # 13 tokens: past the windows (8)
FAMILY_NEW = 6


class _FuseRecorder:
    """Wraps arkernels.fuse.fuse_projections: the handles the default made, and whether each was undone."""

    def __init__(self, monkeypatch):
        import arkernels.fuse as fuse_module

        self.handles = []
        inner = fuse_module.fuse_projections

        def recorded(model):
            self.handles.append(inner(model))
            return self.handles[-1]

        monkeypatch.setattr(fuse_module, "fuse_projections", recorded)


def _snapshot(model) -> tuple[dict, dict]:
    """Module and parameter objects by name, and a copy of the state_dict: what "unchanged" means."""
    objects = {n: m for n, m in model.named_modules()}
    objects.update({f"param {n}": p for n, p in model.named_parameters()})
    return objects, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, snapshot):
    """The same module and parameter objects, the same values, none of them turned into an inference tensor (the
    call runs under inference mode: tensors made there could not be used by autograd afterwards)."""
    objects, state = snapshot
    now, now_state = _snapshot(model)
    assert now.keys() == objects.keys() and all(now[n] is objects[n] for n in objects)
    assert now_state.keys() == state.keys() and all(torch.equal(now_state[k], state[k]) for k in state)
    assert not any(p.is_inference() for p in model.parameters())
    assert getattr(model, "_arkernels_fuse", None) is None


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_fuse_default_static_step_every_accepted_family(model_type, monkeypatch):
    """Every model type the installed transformers ships that the capability check accepts (the refused ones are
    tests/test_hf_families.py's): ``generate(cuda_graphs=True)`` fuses q/k/v and gate/up by default for the call and
    gives the tokens of ``fuse=False``, and the model is the same module and parameter objects, with the same values,
    afterwards. On the CPU the static step runs eagerly (no capture), the fused layer is the same nn.Linear math."""
    try:
        model = build_family(model_type)
    except CannotBuild as e:
        pytest.skip(f"transformers cannot build a tiny {model_type}: {e}")
    try:
        check_model(model, "arkernels.generate")
    except NotImplementedError as e:
        pytest.skip(f"refused by the capability check (tests/test_hf_families.py): {e}")
    kw = dict(max_new_tokens=FAMILY_NEW, eos_token_id=[], block_size=4, cuda_graphs=True)
    snap = _snapshot(model)
    try:
        ref = arkernels.generate(model, FAMILY_PROMPTS, fuse=False, **kw)
    except Exception as e:  # noqa: BLE001  (the unfused static step itself fails: not this test's subject)
        pytest.skip(f"the unfused static step fails on a tiny {model_type}: {type(e).__name__}: {e}")
    rec = _FuseRecorder(monkeypatch)
    res = arkernels.generate(model, FAMILY_PROMPTS, **kw)
    assert len(rec.handles) == 1 and not rec.handles[0].active  # fused for the call, undone after it
    assert res.tokens == ref.tokens, f"{model_type}: fused {res.tokens} != unfused {ref.tokens}"
    _assert_unchanged(model, snap)
    has_groups = any(all(hasattr(m, p) for p in parts) for m in model.modules() for parts, _ in GROUPS)
    assert bool(rec.handles[0].fused or rec.handles[0].skipped) == has_groups


def test_fuse_default_compiled_step(monkeypatch):
    """``generate(compile=True)`` fuses by default: the tokens of the unfused static step, one dynamo graph (no
    graph break), and a second call, fused anew (new module objects), reuses that graph: dynamo guards on the fused
    modules' types and attributes, not on their identity. The model is unchanged after each call."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    kw = dict(max_new_tokens=FAMILY_NEW, eos_token_id=[], block_size=4)
    ref = arkernels.generate(model, FAMILY_PROMPTS, cuda_graphs=True, fuse=False, **kw)
    snap = _snapshot(model)
    rec = _FuseRecorder(monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    try:
        for call in range(2):
            res = arkernels.generate(model, FAMILY_PROMPTS, compile=True, **kw)
            assert res.tokens == ref.tokens
            assert len(rec.handles) == call + 1 and len(rec.handles[-1].fused) == 2 * model.config.num_hidden_layers
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
            _assert_unchanged(model, snap)
    finally:
        torch._dynamo.reset()


def test_fuse_default_off_on_the_eager_path_and_opt_out(monkeypatch):
    """The eager decode path keeps the model's own projections unless ``fuse=True``; ``fuse=False`` opts the static
    step out; a model the caller fused stays fused (their handle) through a static call; other values are refused
    before anything runs, naming the argument."""
    model = tiny_model("qwen2")
    rec = _FuseRecorder(monkeypatch)
    kw = dict(max_new_tokens=3, eos_token_id=[], block_size=4)
    ref = arkernels.generate(model, FAMILY_PROMPTS, **kw)
    arkernels.generate(model, FAMILY_PROMPTS, cuda_graphs=True, fuse=False, **kw)
    assert not rec.handles
    snap = _snapshot(model)
    assert arkernels.generate(model, FAMILY_PROMPTS, fuse=True, **kw).tokens == ref.tokens
    assert len(rec.handles) == 1 and not rec.handles[0].active
    _assert_unchanged(model, snap)
    model(input_ids=INPUT_IDS[:1]).logits.sum().backward()  # autograd still takes the restored parameters
    model.zero_grad(set_to_none=True)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="generate: fuse must be 'auto', True or False"):
            arkernels.generate(model, FAMILY_PROMPTS, fuse=bad, **kw)
        with pytest.raises(ValueError, match="generate: fuse must be"):
            arkernels.generate(model, FAMILY_PROMPTS, fuse=bad, **dict(kw, max_new_tokens=0))
    mine = arkernels.fuse_projections(model)
    rec.handles.clear()
    try:
        assert arkernels.generate(model, FAMILY_PROMPTS, cuda_graphs=True, **kw).tokens == ref.tokens
        assert not rec.handles and mine.active and isinstance(model.model.layers[0].self_attn.q_proj, ProjectionSlice)
    finally:
        mine.undo()


def test_fuse_default_with_patch():
    """patch(compile=True) fuses by default (its calls compile from the first), undone with the patch; the tiered
    default (compile="auto") and compile=False do not, nor fuse=False; a bad value is refused before any change."""
    model = tiny_model("llama")
    q = model.model.layers[0].self_attn.q_proj
    for kw, fused in ((dict(compile=True), True), (dict(), False), (dict(compile=False), False),
                      (dict(compile=True, fuse=False), False), (dict(fuse=True), True)):
        with arkernels.patch(model, block_size=4, **kw):
            assert isinstance(model.model.layers[0].self_attn.q_proj, ProjectionSlice) == fused, kw
        assert model.model.layers[0].self_attn.q_proj is q
    with pytest.raises(ValueError, match="arkernels.patch: fuse must be 'auto', True or False"):
        arkernels.patch(model, fuse="always")
    assert model.model.layers[0].self_attn.q_proj is q and "generate" not in model.__dict__


def _eager_compile_config(model):
    """The compile config the patch's "auto" rule picks, on dynamo's "eager" backend (Inductor's C++ codegen takes
    minutes on 2 cores)."""
    from transformers import CompileConfig

    config = CompileConfig(backend="eager", fullgraph=True)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("fuse", ["auto", False])
def test_fuse_auto_with_tiered_compile(monkeypatch, fuse):
    """patch(compile="auto") with fuse="auto": the eager calls before the tier is due run unfused; the first call that
    compiles fuses (before its prefill and the trace: one graph, no graph break) and the model stays fused until
    undo, which restores the original modules and parameter objects; stock's tokens throughout. fuse=False never
    fuses, on the same compiled path."""
    from torch._dynamo.utils import counters

    from arkernels.hf import cache_hook

    monkeypatch.setattr(cache_hook, "_default_compile_config", _eager_compile_config)
    cache_hook._warned.discard("tier")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama")
    ref = _greedy(model)
    attn = model.model.layers[0].self_attn
    q, params = attn.q_proj, dict(model.named_parameters())
    steps = NEW_TOKENS - 1  # one-token forwards of a call
    fused = lambda: isinstance(attn.q_proj, ProjectionSlice)  # noqa: E731
    with arkernels.patch(model, block_size=4, compile_after=steps, fuse=fuse):
        assert torch.equal(_greedy(model), ref) and not fused()  # eager: steps 0 .. steps - 1
        assert counters["stats"]["unique_graphs"] == 0
        with pytest.warns(UserWarning, match="compiling this model's decode step"):
            assert torch.equal(_greedy(model), ref)
        assert counters["stats"]["unique_graphs"] == 1
        assert fused() == (fuse == "auto")
        assert torch.equal(_greedy(model), ref) and fused() == (fuse == "auto")
        assert counters["stats"]["unique_graphs"] == 1  # the fused graph reused, not retraced
    assert not counters["graph_break"]
    assert attn.q_proj is q and not hasattr(attn, "qkv_proj")
    assert all(p is params[n] for n, p in model.named_parameters())
    torch._dynamo.reset()


def test_fuse_auto_skips_a_stock_call_that_compiles():
    """A call the patch serves as stock (output_attentions=True) that transformers compiles (its static cache, an
    explicit compile_config) stays unfused, as unpatched; the same call without output_attentions is patched and its
    compile fuses."""
    torch._dynamo.reset()
    model = tiny_model("llama").eval()
    model.config._attn_implementation_internal = "eager"  # output_attentions needs an implementation that has them
    attn = model.model.layers[0].self_attn
    kw = dict(cache_implementation="static", compile_config=_eager_compile_config(model), return_dict_in_generate=True)
    with arkernels.patch(model, block_size=4, compile_after=None):
        _greedy(model, output_attentions=True, **kw)
        assert not isinstance(attn.q_proj, ProjectionSlice)
        _greedy(model, **kw)
        assert isinstance(attn.q_proj, ProjectionSlice)
    torch._dynamo.reset()


def test_fused_modules_take_the_models_mode():
    """The fused layer and the slices are new modules: they take the parts' train / eval mode. Left in training mode
    (nn.Module's default) they made an eval model look like it was training, and patch then served every fused call
    as the stock model (arkernels.hf.stock_call.in_training): a patched, fused greedy call really runs on the paged
    cache."""
    from arkernels.hf.cache import PagedCache

    model = tiny_model("llama")
    with arkernels.fuse_projections(model):
        assert not any(m.training for m in model.modules())
    model.train()
    with arkernels.fuse_projections(model):
        assert all(m.training for m in model.modules())
    model.eval()
    with arkernels.patch(model, block_size=4, fuse=True):
        out = model.generate(input_ids=INPUT_IDS, attention_mask=ATTENTION_MASK, max_new_tokens=3, do_sample=False,
                             eos_token_id=None, return_dict_in_generate=True)
    assert isinstance(getattr(out, "cache", None) or out.past_key_values, PagedCache)
