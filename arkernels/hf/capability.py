"""What arkernels can run, decided from what a model's layers do, not from its model type.

``check_model(model)`` (called by ``arkernels.patch`` and ``arkernels.generate`` before anything changes) reads the
decoder's config and modules and refuses, naming the layer and the reason, whatever arkernels' attention kernels and
paged cache would compute differently from the model's own attention:

- every decoder layer ``0 .. num_hidden_layers - 1`` must hold one self-attention module (with ``layer_idx``) whose
  ``forward`` dispatches through transformers' attention registry (``ALL_ATTENTION_FUNCTIONS``, selected by
  ``config._attn_implementation``): a module that calls its own attention code (Falcon, Bloom) would silently keep
  running it, so it is refused by class name;
- each layer's type (``config.layer_types`` as transformers' ``DynamicCache`` reads it): ``full_attention``,
  ``sliding_attention``, ``chunked_attention``. Linear-attention, state-space, compressed or indexed (sparse) layers
  are refused: their recurrent states / selected keys are not what the paged cache holds. Hybrid models are refused
  whole rather than patched layer by layer: their ``DynamicCache`` layers hold conv/SSM states next to K/V, which a
  paged K/V cache cannot share cleanly;
- the key / value the cache update returns reach the attention function as they are (the paged cache returns its
  block pools there): a layer that splits or repeats them first (DiffLlama, JetMoe) is refused; a sliding layer
  must pass its window (``sliding_window=``), or the window it attends over is whatever keys its cache still holds;
- no encoder-decoder or cross-attention, no bidirectional flags (``config.is_causal=False``,
  ``use_bidirectional_attention``, a module's ``is_causal=False``), no ALiBi, one head dim for K and V (MLA's differ);
- every keyword the attention module hands the attention function (read from its ``forward``'s source) is one
  arkernels implements or knows to be harmless (``ATTENTION_KWARGS``); at run time ``arkernels_attention`` checks the
  values it really receives against the same table (``attention_kwarg_problem``);
- on CUDA, head dims and dtypes the CUDA kernels instantiate (``CUDA_HEAD_DIMS``, fp16/bf16); on the CPU any head dim
  up to ``CPU_MAX_HEAD_DIM``.

Multimodal ``*ForConditionalGeneration`` wrappers are checked through their language model (``get_decoder()``).
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
CUDA_HEAD_DIMS = (64, 80, 96, 128, 256)  # the head dims the CUDA window_attention kernels are instantiated for
CPU_MAX_HEAD_DIM = 512

# Every keyword a transformers attention module may hand the attention function, and what arkernels does with it.
# "implemented": arkernels_attention computes it. "harmless": carries nothing the attention math depends on (the
# reason says why). Any other keyword with a value other than None refuses: nothing is dropped silently.
IMPLEMENTED = {
    "scaling": "softmax scale",
    "dropout": "0 in eval mode (a call with any module in training runs as the unpatched model: stock_call)",
    "sliding_window": "window of W keys",
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks: one logit per query head that joins the softmax denominator",
    "is_causal": "True / None: causal; False refuses (bidirectional)",
    "attention_mask": "what arkernels_mask returned",
}
HARMLESS = {
    "position_ids": "RoPE (or none) is already applied to query and key; the mask function handles the positions",
    "cache_position": "transformers 5.17's positions: already applied to query/key and used by the cache",
    "position_embeddings": "the (cos, sin) pair, already applied to query and key",
    "use_cache": "the cache was updated before the call; the paged pools arrive as key/value",
    "past_key_values": "the cache object, already updated before the call",
    "past_key_value": "the cache object, already updated before the call",
    "cache": "the cache object (5.24 name), already updated before the call",
    "layer_idx": "identifies the layer (module.layer_idx is read instead)",
    "output_hidden_states": "a model output flag, not attention math",
    "output_router_logits": "a mixture-of-experts output flag, not attention math",
    "return_dict": "a model output flag, not attention math",
    "num_items_in_batch": "loss normalisation, not attention math",
    "deterministic": "a flash-attention determinism flag; arkernels' kernels are deterministic",
    "output_attentions": "False / None: no weights requested (a call that asks for them runs on the original "
                         "attention, arkernels.hf.stock_call; True reaching arkernels_attention refuses)",
}
# keywords seen in transformers' modeling files that change the math and arkernels does not implement: the reason
# goes into the refusal
REFUSED = {
    "position_bias": "a relative-position bias added to the scores",
    "head_mask": "a per-head output mask",
    "layer_head_mask": "a per-head output mask",
    "indices": "indexer-selected keys (sparse attention)",
    "block_indices": "selected key blocks (block-sparse attention)",
    "sinks": "sinks in a layout arkernels does not read (only gpt-oss' s_aux is implemented)",
    "cu_seq_lens_q": "packed variable-length sequences (flash-attention layout)",
    "cu_seq_lens_k": "packed variable-length sequences (flash-attention layout)",
    "max_length_q": "packed variable-length sequences (flash-attention layout)",
    "max_length_k": "packed variable-length sequences (flash-attention layout)",
}
ATTENTION_KWARGS = {**IMPLEMENTED, **HARMLESS}
# keywords fine whatever their value (the hot path of arkernels_attention skips them without a lookup of reasons)
ALWAYS_HARMLESS = frozenset(ATTENTION_KWARGS) - {"is_causal", "output_attentions", "dropout"}


def attention_kwarg_problem(name: str, value) -> str | None:
    """Why the attention keyword ``name=value`` cannot be run by arkernels, or None when it can."""
    if value is None:
        return None
    if name == "is_causal":
        return None if value else "is_causal=False (bidirectional attention)"
    if name == "output_attentions":
        return None if not value else "output_attentions=True (arkernels returns no attention weights)"
    if name == "dropout":
        return None
    if name in ATTENTION_KWARGS:
        return None
    reason = REFUSED.get(name)
    return f"{name} ({reason})" if reason else name


def describe_module(module) -> str:
    idx = getattr(module, "layer_idx", None)
    return f"layer {idx} ({type(module).__name__})" if idx is not None else type(module).__name__


@functools.lru_cache(maxsize=None)
def _forward_tree(cls):
    """``cls.forward`` parsed, or None when its source is unavailable or it never consults the attention registry."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (OSError, TypeError):
        return None
    if "ALL_ATTENTION_FUNCTIONS" not in source:
        return None
    return ast.parse(source)


