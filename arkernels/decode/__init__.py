"""arkernels' own decode loop (``arkernels.generate``): ``inputs`` checks every argument and makes a plan, ``step`` is
the one-token decode step (eager, static, CUDA graphs), ``loop`` runs prefill and decode, ``spec`` the speculative
decode steps (prompt lookup), ``emit`` what a step does with its logits (draw, take), ``result`` what generate
returns."""
from arkernels.decode.loop import generate
from arkernels.decode.result import GenerateResult, TokenLogprobs

__all__ = ["GenerateResult", "TokenLogprobs", "generate"]
