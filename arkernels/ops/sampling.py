"""Placeholder: being written (see the issue for this stem)."""


def _todo(*a, **k):
    raise NotImplementedError("sampling: not built yet")


sample = sampling_probs = _todo
