"""fp8 KV caches (vLLM's convention): stored = saturate_e4m3(x / scale), a K and a V scale per layer.

The scales come from the caller (one float, or one per layer) or are calibrated on a prefill (``calibrate_kv_scale``).
"""
from __future__ import annotations

import torch

# fp8 KV cache (vLLM's convention): stored = saturate_e4m3(x / scale). A calibrated scale maps the prompt's absmax to
# K_RANGE (keys) / V_RANGE (values) rather than to e4m3's largest value 448: vLLM's calculate_kv_scales defaults
# (K_SCALE_CONSTANT=200, V_SCALE_CONSTANT=100), which leave 2.2x / 4.5x headroom for decode tokens larger than any in
# the prompt before they saturate; e4m3's relative precision is the same across its normal range, so the headroom
# costs only the smallest values (below 2^-6 * scale they become subnormal). Floored so that an all-zero layer does
# not divide by 0.
FP8_MAX = 448.0
K_RANGE = 200.0
V_RANGE = 100.0
MIN_KV_SCALE = 1e-6


def calibrate_kv_scale(x: torch.Tensor, target: float = FP8_MAX) -> torch.Tensor:
    """fp32 ``[1]`` on ``x``'s device: ``max(absmax(x) / target, 1e-6)``, computed there (no host sync)."""
    return (x.detach().abs().amax().float() / target).clamp(min=MIN_KV_SCALE).reshape(1)


def kv_cache_dtype_of(owner: str, kv_cache_dtype) -> torch.dtype | None:
    """"auto" / None -> None (the model's dtype); "fp8" / "fp8_e4m3" / torch.float8_e4m3fn -> float8_e4m3fn."""
    if kv_cache_dtype in (None, "auto"):
        return None
    if kv_cache_dtype in ("fp8", "fp8_e4m3", torch.float8_e4m3fn):
        return torch.float8_e4m3fn
    raise ValueError(f"{owner}: kv_cache_dtype must be 'auto' or 'fp8' (float8_e4m3fn), got {kv_cache_dtype!r}")


def per_layer_scales(owner: str, name: str, scale, num_layers: int, dtype: torch.dtype | None) -> list:
    """A float, one float per layer, or None (calibrate) -> a list of ``num_layers`` floats or Nones."""
    if scale is None:
        return [None] * num_layers
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"{owner}: {name} is only taken with an fp8 KV cache (kv_cache_dtype='fp8')")
    values = [float(scale)] * num_layers if isinstance(scale, (int, float)) else [float(x) for x in scale]
    if len(values) != num_layers:
        raise ValueError(f"{owner}: {name} must be a float or one float per layer ({num_layers}), got {len(values)}")
    bad = [v for v in values if not (v > 0 and v < float("inf"))]
    if bad:
        raise ValueError(f"{owner}: {name} must be positive and finite, got {bad[0]}")
    return values
