"""arkernels' own decode loop (``arkernels.generate``): ``inputs`` checks every argument and makes a plan, ``step`` is
the one-token decode step (eager, static, CUDA graphs), ``loop`` runs prefill and decode."""
from arkernels.decode.loop import GenerateResult, TokenLogprobs, generate

__all__ = ["GenerateResult", "TokenLogprobs", "generate"]