def _interface_calls(tree) -> list[ast.Call]:
    """The calls of the function taken from ``ALL_ATTENTION_FUNCTIONS`` (``attention_interface(...)``)."""
    bound = set()  # names assigned from an expression that reads the registry (attention_interface = ...)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound |= {t.id for t in targets if isinstance(t, ast.Name)}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id in bound) or "ALL_ATTENTION_FUNCTIONS" in ast.unparse(
            node.func))]


@functools.lru_cache(maxsize=None)
def _dispatch_keywords(cls) -> tuple[str, ...] | None:
    """The keywords ``cls.forward`` passes to the function it takes from ``ALL_ATTENTION_FUNCTIONS``, or None when
    its forward never consults the registry."""
    tree = _forward_tree(cls)
    if tree is None:
        return None
    return tuple(dict.fromkeys(k.arg for call in _interface_calls(tree) for k in call.keywords if k.arg is not None))


@functools.lru_cache(maxsize=None)
def _cached_kv_rework(cls) -> str | None:
    """The first expression of ``cls.forward`` that reworks the key / value the cache update returned before they
    reach the attention function (DiffLlama splits V, JetMoe repeats K/V per expert), or None. The paged cache
    returns its pools ``[num_blocks, block_size, Hkv, D]`` there, which only the attention function can read."""
    tree = _forward_tree(cls)
    if tree is None:
        return None
    names, after = set(), 0
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "update"
                and isinstance(node.targets[0], ast.Tuple)):
            names |= {t.id for t in node.targets[0].elts if isinstance(t, ast.Name)}
            after = max(after, node.end_lineno)
    if not names:
        return None
    calls = _interface_calls(tree)
    fed = {n.id for call in calls for a in call.args for n in ast.walk(a) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):  # an assignment after the update, from the cached K/V, into what is attended over
        if not isinstance(node, ast.Assign) or node.lineno <= after:
            continue
        if isinstance(node.value, ast.Name) or (isinstance(node.value, ast.Tuple)
                                                 and all(isinstance(e, ast.Name) for e in node.value.elts)):
            continue  # passed on as they are (Gemma 4 keeps them for its KV-sharing layers)
        targets = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        used = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if targets & fed and used & names:
            return ast.unparse(node.value)
    return None


