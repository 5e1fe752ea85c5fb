"""Every attention keyword arkernels refuses, one synthetic module per keyword: ``check_model`` (the static check,
from the module's ``forward`` source, at patch time) and ``arkernels_attention`` (the values a call really passes)
refuse it, naming the layer, the keyword and the reason; the keywords it implements or knows to be harmless pass
both. ``sinks=`` is a layout arkernels does not read (only gpt-oss' ``s_aux`` is implemented): a module passing it is
refused, never served as if it were ``s_aux``.

The calls served as the unpatched model instead of refused (``output_attentions=True`` through a forward or
generate, training mode) are tests/test_hf_stock_call.py's.
"""
import importlib.util

import pytest
import torch

import arkernels
from arkernels.hf import capability
from arkernels.hf.attention import arkernels_attention
from arkernels.hf.tiny import tiny_model
from test_hf_attention import _Layer, _qkv

# the spec, written out (not read from capability.REFUSED, so a keyword moved out of the refused table fails here):
# keyword -> the start of the reason its refusal gives
REFUSED = {
    "position_bias": "a relative-position bias added to the scores",
    "head_mask": "a per-head output mask",
    "layer_head_mask": "a per-head output mask",
    "indices": "indexer-selected keys",
    "block_indices": "selected key blocks",
    "sinks": "sinks in a layout arkernels does not read",
    "cu_seq_lens_q": "packed variable-length sequences",
    "cu_seq_lens_k": "packed variable-length sequences",
    "max_length_q": "packed variable-length sequences",
    "max_length_k": "packed variable-length sequences",
}
UNKNOWN = "some_new_flag"  # a keyword nobody listed: refused, named, with no reason

_MODULE = '''
import transformers.models.llama.modeling_llama as ml
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


class {cls}(ml.LlamaAttention):
    """LlamaAttention whose call into the attention registry also passes {kw}=."""

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        return attention_interface(self, hidden_states, hidden_states, hidden_states, attention_mask,
                                   scaling=self.scaling, {kw}=getattr(self, "extra", None), **kwargs)
'''


def _attention_class(tmp_path, kw: str):
    """A module class whose ``forward`` (real source on disk: the static check reads it) passes ``kw=``."""
    cls = "Passes_" + kw
    path = tmp_path / f"{cls.lower()}.py"
    path.write_text(_MODULE.format(cls=cls, kw=kw))
    spec = importlib.util.spec_from_file_location(f"_refusal_{kw}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, cls)


def _model_with(tmp_path, kw: str, layer: int = 1):
    """The tiny llama with layer ``layer``'s attention replaced by one that passes ``kw=``."""
    model = tiny_model("llama")
    model.model.layers[layer].self_attn = _attention_class(tmp_path, kw)(model.config, layer)
    return model


def _where(kw, layer=1):
    return rf"LlamaForCausalLM \(model type 'llama'\): layer {layer} \(Passes_{kw}\) passes {kw}"


def test_refused_table_is_the_spec():
    assert set(capability.REFUSED) == set(REFUSED)
    assert not set(REFUSED) & set(capability.ATTENTION_KWARGS)  # none of them implemented or harmless as well
    assert UNKNOWN not in capability.ATTENTION_KWARGS and UNKNOWN not in capability.REFUSED


@pytest.mark.parametrize("kw", list(REFUSED) + [UNKNOWN])
def test_check_model_refuses_keyword(kw, tmp_path):
    reason = rf" \({REFUSED[kw]}" if kw in REFUSED else ""
    with pytest.raises(NotImplementedError, match=rf"^arkernels.patch: {_where(kw)}{reason}.* to the attention "
                                                  r"function, which arkernels attention does not implement"):
        capability.check_model(_model_with(tmp_path, kw))


def test_patch_refuses_sinks_module_and_leaves_the_model_alone(tmp_path):
    """A gpt-oss-like layer handing its sinks over as ``sinks=`` (not ``s_aux=``): the patch refuses before it changes
    anything, naming the keyword."""
    model = _model_with(tmp_path, "sinks", layer=0)
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match=rf"{_where('sinks', 0)} \(sinks in a layout arkernels does not "
                                                  r"read \(only gpt-oss' s_aux is implemented\)\)"):
        arkernels.patch(model)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("kw", sorted(capability.IMPLEMENTED) + sorted(capability.HARMLESS))
def test_check_model_accepts_implemented_and_harmless_keyword(kw, tmp_path):
    if kw in ("scaling", "attention_mask"):
        pytest.skip(f"{kw} is the template's own argument")
    modules = capability.check_model(_model_with(tmp_path, kw))
    assert type(modules[1]).__name__ == f"Passes_{kw}"


@pytest.mark.parametrize("kw", list(REFUSED) + [UNKNOWN])
def test_attention_refuses_keyword_value_and_serves_none(kw):
    """A value refuses, naming the layer, the keyword and its reason; None is no value: the call is served as without
    the keyword."""
    q, k, v = _qkv()
    reason = rf" \({REFUSED[kw]}" if kw in REFUSED else ""
    with pytest.raises(NotImplementedError, match=rf"^arkernels attention: layer 3 \(_Layer\) passes {kw}{reason}"):
        arkernels_attention(_Layer(), q, k, v, None, scaling=0.3, **{kw: torch.zeros(4)})
    ref, _ = arkernels_attention(_Layer(), q, k, v, None, scaling=0.3)
    out, _ = arkernels_attention(_Layer(), q, k, v, None, scaling=0.3, **{kw: None})
    assert torch.equal(out, ref)


def test_attention_sinks_keyword_is_not_s_aux():
    """``s_aux=`` changes the output (the sinks join the denominator); the same tensor as ``sinks=`` refuses."""
    q, k, v = _qkv(seed=1)
    sinks = torch.tensor([3.0, -1.0, 0.5, 2.0])
    plain, _ = arkernels_attention(_Layer(), q, k, v, None, scaling=0.3)
    with_sinks, _ = arkernels_attention(_Layer(), q, k, v, None, scaling=0.3, s_aux=sinks)
    assert (with_sinks - plain).abs().max() > 1e-2
    with pytest.raises(NotImplementedError, match=r"passes sinks \(sinks in a layout arkernels does not read"):
        arkernels_attention(_Layer(), q, k, v, None, scaling=0.3, sinks=sinks)
