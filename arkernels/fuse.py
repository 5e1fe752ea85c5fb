"""``arkernels.fuse_projections(model)``: one matmul for q/k/v and one for gate/up, for this model instance only.

A decode step of a Llama-shaped layer runs five input projections (q, k, v, gate, up) that all read the same
activation row; fused, they are two matmuls: 3 fewer launches per layer and the activation row read twice instead of
five times. The weights are concatenated along the output dimension, so every output channel is computed by the same
dot product as before (per-channel int8 scales and biases are concatenated the same way).

How the model's own forward keeps working, on transformers 5.17 and 5.24 alike (both call
``self.q_proj(h)``, ``self.k_proj(h)``, ``self.v_proj(h)`` on one tensor ``h``, and ``self.gate_proj(x)``,
``self.up_proj(x)`` on one ``x``): the parent module gets the fused layer as a new child (``qkv_proj`` /
``gate_up_proj``: a plain ``nn.Linear`` or ``Int8Linear``, so every kernel and ``quantize`` serve it), and its
``q_proj`` / ``k_proj`` / ``v_proj`` (``gate_proj`` / ``up_proj``) become :class:`ProjectionSlice` modules without
parameters. The first slice called with a tensor runs the fused layer and keeps the result; the others return their
column range of it when called with the same tensor object, unmodified (``_version``; identity alone for
inference-mode tensors, which keep no version), and the result is dropped once
every slice has taken its part. Any other call pattern (a different input, a part asked twice) recomputes, so the
outputs are right whatever order or inputs the forward uses; only the saving depends on the pattern.

Memory stays 1x: the original modules are kept by the handle, their tensors turned into views of the fused ones.
``undo()`` puts the original module objects back, with the same parameter / buffer objects, holding copies of the
fused tensors' current values (so a ``model.to(...)`` in between is followed).

Default (``fuse="auto"`` of ``arkernels.generate`` and ``arkernels.patch``, :func:`wants_fusion`): on where the decode
step is compiled or captured (``generate(cuda_graphs=True)`` / ``compile=True`` for the call, undone after it;
``patch(compile=True)`` while patched), where a launch saved is worth most and the numerics already differ from the
eager step's; off on the eager paths, which keep stock's per-part GEMMs. ``fuse=False`` opts out, ``True`` fuses on
any path. tests/test_fuse.py checks fused against unfused tokens on every family the capability check accepts.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from arkernels.ops.int8_matmul_layout import PACK_ROWS
from arkernels.quant import Int8Linear

# (parts, fused child name): the parent holds each part as an attribute; the fused layer is added under the name
GROUPS = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))
_FUSE_ATTR = "_arkernels_fuse"
_TENSORS = {nn.Linear: ("weight", "bias"), Int8Linear: ("weight", "weight_scale", "bias")}


class _Shared:
    """The fused result of one input, shared by the slices of one group until each has taken its part."""

    def __init__(self, fused: nn.Module, parts: int):
        self.fused, self.parts = fused, parts
        self.x, self.version, self.y, self.taken = None, None, None, set()

    def part(self, index: int, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        # inference-mode tensors (arkernels.generate runs under torch.inference_mode) keep no version counter, and
        # torch.compile cannot trace is_inference() / _version (a graph break): there only the identity is checked
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        if self.x is not x or self.version != version or index in self.taken:
            self.x, self.version, self.y, self.taken = x, version, self.fused(x), set()
        self.taken.add(index)
        # a column range of the fused output: a view whose last dim is contiguous, so the model's
        # .view(*shape, -1, head_dim) works without a copy
        out = self.y[..., start:end]
        if len(self.taken) == self.parts:
            self.x = self.y = None  # every part taken: hold neither the input nor the output past this layer
        return out


class ProjectionSlice(nn.Module):
    """Stands where ``q_proj`` (etc.) was: ``forward(x)`` returns columns ``[start, end)`` of the fused layer's
    output for ``x`` (``[..., in_features] -> [..., end - start]``). Holds no parameters (the fused layer, a sibling,
    does); ``weight`` / ``bias`` are views of the fused layer's rows for code that reads them."""

    def __init__(self, shared: _Shared, index: int, start: int, end: int, name: str):
        super().__init__()
        self.__dict__["_shared"] = shared  # not a child module: the fused layer is registered once, on the parent
        self.index, self.start, self.end, self.name = index, start, end, name
        self.in_features, self.out_features = shared.fused.in_features, end - start

    @property
    def weight(self) -> torch.Tensor:
        return self._shared.fused.weight[self.start:self.end]

    @property
    def bias(self) -> torch.Tensor | None:
        b = self._shared.fused.bias
        return None if b is None else b[self.start:self.end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared.part(self.index, x, self.start, self.end)

    def extra_repr(self) -> str:
        return f"{self.name}: columns [{self.start}, {self.end}) of the fused layer"


def _fusable(mods: list[nn.Module]) -> str | None:
    """Why these modules cannot be fused into one, or None when they can."""
    kinds = {type(m) for m in mods}
    if len(kinds) != 1 or next(iter(kinds)) not in _TENSORS:
        return f"types {sorted(k.__name__ for k in kinds)} (needs all nn.Linear or all Int8Linear)"
    if len({m.in_features for m in mods}) != 1:
        return "different in_features"
    if len({(m.weight.dtype, m.weight.device) for m in mods}) != 1:
        return "weights of different dtypes or devices"
    if len({None if m.bias is None else m.bias.dtype for m in mods}) != 1:
        return "bias on some parts only, or biases of different dtypes"
    if isinstance(mods[0], Int8Linear) and len({m.mode for m in mods}) != 1:
        return "different int8 modes"
    if isinstance(mods[0], Int8Linear) and len({m.weight.dim() for m in mods}) != 1:
        return "int8 weights in different layouts"
    if any(m.weight.dim() > 2 and m.out_features % PACK_ROWS for m in mods[:-1]):
        # packed and fragment rows concatenate in whole row groups only (arkernels/ops/int8_matmul_layout.py)
        return f"packed int8 parts whose out_features is not a multiple of {PACK_ROWS} (all but the last)"
    if any(hasattr(m, "_hf_hook") or m._forward_hooks or m._forward_pre_hooks for m in mods):
        return "hooks on a part (accelerate offload or user hooks would be bypassed)"
    return None


@torch.no_grad()
def _build(mods: list[nn.Module]) -> nn.Module:
    first, out = mods[0], sum(m.out_features for m in mods)
    w = first.weight
    # built on "meta", then every tensor replaced by the concatenation: no transient full-size zero weight
    if isinstance(first, Int8Linear):
        fused = Int8Linear(first.in_features, out, bias=first.bias is not None, mode=first.mode, device="meta")
        fused.weight = torch.cat([m.weight for m in mods])  # packed too: whole row groups (_fusable)
        fused.weight_format = first.weight_format.clone()
        fused.weight_scale = torch.cat([m.weight_scale for m in mods])
        if first.bias is not None:
            fused.bias = torch.cat([m.bias for m in mods])
        return fused
    fused = nn.Linear(first.in_features, out, bias=first.bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight for m in mods]), requires_grad=w.requires_grad)
    if first.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=first.bias.requires_grad)
    return fused


