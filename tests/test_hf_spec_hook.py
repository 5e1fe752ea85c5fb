"""arkernels.hf.spec_hook: a patched model's assisted sampling accepts the draft's tokens with
``chain_speculative_sampling``; everything else keeps transformers' ``_speculative_sampling``."""
import inspect

import pytest
import torch
import transformers.generation.utils as gen_utils
from scipy import stats

import arkernels
from arkernels.hf import spec_hook
from arkernels.models import tiny_llama

CHI2_ALPHA = 1e-3
# transformers <= 5.17 passes is_done_candidate (required positional) after new_logits; 5.24 has no such argument
DONE = (False,) if "is_done_candidate" in inspect.signature(gen_utils._speculative_sampling).parameters else ()
IDS = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])


class _Cpu:
    device = torch.device("cpu")


def _serve(fn, sampler=True, stock=False):
    """Run ``fn`` as a patched model's generate call would (the hook's mark set around it)."""
    return spec_hook.wrap_generate(_Cpu(), fn, {"stock": stock}, sampler)()


def test_patched_assisted_sampling_runs_the_op_and_undo_restores_transformers():
    import transformers.generation.utils as gen

    original = gen._speculative_sampling
    target, draft = tiny_llama(0), tiny_llama(1, num_hidden_layers=1)
    other = tiny_llama(2)
    kw = dict(attention_mask=torch.ones_like(IDS), assistant_model=draft, do_sample=True, max_new_tokens=12,
              eos_token_id=None, pad_token_id=0)
    with arkernels.patch(target, sampler=True):
        handle = arkernels.patch(other, sampler=True)
        assert gen._speculative_sampling is spec_hook.fused_speculative_sampling
        before = spec_hook.fused_calls[0]
        torch.manual_seed(0)
        out = target.generate(IDS, **kw)
        assert spec_hook.fused_calls[0] > before
        assert out.shape[1] == IDS.shape[1] + 12 and bool(((out >= 0) & (out < 256)).all())
        handle.undo()  # the other model's undo leaves the module attribute to the one still patched
        assert gen._speculative_sampling is spec_hook.fused_speculative_sampling
    assert gen._speculative_sampling is original
    with arkernels.patch(target):  # sampler "auto" on the CPU: transformers' function serves the call
        before = spec_hook.fused_calls[0]
        target.generate(IDS, **kw)
        assert spec_hook.fused_calls[0] == before


def _chain(k=2, vocab=10, bad=False):
    gen = torch.Generator().manual_seed(5)
    new = torch.randn(1, k + 1, vocab, generator=gen) * 1.3
    new[0, :, 7] = -float("inf")  # a token transformers' filters removed
    cand = -new[:, :k].nan_to_num(neginf=3.0) * 1.5 if bad else new[:, :k] + 0.4 * torch.randn(1, k, vocab, generator=gen)
    return new, cand


@pytest.fixture
def held():
    spec_hook.hold()
    yield
    spec_hook.release()


@pytest.mark.parametrize("bad", [False, True])
def test_fused_acceptance_emits_the_target_distribution(bad, held):
    """2000 verifications, drafts drawn from the draft's softmax: the first emitted token follows the target's
    softmax (chi-square), never the removed token; for a bad draft the test rejects the draft's own distribution."""
    n, k, vocab = 2000, 2, 10
    new, cand = _chain(k, vocab, bad)
    q = cand.softmax(-1)[0]
    draws = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(9)).T  # [n, k]

    def run():
        firsts, accepted = [], 0
        for i in range(n):
            ids = torch.cat([IDS, draws[i][None]], dim=1)
            valid, m = spec_hook.fused_speculative_sampling(ids, cand, k, new, *DONE)
            firsts.append(int(valid[0, 0]))
            accepted += int(m)
        return firsts, accepted

    torch.manual_seed(1)
    before = spec_hook.fused_calls[0]
    firsts, accepted = _serve(run)
    assert spec_hook.fused_calls[0] == before + n
    counts = torch.bincount(torch.tensor(firsts), minlength=vocab).double()
    p0 = new[0, 0].softmax(-1).double()
    assert counts[7] == 0
    keep = p0 > 0
    assert stats.chisquare(counts[keep].numpy(), (p0[keep] * n).numpy()).pvalue > CHI2_ALPHA
    if bad:
        q0 = q[0].double()
        assert stats.chisquare(counts[keep].numpy(), (q0[keep] / q0[keep].sum() * n).numpy()).pvalue < CHI2_ALPHA
    assert 0 < accepted < n * k


def test_unmarked_calls_and_unknown_arguments_keep_transformers_function(monkeypatch):
    """Outside a patched call, in a call served as stock, or with an argument the op does not implement
    (``assistant_ensemble_weight``), transformers' own function runs."""
    import transformers.generation.utils as gen

    seen = []
    new, cand = _chain()
    ids = torch.cat([IDS, torch.tensor([[1, 2]])], dim=1)

    def stock(candidate_input_ids, candidate_logits, candidate_length, new_logits, is_done_candidate=False,
              assistant_ensemble_weight=None):
        seen.append(assistant_ensemble_weight)
        return new_logits[:, :1].argmax(-1), torch.tensor(0)

    monkeypatch.setattr(gen, "_speculative_sampling", stock)
    spec_hook.hold()
    try:
        before = spec_hook.fused_calls[0]
        spec_hook.fused_speculative_sampling(ids, cand, 2, new, *DONE)  # no patched call in flight
        _serve(lambda: spec_hook.fused_speculative_sampling(ids, cand, 2, new, *DONE), stock=True)
        _serve(lambda: spec_hook.fused_speculative_sampling(ids, cand, 2, new, *DONE,
                                                            assistant_ensemble_weight=0.5))
        _serve(lambda: spec_hook.fused_speculative_sampling(ids, cand, 2, new, *DONE), sampler="auto")  # CPU: stock
        assert seen == [None, None, 0.5, None] and spec_hook.fused_calls[0] == before
        _serve(lambda: spec_hook.fused_speculative_sampling(ids, cand, 2, new, *DONE))
        assert spec_hook.fused_calls[0] == before + 1 and len(seen) == 4
    finally:
        spec_hook.release()
    assert gen._speculative_sampling is stock
