"""int8 Linear layers and the model pass that installs them.

- :class:`Int8Linear`: an ``nn.Linear`` drop-in with an int8 per-output-channel weight. ``mode="w8a16"`` keeps the
  activations in their float dtype and dequantises the weight inside the matmul (decode: memory bound, half the
  bytes of bf16); ``mode="w8a8"`` also quantizes the activations per token, dynamically, and runs the int8 tensor
  cores (prefill: compute bound) from W8A8_MIN_M rows on; fewer rows (decode) run the weight-only kernels.
- :func:`quantize` replaces a model's ``nn.Linear`` layers in place and reports what it did.
- :func:`save_quantized` / :func:`load_quantized`: safetensors (never pickle); which layers are int8, and in which
  mode, travels in the file's metadata.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import sys
from typing import Iterable

import torch
from torch import nn

from arkernels.ops.int8_matmul import (int8_matmul, quantize_per_channel, quantize_per_token, w8a16_fragment_matmul,
                                       w8a16_matmul)
from arkernels.ops.int8_matmul_layout import (LAYOUT_FRAGMENT, LAYOUT_PACKED, LAYOUT_PLAIN, PACK_INNER, fragment_weight,
                                              is_fragment, is_packed, pack_weight, to_plain)

MODES = ("w8a16", "w8a8")
# mode="w8a8" runs the weight-only kernels below this many rows (decode): at M <= 16 an int8 tensor-core tile (64+
# rows for Hopper wgmma) is mostly padding and the per-token quantization is one more launch, while both paths
# read the same int8 weight bytes, which is all a decode step costs. Prefill (M >= 17) takes the int8 tensor cores.
W8A8_MIN_M = 17
# The int8 weight's row length must be a multiple of this many bytes: the CUDA kernels then load 16-byte vectors
# along K (Triton specializes on 16-divisible strides and sizes). A 4099-byte row would fall back to byte loads, about
# 4x slower, silently: such layers are refused here (and quantize() keeps them in float), never run slow.
WEIGHT_ALIGN = 16
FORMAT = "arkernels-int8"  # safetensors metadata "format"; "int8_layers" holds {module name: mode} as JSON
# Storage layouts of the int8 weight (arkernels/ops/int8_matmul_layout.py) by name, and their tags (weight_format).
# "fragment" (mma B-fragment order, read by the hand-written CUDA decode kernel w8a16_fragment_matmul) is opt-in for
# mode w8a16: "packed" stays the default until a GPU has measured the new kernel against the Triton GEMV
# (benchmarks/gpu_check.sh, bench_int8_fragment.py).
LAYOUTS = {"plain": LAYOUT_PLAIN, "packed": LAYOUT_PACKED, "fragment": LAYOUT_FRAGMENT}
FRAGMENT_MAX_M = 16  # a fragment weight runs the CUDA fragment kernel up to this many rows (decode)


def unaligned_reason(in_features: int) -> str | None:
    """Why an int8 weight of ``in_features`` columns cannot take the kernels' aligned path, or None."""
    if in_features % WEIGHT_ALIGN:
        return (f"in_features={in_features} is not a multiple of {WEIGHT_ALIGN}: its int8 weight rows would not be "
                f"{WEIGHT_ALIGN}-byte aligned and the CUDA kernels would fall back to byte loads (~4x slower)")
    return None


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"Int8Linear: mode must be one of {MODES}, got {mode!r}")
    return mode


def _check_layout(mode: str, layout: str | None) -> str:
    """The storage layout for ``mode``: None picks the default (w8a16: packed, w8a8: plain)."""
    if layout is None:
        return "packed" if mode == "w8a16" else "plain"
    if layout not in LAYOUTS:
        raise ValueError(f"Int8Linear: layout must be one of {tuple(LAYOUTS)} or None, got {layout!r}")
    if mode == "w8a8" and layout != "plain":
        raise ValueError(f"Int8Linear: mode w8a8 stores the plain layout (its prefill runs the int8 tensor cores on "
                         f"K-major tiles), got layout {layout!r}")
    return layout


def _to_layout(w_plain: torch.Tensor, layout: str) -> torch.Tensor:
    return {"plain": lambda w: w, "packed": pack_weight, "fragment": fragment_weight}[layout](w_plain)


def _layout_of(w: torch.Tensor) -> str:
    return "fragment" if is_fragment(w) else "packed" if is_packed(w) else "plain"