@dataclasses.dataclass
class _Fused:
    parent: nn.Module
    name: str  # the fused child's attribute name
    parts: tuple[str, ...]
    originals: list[nn.Module]
    ranges: list[tuple[int, int]]


class FuseHandle:
    """Returned by :func:`fuse_projections`. ``fused``: the fused layers' module names; ``skipped``: ``{module name:
    reason}`` for groups left alone. ``undo()`` restores the original modules (idempotent); a context manager."""

    def __init__(self, model: nn.Module, groups: list[_Fused], names: list[str], skipped: dict[str, str]):
        self.model, self._groups, self.fused, self.skipped = model, groups, names, skipped
        self.active = True

    @torch.no_grad()
    def undo(self) -> None:
        if not self.active:
            return
        for g in self._groups:
            fused = getattr(g.parent, g.name)
            for part, original, (start, end) in zip(g.parts, g.originals, g.ranges):
                for t in _TENSORS[type(original)]:
                    mine = getattr(original, t)
                    if mine is not None:
                        # same tensor object, own storage again, the fused layer's current values/device/dtype
                        mine.data = getattr(fused, t)[start:end].clone()
                setattr(g.parent, part, original)
            delattr(g.parent, g.name)
        self.model.__dict__.pop(_FUSE_ATTR, None)
        self.active = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def __repr__(self) -> str:
        return f"FuseHandle({len(self.fused)} fused, {len(self.skipped)} skipped, active={self.active})"