def _ops_support(argument: str) -> bool:
    from arkernels.ops.window_attention import window_attention

    return argument in inspect.signature(window_attention).parameters


def layer_types(config) -> list[str]:
    """Per decoder layer, its type as transformers' ``DynamicCache`` reads it (5.17 and 5.24)."""
    config = config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(config)[0])
    except ImportError:  # 5.17 keeps the rule in DynamicCache.__init__: the same fields
        n = config.num_hidden_layers
        types = getattr(config, "layer_types", None)
        if types is None:
            kind = ("sliding_attention" if getattr(config, "sliding_window", None) is not None else
                    "chunked_attention" if getattr(config, "attention_chunk_size", None) is not None else
                    "full_attention")
            types = [kind] * n
        return list(types)[:n]


_SIDE_BY_SIDE = "a layer that runs attention and a state-space mixer side by side (a recurrent state next to K/V)"
_LAYER_TYPE_REASONS = {
    "linear_attention": "a linear-attention / state-space layer of a hybrid model (a recurrent state, not K/V)",
    "mamba": "a state-space layer of a hybrid model (a recurrent state, not K/V)",
    "conv": "a convolution layer of a hybrid model (a recurrent state, not K/V)",
    "hybrid": _SIDE_BY_SIDE,
    "hybrid_sliding": _SIDE_BY_SIDE,
    "dummy": "a layer that stores no K/V of its own (it reuses another layer's: KV sharing, or has no attention)",
    "indexed_attention": "sparse attention over indexer-selected keys",
    "deepseek_sparse_attention": "sparse attention over indexer-selected keys",
    "compressed_sparse_attention": "attention over a compressed K/V cache",
    "heavily_compressed_attention": "attention over a compressed K/V cache",
}


def _refuse(who: str, msg: str):
    raise NotImplementedError(f"{who}: {msg}. Keep this model on transformers' attention (do not patch it).")


def _decoder_layers(decoder, n: int):
    """The decoder's list of ``n`` layers (the first ``ModuleList`` of that length), or None."""
    for module in decoder.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    return None


def _describe_layer(layers, i: int) -> str:
    """What layer ``i`` holds instead of a registry attention module: its attention-like classes, else its own."""
    if layers is None:
        return "no attention module"
    names = [type(m).__name__ for m in layers[i].modules()
             if any(s in type(m).__name__.lower() for s in ("attention", "attn", "mamba", "mixer", "delta", "rwkv"))]
    names = list(dict.fromkeys(names))
    return ", ".join(names) if names else type(layers[i]).__name__


