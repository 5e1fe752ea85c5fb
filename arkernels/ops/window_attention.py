"""Placeholder: being written (see the issue for this stem)."""


def _todo(*a, **k):
    raise NotImplementedError("window_attention: not built yet")


window_attention = window_attention_dense = _todo