class Int8Linear(nn.Module):
    """``y = x @ (weight * weight_scale[:, None]).T + bias`` with an int8 weight.

    Buffers (all in ``state_dict``): ``weight`` int8, ``weight_format`` (int32 scalar: the weight's layout tag),
    ``weight_scale`` float32 ``[out_features]`` (stays float32 through ``module.to(dtype)``), ``bias``
    ``[out_features]`` in the original Linear's dtype, or None. ``weight_format`` LAYOUT_PACKED (2, mode
    "w8a16"'s default, ``layout="packed"``): ``weight`` is the packed ``[out_features, in_features // 16, 16]`` of
    arkernels/ops/int8_matmul_layout.py, the order the Triton decode kernels stream; LAYOUT_FRAGMENT (3, mode
    "w8a16" with ``layout="fragment"``, opt-in): ``[out_features, in_features // 16, 4, 4]`` in mma B-fragment order,
    read by the hand-written CUDA decode kernel (not yet measured on a GPU: packed stays the default until it is);
    LAYOUT_PLAIN (1, mode "w8a8", whose prefill runs the int8 tensor cores on K-major ``[N, K]`` tiles): ``weight``
    is ``[out_features, in_features]``.
    A checkpoint without the tag holds the plain layout (written before the tag existed); loading converts any
    tagged or untagged weight to this module's own layout (:meth:`_load_from_state_dict`). Read the weight in
    the plain layout with :meth:`plain_weight`.

    ``forward(x)``: ``x [..., in_features]`` float32/float16/bfloat16 -> ``[..., out_features]`` in x's dtype, the
    ``nn.Linear`` contract. The layer is inference-only (no gradients flow to the int8 weight). The kernel follows
    the number of rows M (a shape, so no host sync, and a guard rather than a graph break under torch.compile):
    see :meth:`path`. ``in_features`` must be a multiple of WEIGHT_ALIGN (16): otherwise construction raises
    ValueError, as the CUDA kernels would read the unaligned weight rows byte by byte (~4x slower).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, mode: str = "w8a16",
                 device=None, dtype: torch.dtype = torch.float32, layout: str | None = None):
        super().__init__()
        reason = unaligned_reason(in_features)
        if reason is not None:
            raise ValueError(f"Int8Linear: {reason}; keep this layer in float (quantize() does so itself) or pad "
                             f"in_features to a multiple of {WEIGHT_ALIGN}")
        self.in_features, self.out_features, self.mode = in_features, out_features, _check_mode(mode)
        layout = _check_layout(mode, layout)
        fmt = LAYOUTS[layout]
        shape = {"plain": (out_features, in_features),
                 "packed": (out_features, in_features // PACK_INNER, PACK_INNER),
                 "fragment": (out_features, in_features // PACK_INNER, 4, 4)}[layout]
        self.register_buffer("weight", torch.zeros(shape, dtype=torch.int8, device=device))
        self.register_buffer("weight_format", torch.tensor(fmt, dtype=torch.int32, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, mode: str = "w8a16", layout: str | None = None) -> "Int8Linear":
        """Quantize ``linear.weight`` per output channel (symmetric int8); keeps the bias as it is. ``layout``: the
        weight's storage (None: the mode's default; "fragment": mode w8a16's opt-in CUDA decode kernel)."""
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, mode=mode,
                device=w.device, dtype=w.dtype, layout=layout)
        q, m.weight_scale = quantize_per_channel(w)
        m.weight = _to_layout(q, m.layout)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    @property
    def layout(self) -> str:
        """The weight's storage layout: "plain", "packed" or "fragment" (read from the weight itself, so a module
        built by fuse_projections or loaded from a checkpoint cannot disagree with it)."""
        return _layout_of(self.weight)

    def plain_weight(self) -> torch.Tensor:
        """The int8 weight as ``[out_features, in_features]`` (a copy when it is stored packed or in fragments)."""
        return to_plain(self.weight)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Converts the checkpoint's weight to this module's layout before the copy: a weight with no
        ``weight_format`` (checkpoints older than the tag) is the plain ``[N, K]``; a tagged one must match its
        tag's shape (1: 2-D, 2: 3-D, 3: 4-D). Any layout converts into any other (through the plain one).
        ``state_dict`` is load_state_dict's own copy: rewriting its entries is local to this load."""
        key, tag_key = prefix + "weight", prefix + "weight_format"
        if key in state_dict:
            w = state_dict[key]
            tag = int(state_dict[tag_key]) if tag_key in state_dict else LAYOUT_PLAIN
            dims = {LAYOUT_PLAIN: 2, LAYOUT_PACKED: 3, LAYOUT_FRAGMENT: 4}
            if dims.get(tag) != w.dim():
                error_msgs.append(f"{prefix}weight: layout tag {tag} does not describe a weight of shape "
                                  f"{tuple(w.shape)} (1: plain [N, K], 2: packed [N, K // 16, 16], "
                                  f"3: fragment [N, K // 16, 4, 4])")
                return
            mine = self.layout
            if _layout_of(w) != mine:
                plain = to_plain(w)
                if mine == "plain" or plain.shape[1] % PACK_INNER == 0:  # (another K: the copy reports the mismatch)
                    state_dict[key] = _to_layout(plain, mine)
            state_dict[tag_key] = self.weight_format.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def path(self, M: int, x: torch.Tensor | None = None) -> str:
        """The op ``forward`` runs for ``M`` rows: ``"w8a16"`` (weight-only; on CUDA its kernel again follows M:
        GEMV for M <= 4, split-K for <= 16, tiles above), ``"w8a8"`` (mode w8a8 and M >= W8A8_MIN_M), or with a
        fragment weight ``"fragment"`` (w8a16_fragment_matmul: M <= FRAGMENT_MAX_M with x fp16/bf16 on CUDA, or any
        x on the CPU, whose kernel reads the layout) and ``"w8a16-converted"`` (CUDA prefill, M > 16, or fp32 x:
        the Triton w8a16 kernels on the weight converted to the plain layout per call: one more pass over the weight,
        ~3 N K bytes of traffic and an N K-byte temporary, a few % of a 4096-row prefill, more at 17-64 rows)."""
        if self.mode == "w8a8" and M >= W8A8_MIN_M:
            return "w8a8"
        if not is_fragment(self.weight):
            return "w8a16"
        on_cuda = x is not None and x.is_cuda
        if not on_cuda or (M <= FRAGMENT_MAX_M and x.dtype in (torch.float16, torch.bfloat16)):
            return "fragment"
        return "w8a16-converted"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x.shape[:-1].numel(), x)
        if path == "fragment":
            return w8a16_fragment_matmul(x, self.weight, self.weight_scale, self.bias)
        if path == "w8a16-converted":
            return w8a16_matmul(x, to_plain(self.weight), self.weight_scale, self.bias)
        if path == "w8a16":
            return w8a16_matmul(x, self.weight, self.weight_scale, self.bias)
        lead = x.shape[:-1]
        xq, xs = quantize_per_token(x.reshape(-1, self.in_features))
        # mode w8a8 stores the plain layout; a packed weight here (a layer whose mode was changed after it was
        # built) is unpacked per call: right, one weight copy slower
        out = int8_matmul(xq, self.plain_weight(), xs, self.weight_scale, self.bias, out_dtype=x.dtype)
        return out.view(*lead, self.out_features)

    def _apply(self, fn, *args, **kwargs):
        # module.to(torch.bfloat16) casts every float buffer; the scale must stay fp32 (the kernels require it, and
        # a bf16 scale would add 0.4% error to every output). Only follow the weight's device.
        scale = self.weight_scale
        super()._apply(fn, *args, **kwargs)
        if self.weight_scale.dtype != torch.float32:
            self.weight_scale = scale.to(device=self.weight.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}, "
                f"weight={self.layout}")