def check_model(model, who: str = "arkernels.patch") -> list[torch.nn.Module]:
    """Refuse (``NotImplementedError`` naming the layer and the reason, ``TypeError`` for a model without
    ``generate``) what arkernels' attention and paged cache cannot run exactly; return the self-attention modules,
    one per decoder layer, in layer order."""
    if not hasattr(model, "generate"):
        raise TypeError(f"{who}: {type(model).__name__} has no generate(); pass a *ForCausalLM model")
    config = model.config
    name = f"{type(model).__name__} (model type {getattr(config, 'model_type', None)!r})"
    if getattr(config, "is_encoder_decoder", False):
        _refuse(who, f"{name} is an encoder-decoder model; arkernels runs decoder-only self-attention")
    text = config.get_text_config(decoder=True)
    if getattr(text, "add_cross_attention", False):
        _refuse(who, f"{name} has cross-attention layers (add_cross_attention=True); arkernels runs self-attention "
                     "only")
    if getattr(text, "is_causal", True) is False or getattr(text, "use_bidirectional_attention", False):
        _refuse(who, f"{name} is configured for bidirectional attention (is_causal=False / "
                     "use_bidirectional_attention); arkernels' kernels are causal")
    for holder in (text, getattr(text, "attn_config", None)):
        alibi = getattr(holder, "alibi", None) or getattr(holder, "use_alibi", None)
        if alibi or getattr(holder, "position_embedding_type", None) == "alibi":
            _refuse(who, f"{name} uses ALiBi position biases, which arkernels' kernels do not add")
    n = getattr(text, "num_hidden_layers", None)
    if n is None:  # e.g. Blt: byte-level local encoder / global / local decoder stacks, joined by cross-attention
        _refuse(who, f"{name}: its text config names no num_hidden_layers (not one stack of decoder layers); "
                     "arkernels' paged cache holds one stack of self-attention layers")
    types = layer_types(config)
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            reason = _LAYER_TYPE_REASONS.get(t, "a layer type arkernels does not know")
            _refuse(who, f"{name}: layer {i} is a {t!r} layer: {reason}; arkernels runs {', '.join(LAYER_TYPES)}")
    if "chunked_attention" in types and not _ops_support("chunk_size"):
        _refuse(who, f"{name} has chunked_attention layers and this build's window_attention has no chunk_size")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    per_layer: dict[int, list[torch.nn.Module]] = {}
    for path, module in decoder.named_modules():
        keywords = _dispatch_keywords(type(module))
        if keywords is None:
            continue
        last = path.rsplit(".", 1)[-1].lower()
        if getattr(module, "is_cross_attention", False) or "cross" in last or last == "encoder_attn":
            _refuse(who, f"{name}: {path} ({type(module).__name__}) is cross-attention; arkernels runs "
                         "self-attention only")
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            _refuse(who, f"{name}: {path} ({type(module).__name__}) has no layer_idx, so it cannot address the "
                         "paged cache")
        per_layer.setdefault(idx, []).append(module)
        _check_module(who, name, module, keywords, types[idx] if idx < len(types) else "full_attention")
    layers = _decoder_layers(decoder, n)
    for i in range(n):
        if i not in per_layer:
            _refuse(who, f"{name}: layer {i} ({_describe_layer(layers, i)}) does not call transformers' attention "
                         "registry (ALL_ATTENTION_FUNCTIONS / config._attn_implementation), so arkernels attention "
                         "would never run there")
        if len(per_layer[i]) > 1:
            _refuse(who, f"{name}: layer {i} has {len(per_layer[i])} attention modules "
                         f"({', '.join(type(m).__name__ for m in per_layer[i])}); arkernels expects one per layer")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        _refuse(who, f"{name} does not let transformers switch its attention implementation (its modeling file has "
                     "attention modules that bypass the AttentionInterface), so arkernels attention would never run")
    extra = sorted(set(per_layer) - set(range(n)))
    if extra:
        _refuse(who, f"{name}: attention modules with layer_idx {extra} lie outside the {n} decoder layers")
    _check_device(who, name, [per_layer[i][0] for i in range(n)], model)
    return [per_layer[i][0] for i in range(n)]


