"""Placeholder: being written (HF integration issue)."""


def generate(*a, **k):
    raise NotImplementedError("generate: not built yet")