@dataclasses.dataclass
class QuantizeReport:
    """What :func:`quantize` did. Bytes count every distinct parameter and buffer of the model once."""

    mode: str
    layers_replaced: int
    layers_skipped: list[str]  # by the skip patterns, then the unaligned ones
    bytes_before: int
    bytes_after: int
    layers_unaligned: list[str] = dataclasses.field(default_factory=list)  # kept in float: see unaligned_reason

    def __str__(self) -> str:
        mib = 1 << 20
        unaligned = (f"; {len(self.layers_unaligned)} of them for in_features not a multiple of {WEIGHT_ALIGN}"
                     if self.layers_unaligned else "")
        return (f"quantize({self.mode}): {self.layers_replaced} Linear layers replaced, "
                f"{len(self.layers_skipped)} skipped ({', '.join(self.layers_skipped[:4])}"
                f"{', ...' if len(self.layers_skipped) > 4 else ''}"
                f"{unaligned}); "
                f"{self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB "
                f"({self.bytes_before / max(self.bytes_after, 1):.2f}x smaller)")


def _model_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _skipped(name: str, skip: Iterable[str]) -> bool:
    """A pattern matches a module's full name, its last component(s) after a dot, or as an fnmatch pattern."""
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in skip)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _progress(items, total: int, enabled: bool | None, desc: str):
    if enabled is None:
        enabled = total >= 64 and sys.stderr.isatty()
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc=desc, unit="layer")