def _check_module(who: str, name: str, module, keywords: tuple[str, ...], layer_type: str) -> None:
    where = f"{name}: {describe_module(module)}"
    if getattr(module, "is_causal", True) is False:
        _refuse(who, f"{where} is bidirectional (is_causal=False); arkernels' kernels are causal")
    qk = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
    v = getattr(module, "v_head_dim", None)
    if qk is not None and v is not None and qk != v:
        _refuse(who, f"{where} has K head dim {qk} and V head dim {v} (multi-head latent attention, MLA); "
                     "arkernels' kernels need one head dim for K and V")
    rework = _cached_kv_rework(type(module))
    if rework is not None:
        _refuse(who, f"{where} reworks the key / value returned by the cache update before attending ({rework}); "
                     "arkernels' paged cache returns its block pools there, which only its attention can read")
    if layer_type == "sliding_attention" and "sliding_window" not in keywords:
        # the cache keeps this layer's last W keys (transformers' DynamicSlidingWindowLayer), but the attention is told
        # no window: what stock computes then depends on which keys happen to be left (all of a prompt, W in decode)
        _refuse(who, f"{where} is a sliding_attention layer (its cache keeps a window of keys) but its attention "
                     "passes no sliding_window, so the window it attends over is not defined by the layer")
    for kw in keywords:
        if kw == "s_aux":
            if not _ops_support("sinks"):
                _refuse(who, f"{where} passes s_aux (attention sinks) and this build's window_attention has no sinks")
            continue
        problem = None if kw in ATTENTION_KWARGS else attention_kwarg_problem(kw, True)
        if problem is not None:
            _refuse(who, f"{where} passes {problem} to the attention function, which arkernels attention does not "
                         "implement")


def _check_device(who: str, name: str, modules, model) -> None:
    param = next(model.parameters(), None)
    if param is None:
        return
    for m in modules:
        dim = getattr(m, "head_dim", None)
        if not isinstance(dim, int):
            continue
        if param.device.type == "cuda" and dim not in CUDA_HEAD_DIMS:
            _refuse(who, f"{name}: {describe_module(m)} has head_dim {dim}; the CUDA kernels are built for "
                         f"{', '.join(map(str, CUDA_HEAD_DIMS))} (the CPU kernel takes up to {CPU_MAX_HEAD_DIM})")
        if dim > CPU_MAX_HEAD_DIM:
            _refuse(who, f"{name}: {describe_module(m)} has head_dim {dim}; arkernels' kernels take at most {CPU_MAX_HEAD_DIM}")
    if param.device.type == "cuda" and param.dtype not in (torch.float16, torch.bfloat16):
        _refuse(who, f"{name} is {param.dtype} on CUDA; the CUDA kernels take float16 / bfloat16 (model.half() or "
                     "model.to(torch.bfloat16))")


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the attention kernels and the paged cache hold


def check_model_tensors(model, op: str, attention: bool = True) -> None:
    """The model's floating dtype and device are ones arkernels' kernels serve, checked up front: otherwise a float64
    model fails inside the first attention call, mid-generate. ``attention``: arkernels' attention will run (its
    CUDA kernels take float16 / bfloat16 only; float32 attention runs on the CPU)."""
    dtype, device = getattr(model, "dtype", None), getattr(model, "device", None)
    if dtype not in _DTYPES:
        raise TypeError(f"{op}: the model's dtype is {dtype}; arkernels' kernels take float32, float16 or bfloat16 "
                        "(convert it first, e.g. model.to(torch.float32))")
    kind = torch.device(device).type if device is not None else "cpu"
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{op}: the model is on {device}; arkernels runs on cpu or cuda")
    if kind == "cuda":
        from arkernels._library import cuda_kernels_built

        if not cuda_kernels_built():
            raise RuntimeError(f"{op}: the model is on {device} but this arkernels build has no CUDA kernels (built "
                               "CPU-only); rebuild with ARKERNELS_CUDA=1")
        if attention and dtype == torch.float32:
            raise TypeError(f"{op}: the CUDA attention kernels take float16 or bfloat16, the model is float32 on "
                            f"{device} (model.to(torch.bfloat16), or patch(attention=False))")