@torch.no_grad()
def fuse_projections(model: nn.Module) -> FuseHandle:
    """Merge every module's ``q_proj``/``k_proj``/``v_proj`` into one layer (``qkv_proj``) and ``gate_proj``/
    ``up_proj`` into one (``gate_up_proj``), in place, for ``nn.Linear`` and ``Int8Linear`` parts (int8 weights,
    fp32 per-channel scales and biases are concatenated; the mode is kept).

    Each output channel is the same dot product as before. Measured on the CPU (tests/test_fuse.py): fp32 logits and
    greedy tokens equal bit for bit on every supported family, int8 (w8a16, w8a8) outputs equal bit for bit (each
    channel is one int32 accumulation times the same scales). A float GEMM library may block the reduction
    differently for the wider fused matrix (not seen on this CPU; cuBLAS in bf16 not measured): a last-bit logit
    difference, which can flip a greedy token only at an exact near-tie. While fused,
    ``state_dict`` holds ``qkv_proj.*`` / ``gate_up_proj.*`` in place of the parts: ``undo()`` before saving.

    Args:
        model: any module; typically a transformers ``*ForCausalLM`` of a family ``arkernels.patch`` supports.

    Returns:
        :class:`FuseHandle`; ``handle.undo()`` restores the original module objects (with the same parameter objects).
        A group whose parts differ (types, in_features, dtype/device, bias, int8 mode) or carry hooks is left alone
        and listed in ``handle.skipped`` with the reason.
    """
    if getattr(model, _FUSE_ATTR, None) is not None:
        raise RuntimeError("arkernels.fuse_projections: this model is already fused; undo() the first handle")
    if _tensor_parallel(model):
        # tensor-parallel Linears are sharded per part with their own collectives: a concatenation would mix shards
        raise NotImplementedError("arkernels.fuse_projections: the model is tensor-parallel (DTensor parameters)")
    groups, names, skipped = [], [], {}
    for mname, module in list(model.named_modules()):
        for parts, fused_name in GROUPS:
            mods = [getattr(module, p, None) for p in parts]
            if any(m is None for m in mods):
                continue
            where = f"{mname}.{fused_name}" if mname else fused_name
            why = _fusable(mods)
            if why is None and hasattr(module, fused_name):
                why = f"the module already has an attribute {fused_name!r}"
            if why is not None:
                skipped[where] = why
                continue
            fused = _build(mods)
            ranges, start = [], 0
            for m in mods:
                ranges.append((start, start + m.out_features))
                start += m.out_features
            for m, (a, b) in zip(mods, ranges):
                for t in _TENSORS[type(m)]:
                    mine = getattr(m, t)
                    if mine is not None:
                        mine.data = getattr(fused, t)[a:b]  # a view: the originals cost no memory while fused
            # new modules are built in training mode: they take the parts' mode, or the model would look like it
            # is training (patch then runs the call as stock: arkernels.hf.stock_call.in_training)
            fused.train(mods[0].training)
            setattr(module, fused_name, fused)
            shared = _Shared(fused, len(parts))
            for i, (p, (a, b)) in enumerate(zip(parts, ranges)):
                setattr(module, p, ProjectionSlice(shared, i, a, b, p).train(mods[i].training))
            groups.append(_Fused(module, fused_name, parts, mods, ranges))
            names.append(where)
    handle = FuseHandle(model, groups, names, skipped)
    model.__dict__[_FUSE_ATTR] = handle
    return handle


FUSE_CHOICES = ("auto", True, False)


def _tensor_parallel(model: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def wants_fusion(model: nn.Module, fuse, compiled: bool, op: str) -> bool:
    """Whether ``op`` (``"generate"`` / ``"patch"``) fuses ``model``'s projections: ``fuse`` True always, False never,
    "auto" (the default) where the decode step is compiled or captured (``compiled``) and the model is neither fused
    already (by the caller: left as it is) nor tensor-parallel (which fuse_projections refuses). Anything else is
    refused, naming ``op``."""
    if not (fuse is True or fuse is False or (isinstance(fuse, str) and fuse == "auto")):
        raise ValueError(f"{op}: fuse must be 'auto', True or False, got {fuse!r}")
    if fuse == "auto":
        return compiled and getattr(model, _FUSE_ATTR, None) is None and not _tensor_parallel(model)
    return fuse


@contextlib.contextmanager
def fused_for_call(model: nn.Module, fuse, compiled: bool, op: str = "generate"):
    """The model with its projections fused for one call where :func:`wants_fusion` says so (yields the
    :class:`FuseHandle`, or None), undone on the way out, an exception included: the caller's model is the same
    module and parameter objects afterwards. generate(fuse=True) on a model the caller fused leaves it as it is. A
    compiled step traced on the fused model is reused by the next call's new fused modules (dynamo guards on their
    types and attributes, not their identity: tests/test_fuse.py counts the graphs)."""
    on = wants_fusion(model, fuse, compiled, op) and getattr(model, _FUSE_ATTR, None) is None
    handle = fuse_in_generate(model) if on else None
    try:
        yield handle
    finally:
        if handle is not None:
            with torch.inference_mode(False):
                handle.undo()


def fuse_in_generate(model: nn.Module) -> FuseHandle:
    """:func:`fuse_projections` from inside a ``generate`` call (which runs under inference mode): the fusion runs
    outside it, as must the handle's ``undo``, or the concatenations and undo's copies would be inference tensors
    and the caller's parameters would come back unusable by autograd."""
    with torch.inference_mode(False):
        return fuse_projections(model)