@torch.no_grad()
def quantize(model: nn.Module, mode: str = "w8a16", skip: Iterable[str] = ("lm_head",), *,
             layout: str | None = None, progress: bool | None = None) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` (exactly that type: subclasses that other code reads ``.weight``
    from are left alone) by an :class:`Int8Linear` in place, on the layer's own device.

    Args:
        model: any module, e.g. a transformers ``*ForCausalLM``.
        mode: ``"w8a16"`` (weight-only: decode-heavy use) or ``"w8a8"`` (dynamic per-token activations:
            prefill-heavy use).
        skip: module names to keep in float: a full name (``"model.layers.0.mlp"``), a trailing name
            (``"lm_head"``), or an fnmatch pattern (``"*.gate_proj"``). The default keeps the output head, whose
            error feeds the logits directly (and whose weight is often tied to the embedding). Layers whose
            in_features is not a multiple of WEIGHT_ALIGN stay in float too (listed in ``layers_unaligned``).
        layout: the int8 weights' storage: None (the mode's default: w8a16 packed, w8a8 plain), or "fragment" for
            mode w8a16 (opt-in: the hand-written CUDA decode kernel, w8a16_fragment_matmul; not yet measured on a
            GPU, so not the default).
        progress: a progress bar (tqdm) over the layers; None: only for 64+ layers on a terminal.

    Returns:
        A :class:`QuantizeReport` (layers replaced, names skipped, model bytes before and after).
    """
    _check_mode(mode)
    layout = _check_layout(mode, layout)
    skip = tuple(skip)
    if torch.distributed.is_available():
        # from_pretrained(tp_plan=...) holds sharded weights as DTensors and wraps each sharded Linear's forward with
        # its collectives (row-parallel all-reduce, lm_head all-gather): an Int8Linear in its place would drop them
        from torch.distributed.tensor import DTensor

        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        if sharded:
            raise NotImplementedError(
                f"quantize: the model is tensor-parallel ({len(sharded)} DTensor parameters, e.g. {sharded[0]}); "
                "int8 layers would drop its collectives. Quantize a model loaded without tp_plan, or run tensor "
                "parallelism in float")
    before = _model_bytes(model)
    targets, skipped, unaligned = [], [], []
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            if _skipped(name, skip):
                skipped.append(name)
            elif unaligned_reason(module.in_features) is not None:
                unaligned.append(name)
            else:
                targets.append(name)
    for name in _progress(targets, len(targets), progress, f"quantize({mode})"):
        _set_submodule(model, name, Int8Linear.from_linear(model.get_submodule(name), mode, layout))
    return QuantizeReport(mode, len(targets), skipped + unaligned, before, _model_bytes(model), unaligned)


def save_quantized(model: nn.Module, path: str) -> None:
    """Write ``model``'s full state (int8 layers included) to one safetensors file; which modules are
    :class:`Int8Linear`, and their modes, go into its metadata ("int8_layers"), their storage layouts too
    ("int8_layouts": read back by load_quantized; files without it load in each mode's default layout). Tied
    (shared) tensors are stored once."""
    from safetensors.torch import save_model

    mods = [(name, m) for name, m in model.named_modules() if isinstance(m, Int8Linear)]
    save_model(model, path, metadata={"format": FORMAT, "int8_layers": json.dumps({n: m.mode for n, m in mods}),
                                      "int8_layouts": json.dumps({n: m.layout for n, m in mods})})


@torch.no_grad()
def load_quantized(model: nn.Module, path: str, *, strict: bool = True) -> nn.Module:
    """Load a file written by :func:`save_quantized` into ``model``, a float model of the same architecture (or
    an already quantized one): the Linear layers listed in the file become :class:`Int8Linear` (empty shells on
    the layer's device, filled by the load; no re-quantization), then every tensor is loaded. Returns ``model``.
    """
    from safetensors import safe_open
    from safetensors.torch import load_model

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_quantized: {path} was not written by arkernels.save_quantized "
                         f"(metadata format {meta.get('format')!r}, expected {FORMAT!r})")
    layouts = json.loads(meta.get("int8_layouts", "{}"))
    for name, mode in json.loads(meta["int8_layers"]).items():
        module = model.get_submodule(name)
        if isinstance(module, Int8Linear):  # keeps its own layout: the load converts the file's into it
            module.mode = _check_mode(mode)
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"load_quantized: {name} is a {type(module).__name__} in the model but an int8 Linear "
                             f"in {path}")
        _set_submodule(model, name, Int8Linear(module.in_features, module.out_features, module.bias is not None,
                                               mode, device=module.weight.device, dtype=module.weight.dtype,
                                               layout=layouts.get(name)))
    load_model(model, path, strict=strict)
    return model
