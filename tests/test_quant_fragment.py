"""Int8Linear / quantize with the fragment layout (mode w8a16, layout="fragment"): forward through
w8a16_fragment_matmul, conversions on load in every direction, save_quantized round trip, fuse_projections."""
import json

import pytest
import torch
from torch import nn

import arkernels
from arkernels.ops.int8_matmul_layout import (LAYOUT_FRAGMENT, LAYOUT_PACKED, LAYOUT_PLAIN, fragment_weight,
                                             is_fragment, pack_weight, unfragment_weight)
from arkernels.quant import Int8Linear, quantize
from arkernels.reference.int8_matmul import w8a16_matmul_ref
from conftest import SIMT_DEVICES

IN, OUT = 80, 37  # a K tail (80 % 32 == 16) and a short last row group


def _linear(seed=0, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(IN, OUT, bias=bias)


def test_fragment_layer_stores_and_runs_the_fragment_layout():
    lin = _linear()
    frag = Int8Linear.from_linear(lin, "w8a16", layout="fragment")
    packed = Int8Linear.from_linear(lin, "w8a16")
    assert frag.layout == "fragment" and packed.layout == "packed"
    assert is_fragment(frag.weight) and frag.weight.shape == (OUT, IN // 16, 4, 4)
    assert int(frag.weight_format) == LAYOUT_FRAGMENT and "weight=fragment" in repr(frag)
    assert torch.equal(frag.plain_weight(), packed.plain_weight())
    x = torch.randn(3, 2, IN)
    assert frag.path(6, x) == "fragment"
    ref = w8a16_matmul_ref(x, frag.plain_weight(), frag.weight_scale, frag.bias).float()
    torch.testing.assert_close(frag(x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(frag(x), packed(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", SIMT_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fragment_layer_runs_the_cuda_kernel_source(device, dtype):
    import arkernels.simt as simt

    frag = Int8Linear.from_linear(_linear(1), "w8a16", layout="fragment").to(dtype)
    x = torch.randn(5, IN).to(dtype)
    y = frag(x)
    assert len(simt.launches()) == 1  # the emulated CUDA kernel ran
    ref = w8a16_matmul_ref(x, frag.plain_weight(), frag.weight_scale, frag.bias)
    eps = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    assert ((y.double() - ref).abs() <= eps * ref.abs() + 1e-3).all()


def test_fragment_layout_is_w8a16_only():
    with pytest.raises(ValueError, match="mode w8a8 stores the plain layout"):
        Int8Linear(IN, OUT, mode="w8a8", layout="fragment")
    with pytest.raises(ValueError, match="layout must be one of"):
        Int8Linear(IN, OUT, layout="tiles")


def _state(module, tag, weight):
    sd = {k: v.clone() for k, v in module.state_dict().items()}
    sd["weight"] = weight
    if tag is None:
        del sd["weight_format"]
    else:
        sd["weight_format"] = torch.tensor(tag, dtype=torch.int32)
    return sd


@pytest.mark.parametrize("source", ["untagged", "plain", "packed", "fragment"])
@pytest.mark.parametrize("target", [("w8a16", "fragment"), ("w8a16", "packed"), ("w8a8", "plain")])
def test_load_converts_between_layouts(source, target):
    src = Int8Linear.from_linear(_linear(2), "w8a16")
    plain = src.plain_weight().clone()
    weight, tag = {"untagged": (plain, None), "plain": (plain, LAYOUT_PLAIN),
                   "packed": (pack_weight(plain), LAYOUT_PACKED),
                   "fragment": (fragment_weight(plain), LAYOUT_FRAGMENT)}[source]
    mode, layout = target
    dst = Int8Linear(IN, OUT, mode=mode, layout=layout)
    dst.load_state_dict(_state(src, tag, weight))
    assert dst.layout == layout and torch.equal(dst.plain_weight(), plain)
    assert int(dst.weight_format) == {"fragment": 3, "packed": 2, "plain": 1}[layout]
    assert torch.equal(dst.weight_scale, src.weight_scale)


def test_load_refuses_a_tag_that_does_not_match_the_shape():
    src = Int8Linear.from_linear(_linear(3), "w8a16", layout="fragment")
    dst = Int8Linear(IN, OUT)
    with pytest.raises(RuntimeError, match="layout tag 2 does not describe a weight of shape"):
        dst.load_state_dict(_state(src, LAYOUT_PACKED, src.weight))


def _tiny_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32))


def test_quantize_fragment_and_save_round_trip(tmp_path):
    model = _tiny_model()
    x = torch.randn(3, 48)
    report = quantize(model, layout="fragment", skip=())
    assert report.layers_replaced == 3
    assert all(m.layout == "fragment" for m in model.modules() if isinstance(m, Int8Linear))
    out = model(x)
    path = str(tmp_path / "frag.safetensors")
    arkernels.save_quantized(model, path)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        assert set(json.loads(f.metadata()["int8_layouts"]).values()) == {"fragment"}
    target = arkernels.load_quantized(_tiny_model(), path)
    assert all(m.layout == "fragment" for m in target.modules() if isinstance(m, Int8Linear))
    assert torch.equal(target(x), out)
    # an already quantized model keeps its own layout: the fragment file converts into packed layers
    packed = _tiny_model()
    quantize(packed, skip=())
    arkernels.load_quantized(packed, path)
    assert all(m.layout == "packed" for m in packed.modules() if isinstance(m, Int8Linear))
    torch.testing.assert_close(packed(x), out, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="mode w8a8 stores the plain layout"):
        quantize(_tiny_model(), "w8a8", layout="fragment")


def test_fuse_projections_on_fragment_weights():
    """Fragment parts concatenate in whole 16-row groups: the fused weight is their concatenation, its output the
    parts' outputs; a part whose out_features is not a multiple of 16 (not the last) is left alone."""
    torch.manual_seed(5)
    parent = nn.Module()
    parts = [Int8Linear.from_linear(nn.Linear(48, n), "w8a16", layout="fragment") for n in (64, 32, 40)]
    for name, p in zip(("q_proj", "k_proj", "v_proj"), parts):
        setattr(parent, name, p)
    x = torch.randn(4, 48)
    ref = [p(x) for p in parts]
    plain = [p.plain_weight().clone() for p in parts]
    with arkernels.fuse_projections(parent):
        fused = parent.qkv_proj
        assert fused.layout == "fragment" and int(fused.weight_format) == LAYOUT_FRAGMENT
        assert torch.equal(unfragment_weight(fused.weight), torch.cat(plain))
        out = [parent.q_proj(x), parent.k_proj(x), parent.v_proj(x)]
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    odd = nn.Module()
    for name, n in zip(("q_proj", "k_proj", "v_proj"), (40, 32, 32)):
        setattr(odd, name, Int8Linear.from_linear(nn.Linear(48, n), "w8a16", layout="fragment"))
    with arkernels.fuse_projections(odd) as handle:
        assert "qkv_proj" in handle.skipped
