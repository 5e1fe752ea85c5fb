"""chain_speculative_sampling against the float64 reference (arkernels/reference/spec_sampling.py).

Tokens and accepted counts are exact (the op and the reference draw from the same streams; the reference re-derives
them from their spec); the distribution of the emitted tokens is checked statistically (chi-square against the
target's, for good, bad, identical and one-hot drafts); greedy rows against k+1 non-speculative greedy steps of
``arkernels.sample`` with the token rules counted by ``update_token_state``. "op" is the registered CPU kernel,
"triton" the CUDA kernel's path on CPU tensors (its walk in the Triton interpreter, conftest).
"""
import math

import pytest
import torch
from scipy import stats

import arkernels
from arkernels.ops.spec_sampling import chain_kernel
from arkernels.ops.sampling_cpu import uniform_torch
from arkernels.ops.spec_sampling_cpu import ACCEPT_COL, spec_key_torch
from arkernels.reference.spec_sampling import chain_speculative_sampling_ref, spec_uniform_ref
from arkernels.triton.spec_sampling_launch import spec_walk_triton

IMPLS = ["op", "triton"]
DRAFTS = ["logits", "onehot"]  # a draft model's logits, or prompt lookup's one-hot draft
VOCABS = [111, 5003]  # odd; 5003 spans three of the Triton draw's 2048-column blocks
K = 3  # drafts per row in the exact tests
CHI2_ALPHA = 1e-3  # significance of the goodness-of-fit tests; fixed seeds make them deterministic
# per-row parameters for 8 rows: plain, top-k, top-p, min-p, greedy, all four, hot, greedy
TEMP = [1.0, 0.8, 1.2, 1.0, 0.0, 0.7, 2.0, 0.0]
TOP_K = [0, 20, 0, 0, 0, 30, 0, 5]
TOP_P = [1.0, 1.0, 0.9, 1.0, 1.0, 0.85, 1.0, 1.0]
MIN_P = [0.0, 0.0, 0.0, 0.05, 0.0, 0.02, 0.0, 0.0]
EOS = [3, 7]


def _params(batch):
    return (torch.tensor(TEMP[:batch]), torch.tensor(TOP_K[:batch], dtype=torch.int32), torch.tensor(TOP_P[:batch]),
            torch.tensor(MIN_P[:batch]))


def _logits(shape, seed, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _case(batch, vocab, seed, *, noise=0.7):
    """Target logits, draft logits near them, and drafts drawn from the draft (so most are accepted, not all)."""
    x = _logits((batch, K + 1, vocab), seed)
    d = x[:, :K] + _logits((batch, K, vocab), seed + 1, scale=noise)
    T, k, p, mp = _params(batch)
    ids = torch.stack([arkernels.sample(d[:, j], temperature=torch.where(T > 0, T, 1.0), seed=seed * 100 + j, step=j)
                       for j in range(K)], dim=1)
    return x, d, ids, (T, k, p, mp)


def _run(impl, x, d, ids, params, seed, step, rules=None):
    """(tokens, accepted, valid) through the op ("op") or the CUDA kernel's path with the Triton walk ("triton")."""
    T, k, p, mp = params
    if impl == "op":
        kw = rules or {}
        return arkernels.chain_speculative_sampling(x, ids, d, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed,
                                                    step=step, return_valid=True, **kw)
    ops_rules = (None, None, None, None) if rules is None else _op_rules(x, rules)
    return chain_kernel(spec_walk_triton)(x, d, ids, T, k, p, mp, seed, step, *ops_rules)


def _op_rules(x, kw):
    """The op-level rule tensors of the keyword form (one table row per batch row)."""
    batch, zero = x.shape[0], torch.zeros(x.shape[0], dtype=torch.int64)
    hist = torch.stack([torch.arange(batch), kw.get("new_tokens", zero), kw.get("min_new_tokens", zero)], dim=1)
    if "token_state" not in kw:  # a bias alone
        return None, hist, None, kw["logit_bias"]
    pen = torch.stack([kw["repetition_penalty"], kw["frequency_penalty"], kw["presence_penalty"]], dim=1)
    return kw["token_state"], hist, pen.float(), kw["logit_bias"]


def _ref(x, d, ids, params, seed, step, rules=None):
    T, k, p, mp = params
    return chain_speculative_sampling_ref(x, d, ids, T, k, p, mp, seed, step, rules=rules)


def _assert_same(got, want):
    tokens, accepted, valid = got
    assert tokens.dtype == torch.int64 and accepted.dtype == torch.int64 and valid.dtype == torch.bool
    assert torch.equal(accepted, want[1]), (accepted, want[1])
    assert torch.equal(tokens, want[0]), (tokens, want[0])
    assert torch.equal(valid, want[2])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_chain_speculative_sampling_matches_reference(impl, draft, vocab):
    """8 mixed rows (greedy and sampled, every filter), drafts from the draft model: the same accepted counts,
    tokens (-1 after the drawn one) and valid flags as the fp64 reference, over several steps; both rejection and
    full acceptance (the bonus token) occur."""
    batch = 8 if vocab < 1000 else 5  # row 4: greedy
    x, d, ids, params = _case(batch, vocab, seed=vocab)
    if draft == "onehot":  # prompt lookup proposes tokens the target likes in half the rows
        ids[::2] = x[::2, :K].argmax(dim=2)
    d = d if draft == "logits" else None
    seed = torch.tensor([0, -1, 2**40 + 3, 7, -(2**62), 11, 12, 13][:batch])
    seen = set()
    for s in (0, 5, 2**33 + 1):
        step = torch.full((batch,), s, dtype=torch.int64)
        got = _run(impl, x, d, ids, params, seed, step)
        _assert_same(got, _ref(x, d, ids, params, seed, step))
        seen.update(got[1].tolist())
    assert len(seen) >= 2 and (0 in seen and K in seen if vocab < 1000 and draft == "logits" else True)


RULES_CASES = ["penalties", "bias_only"]


def _rules_case(batch, vocab, seed, which):
    """Prompts, generated tokens and rule values for the token-rules tests: the keyword form (op) and the
    reference's lists. Drafts repeat tokens so the counts inside the chain matter."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (6,), generator=gen).tolist() for _ in range(batch)]
    generated = [torch.randint(0, 20, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen).tolist()
                 for _ in range(batch)]
    bias = [{20: 3.0, 21: -2.5}, {}, {22: 4.0, 1: -math.inf}, {20: 0.5}][:batch]
    if which == "bias_only":
        kw = dict(logit_bias=arkernels.logit_bias_table(bias, vocab))
        return kw, dict(prompts=prompts, generated=generated, logit_bias=bias)
    rules = dict(repetition_penalty=[1.0, 1.3, 0.7, 2.0][:batch], frequency_penalty=[0.0, 0.5, -0.25, 1.5][:batch],
                 presence_penalty=[0.0, 0.3, 1.0, -0.5][:batch],
                 min_new_tokens=[len(g) + 2 for g in generated[:2]] + [0, len(generated[3]) + 1][:batch - 2])
    st = arkernels.token_state(prompts, vocab, banned=[[10], [], [4], []][:batch], eos_token_id=EOS)
    for b, g in enumerate(generated):
        for t in g:
            arkernels.update_token_state(st, torch.tensor([t]), torch.tensor([b]))
    kw = dict(token_state=st, new_tokens=torch.tensor([len(g) for g in generated]),
              min_new_tokens=torch.tensor(rules["min_new_tokens"]), logit_bias=arkernels.logit_bias_table(bias, vocab),
              **{n: torch.tensor(rules[n]) for n in ("repetition_penalty", "frequency_penalty", "presence_penalty")})
    ref = dict(prompts=prompts, generated=generated, logit_bias=bias, banned=[[10], [], [4], []][:batch],
               eos_token_id=EOS, **rules)
    return kw, ref


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", RULES_CASES)
def test_token_rules_inside_the_chain_match_reference(impl, which):
    """Rules on (bias, repetition / frequency / presence, bans, min_new_tokens' EOS mask): position j sees the row's
    history plus drafts 0..j-1 and j more new tokens, as the reference rebuilds it from the lists. Drafts repeat a
    few tokens (and an EOS id) so that counts, presence and the EOS release change inside the chain."""
    batch, vocab = 4, 111
    x = _logits((batch, K + 1, vocab), 61, scale=1.0)
    x[:, :, [3, 7, 20, 21, 22]] += 2.5  # EOS ids and biased tokens are candidates
    d = x[:, :K] + _logits((batch, K, vocab), 62, scale=0.3)
    ids = torch.tensor([[20, 20, 3], [7, 22, 22], [20, 3, 20], [21, 7, 21]])
    params = _params(batch)
    kw, ref_rules = _rules_case(batch, vocab, 63, which)
    for s in range(4):
        seed, step = torch.arange(batch) * 31 + s, torch.full((batch,), s, dtype=torch.int64)
        got = _run(impl, x, d, ids, params, seed, step, rules=kw)
        _assert_same(got, _ref(x, d, ids, params, seed, step, rules=ref_rules))


@pytest.mark.parametrize("impl", IMPLS)
def test_each_position_counts_the_drafts_before_it(impl):
    """Sampled rows, one-hot drafts (accepted with probability p_j(t_j)) of tokens the target all but forces: row 0
    repeats token A under a presence penalty of 20: accepted once, then rejected (its earlier occurrence counted, p
    collapses); row 1, the same without the penalty: all accepted; row 2 proposes EOS at positions 1 and 2 with
    min_new_tokens 1: masked at position 0 only, so accepted (new_tokens grows along the chain); row 3 proposes EOS at
    position 0: rejected, and never emitted there. The fp64 reference agrees token for token."""
    batch, vocab, a, eos = 4, 111, 50, EOS[0]
    x = _logits((batch, K + 1, vocab), 151, scale=0.5)
    x[:2, :, a] = 12.0
    x[2, 0, a], x[2, 1:, eos], x[3, :, eos] = 12.0, 14.0, 14.0
    ids = torch.tensor([[a, a, a], [a, a, a], [a, eos, eos], [eos, a, a]])
    st = arkernels.token_state([[1]] * batch, vocab, eos_token_id=EOS)
    presence = [20.0, 0.0, 0.0, 0.0]
    kw = dict(token_state=st, min_new_tokens=torch.tensor([0, 0, 1, 1]), presence_penalty=torch.tensor(presence),
              new_tokens=torch.zeros(batch, dtype=torch.int64), repetition_penalty=torch.ones(batch),
              frequency_penalty=torch.zeros(batch), logit_bias=None)
    ref_rules = dict(prompts=[[1]] * batch, generated=[[]] * batch, presence_penalty=presence, eos_token_id=EOS,
                     min_new_tokens=[0, 0, 1, 1])
    params = (torch.ones(batch), torch.zeros(batch, dtype=torch.int32), torch.ones(batch), torch.zeros(batch))
    seed, step = torch.arange(batch) + 3, torch.full((batch,), 7)
    got = _run(impl, x, None, ids, params, seed, step, rules=kw)
    assert got[1].tolist() == [1, K, K, 0] and got[0][3, 0] != eos
    _assert_same(got, _ref(x, None, ids, params, seed, step, rules=ref_rules))


def test_history_rows_index_a_shared_table():
    """``history_rows`` into a table with other rows: row 0 reads table row 3 (which bans its drafts: all rejected, the
    same tokens as a one-row table holding it), row 1 is outside the table (no rule: the same tokens as without rules,
    although table row 1 bans its drafts)."""
    batch, vocab = 2, 111
    x, d, ids, params = _case(batch, vocab, seed=161)
    st = arkernels.token_state([[]] * 4, vocab, banned=[[], ids[1].tolist(), [], ids[0].tolist()])
    kw = dict(temperature=params[0][:1], top_k=params[1][:1], seed=torch.tensor([5]), step=3)
    got = arkernels.chain_speculative_sampling(x, ids, d, temperature=params[0], top_k=params[1],
                                               seed=torch.tensor([5, 5]), step=3, token_state=st,
                                               history_rows=torch.tensor([3, -1]))
    alone = arkernels.chain_speculative_sampling(x[:1], ids[:1], d[:1], token_state=st[3:4], **kw)
    plain = arkernels.chain_speculative_sampling(x[1:], ids[1:], d[1:], **dict(kw, temperature=params[0][1:],
                                                                                  top_k=params[1][1:]))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], c[0]) for a, b, c in zip(got, alone, plain))
    assert got[1][0] == 0 and int(got[0][0, 0]) not in ids[0].tolist() and got[1][1] > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_rows_are_k_plus_1_greedy_steps(impl):
    """Temperature 0 with the token rules on: drafts equal to the greedy tokens are all accepted and the bonus is the
    next greedy token; a wrong draft at position m stops the chain there with the greedy token. The greedy steps are
    non-speculative ``arkernels.sample`` calls with ``update_token_state`` after each, so the counts of earlier drafts
    must be in (the logits repeat per position: without the repetition penalty the argmax would repeat)."""
    batch, vocab, k = 3, 111, 4
    row = _logits((batch, 1, vocab), 71)
    x = row.expand(batch, k + 1, vocab).clone()
    x[:, :, 40] = x.max() + 0.1  # a tie with the maximum: the lowest index wins
    x[:, :, 90] = x.max()
    kw, _ = _rules_case(batch + 1, vocab, 72, "penalties")
    kw = {n: (v[:batch] if isinstance(v, torch.Tensor) and n not in ("token_state", "logit_bias") else v)
          for n, v in kw.items()}
    kw["token_state"], kw["logit_bias"] = kw["token_state"][:batch].clone(), kw["logit_bias"][:batch]
    kw["repetition_penalty"] = torch.tensor([1.5, 2.0, 1.2])
    st = kw["token_state"].clone()
    greedy = []
    for j in range(k + 1):
        step_kw = dict(kw, token_state=st, new_tokens=kw["new_tokens"] + j)
        greedy.append(arkernels.sample(x[:, j], temperature=0.0, **step_kw))
        arkernels.update_token_state(st, greedy[-1])
    greedy = torch.stack(greedy, dim=1)
    assert len(set(greedy[0].tolist())) > 1  # the rules did change the argmax along the chain
    params = (torch.zeros(batch), torch.zeros(batch, dtype=torch.int32), torch.ones(batch), torch.zeros(batch))
    seed, step = torch.tensor([1, 2, 3]), torch.zeros(batch, dtype=torch.int64)
    d = _logits((batch, k, vocab), 73)  # ignored by greedy rows
    got = _run(impl, x, d, greedy[:, :k].clone(), params, seed, step, rules=kw)
    assert got[1].tolist() == [k] * batch and torch.equal(got[0], greedy)
    wrong = greedy[:, :k].clone()
    wrong[0, 2] = (wrong[0, 2] + 1) % vocab
    wrong[1, 0] = (wrong[1, 0] + 1) % vocab
    got = _run(impl, x, None, wrong, params, seed, step, rules=kw)
    assert got[1].tolist() == [2, 0, k]
    assert got[0][0].tolist() == greedy[0, :3].tolist() + [-1, -1]
    assert got[0][1].tolist() == [int(greedy[1, 0]), -1, -1, -1, -1] and torch.equal(got[0][2], greedy[2])


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_are_batch_invariant(impl):
    """A row's tokens do not change when the other rows change, move or go: alone, shuffled, or next to new rows."""
    batch, vocab = 6, 111
    x, d, ids, params = _case(batch, vocab, seed=81)
    seed, step = torch.arange(batch) * 7 + 3, torch.tensor([0, 1, 2, 3, 4, 5])
    full = _run(impl, x, d, ids, params, seed, step)
    perm = torch.tensor([3, 0, 5, 2, 1, 4])
    shuffled = _run(impl, x[perm], d[perm], ids[perm], tuple(t[perm] for t in params), seed[perm], step[perm])
    assert all(torch.equal(a, b[perm]) for a, b in zip(shuffled, full))
    for b in (0, 4):
        alone = _run(impl, x[b:b + 1], d[b:b + 1], ids[b:b + 1], tuple(t[b:b + 1] for t in params), seed[b:b + 1],
                     step[b:b + 1])
        assert all(torch.equal(a[0], f[b]) for a, f in zip(alone, full))
    x2, d2 = x.clone(), d.clone()
    x2[1:4], d2[1:4] = _logits((3, K + 1, vocab), 82), _logits((3, K, vocab), 83)
    other = _run(impl, x2, d2, ids, params, seed, step)
    for b in (0, 4, 5):
        assert all(torch.equal(a[b], f[b]) for a, f in zip(other, full))


@pytest.mark.parametrize("impl", IMPLS)
def test_noncontiguous_and_low_precision_inputs(impl):
    """Logits as a padded-vocabulary slice and a permuted buffer, draft ids as a strided view, bf16 logits: the same
    tokens as contiguous fp32 inputs holding the same values."""
    batch, vocab, pad = 4, 111, 9
    x, d, ids, params = _case(batch, vocab, seed=91)
    xb = torch.zeros(batch, K + 1, vocab + pad)
    xb[..., :vocab] = x
    dt = torch.zeros(K, batch, vocab)  # [k, batch, vocab] storage, viewed as [batch, k, vocab]
    dt.copy_(d.transpose(0, 1))
    ib = torch.zeros(batch, 2 * K, dtype=torch.int64)
    ib[:, ::2] = ids
    xs, ds, is_ = xb[..., :vocab], dt.transpose(0, 1), ib[:, ::2]
    assert not (xs.is_contiguous() or ds.is_contiguous() or is_.is_contiguous())
    seed, step = torch.arange(batch) + 5, torch.full((batch,), 2)
    want = _run(impl, x, d, ids, params, seed, step)
    got = _run(impl, xs, ds, is_, params, seed, step)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    xh, dh = x.bfloat16(), d.bfloat16()
    got = _run(impl, xh, dh, ids, params, seed, step)
    assert all(torch.equal(a, b) for a, b in zip(got, _run(impl, xh.float(), dh.float(), ids, params, seed, step)))


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_finite_logits_and_ids_outside_the_vocabulary(impl):
    """A target position with no finite logit stops the chain there: token 0, valid False, -1 after; other rows are
    untouched. At op level (no wrapper check) ids outside [0, vocab) are never accepted, never read."""
    batch, vocab = 4, 37
    x, d, ids, params = _case(batch, vocab, seed=101)
    ids = torch.stack([x[:, j].argmax(dim=1) for j in range(K)], dim=1)  # drafts the target likes
    x[0, 0] = float("-inf")
    x[1, 2] = float("nan")
    ids[2, 1] = -3
    ids[3, 0] = vocab + 7
    T = torch.zeros(batch)  # greedy: every in-vocabulary draft is accepted, so the stops are the tested ones
    p = (T, torch.zeros(batch, dtype=torch.int32), torch.ones(batch), torch.zeros(batch))
    seed, step = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    tokens, accepted, valid = (chain_kernel(spec_walk_triton) if impl == "triton" else
                               torch.ops.arkernels.chain_speculative_sampling)(x, d, ids, *p, seed, step)
    assert accepted.tolist() == [0, 2, 1, 0] and valid.tolist() == [False, False, True, True]
    assert tokens[0].tolist() == [0, -1, -1, -1] and tokens[1].tolist() == ids[1, :2].tolist() + [0, -1]
    assert tokens[2, :2].tolist() == [int(ids[2, 0]), int(x[2, 1].argmax())] and tokens[3, 0] == x[3, 0].argmax()
    want = _ref(x, d, ids, p, seed, step)
    assert torch.equal(tokens, want[0]) and torch.equal(valid, want[2])


def test_random_streams_follow_their_spec():
    """The torch twin of the hash against the reference's Python-integer spec (acceptance column and vocab columns,
    64-bit seeds and steps), and the salt at work: the op's streams differ from ``sample``'s at the same
    (seed, step)."""
    seeds, poss = torch.tensor([0, -1, 2**40 + 3, -(2**62)]), torch.tensor([0, 7, 2**33 + 5, -2])
    key = spec_key_torch(seeds, poss)
    u = uniform_torch(key[:, None], torch.tensor([ACCEPT_COL, 0, 1, 110])[None, :])
    want = [[spec_uniform_ref(int(s), int(p), c) for c in (0xFFFFFFFF, 0, 1, 110)] for s, p in zip(seeds, poss)]
    assert u.double().tolist() == want
    from arkernels.reference.sampling import uniform_ref

    assert all(uniform_ref(int(s), int(p), 0) != w[1] for s, p, w in zip(seeds, poss, want))


DRAFT_KINDS = ["identical", "good", "bad", "onehot_likely", "onehot_unlikely"]


def _pooled(obs, probs):
    """(observed, expected) with bins expected under 5 draws pooled into one (chi-square's validity condition)."""
    exp = probs / probs.sum() * obs.sum()
    small = exp < 5
    obs_b, exp_b = obs[~small], exp[~small]
    if small.any():
        obs_b, exp_b = torch.cat([obs_b, obs[small].sum()[None]]), torch.cat([exp_b, exp[small].sum()[None]])
    return obs_b.numpy(), (exp_b / exp_b.sum() * obs_b.sum()).numpy()


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_emitted_tokens_follow_the_target_chi_square(kind):
    """6000 chains of one row (6000 seeds), drafts drawn from the draft distribution: the first emitted token is
    distributed as the target's p_0, and the pair (first, second) as p_0 x p_1 (the second completed by a
    non-speculative draw from p_1 where the chain stopped after one token), whatever the draft; never a token the
    filters removed. The test has power: the first token rejects the draft's own distribution for a bad draft."""
    n, vocab, k = 6000, 10, 2
    x = _logits((1, k + 1, vocab), 111, scale=1.2)
    T, tk = 0.9, 8
    if kind == "identical":
        d = x[:, :k].clone()
    elif kind == "good":
        d = x[:, :k] + _logits((1, k, vocab), 112, scale=0.4)
    else:
        d = -x[:, :k] * 1.5  # bad: the target's likely tokens become the draft's unlikely ones
    probs = arkernels.sampling_probs(torch.cat([x[0], d[0]]), temperature=T, top_k=tk).double()
    p0, p1, q0 = probs[0], probs[1], probs[k + 1]
    xs, ds = x.expand(n, k + 1, vocab), d.expand(n, k, vocab)
    if kind.startswith("onehot"):
        tok = int(p0.argmax()) if kind == "onehot_likely" else int(torch.argsort(p0)[-tk])  # the least likely kept
        ids, ds = torch.full((n, k), tok, dtype=torch.int64), None
    else:
        ids = torch.stack([arkernels.sample(ds[:, j], temperature=T, top_k=tk, seed=torch.arange(n) + 10**6 * (j + 1),
                                            step=j) for j in range(k)], dim=1)
    tokens, accepted = arkernels.chain_speculative_sampling(xs, ids, ds, temperature=T, top_k=tk,
                                                            seed=torch.arange(n) * 7919, step=3)
    first = tokens[:, 0]
    counts = torch.bincount(first, minlength=vocab).double()
    assert counts[p0 == 0].sum() == 0
    assert stats.chisquare(*_pooled(counts[p0 > 0], p0[p0 > 0])).pvalue > CHI2_ALPHA
    if kind == "bad":
        assert stats.chisquare(*_pooled(counts[q0 > 0], q0[q0 > 0])).pvalue < CHI2_ALPHA
    nxt = arkernels.sample(x[0, 1].expand(n, vocab), temperature=T, top_k=tk, seed=torch.arange(n) + 77, step=4)
    second = torch.where(accepted >= 1, tokens[:, 1], nxt)
    pair = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()
    joint = (p0[:, None] * p1[None, :]).reshape(-1)
    assert pair[joint == 0].sum() == 0
    assert stats.chisquare(*_pooled(pair[joint > 0], joint[joint > 0])).pvalue > CHI2_ALPHA
    assert 0 < float((accepted >= 1).double().mean()) <= 1.0


BAD_ARGS = [
    (dict(x=torch.zeros(2, 10)), r"target_logits must be a \[batch, k\+1, vocab\] tensor"),
    (dict(x=torch.zeros(2, 4, 10, dtype=torch.float64)), "target_logits must be float32, float16 or bfloat16"),
    (dict(ids=torch.zeros(2, 3, dtype=torch.int32)), "draft_ids must be torch.int64"),
    (dict(ids=torch.zeros(2, 2, dtype=torch.int64)), r"draft_ids must be \[batch=2, k=3\]"),
    (dict(ids=torch.tensor([[0, 1, 2], [3, 10, 4]])), r"draft_ids holds token id 10 at \(1, 1\), outside \[0, 10\)"),
    (dict(ids=torch.tensor([[0, -1, 2], [3, 1, 4]])), r"draft_ids holds token id -1"),
    (dict(d=torch.zeros(2, 2, 10)), r"draft_logits must be \[batch=2, k=3, vocab=10\]"),
    (dict(d=torch.zeros(2, 3, 10, dtype=torch.int64)), "draft_logits must be float32"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(step=torch.tensor([0.0, 1.0])), "step must be an int"),
    (dict(repetition_penalty=1.2), "repetition_penalty need token_state"),
    (dict(token_state=torch.zeros(2, 11, dtype=torch.int32)), r"token_state must be \[rows, vocab=10\]"),
    (dict(token_state=torch.zeros(2, 10, dtype=torch.int32), repetition_penalty=0.0), "repetition_penalty must be a number > 0 and finite, got 0.0"),
]


@pytest.mark.parametrize("case", range(len(BAD_ARGS)))
def test_bad_inputs(case):
    kw, match = BAD_ARGS[case]
    kw = dict(kw)
    x, d = kw.pop("x", torch.zeros(2, 4, 10)), kw.pop("d", None)
    ids = kw.pop("ids", torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="chain_speculative_sampling: " + match):
        arkernels.chain_speculative_sampling(x, ids, d, **kw)


def test_op_level_checks():
    ops, x, f = torch.ops.arkernels, torch.zeros(2, 4, 10), torch.ones(2)
    i32, i64 = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"chain_speculative_sampling: draft_ids must be int64 \[batch=2, k=3\]"):
        ops.chain_speculative_sampling(x, None, ids[:, :2], f, i32, f, f, i64, i64)
    with pytest.raises(RuntimeError, match="chain_speculative_sampling: top_k must be torch.int32"):
        ops.chain_speculative_sampling(x, None, ids, f, i64, f, f, i64, i64)
    with pytest.raises(RuntimeError, match=r"chain_speculative_sampling: draft_logits must be \[batch=2, k=3"):
        ops.chain_speculative_sampling(x, torch.zeros(2, 4, 10), ids, f, i32, f, f, i64, i64)
    with pytest.raises(RuntimeError, match="chain_speculative_sampling: history is required"):
        ops.chain_speculative_sampling(x, None, ids, f, i32, f, f, i64, i64, torch.zeros(2, 10, dtype=torch.int32))


def test_opcheck_and_compile():
    assert arkernels.kernels_report()["chain_speculative_sampling"] == ["CPU", "CUDA"]
    batch, vocab = 3, 50
    x, d, ids, (T, k, p, mp) = _case(batch, vocab, seed=121)
    args = (x, d, ids, T, k, p, mp, torch.tensor([1, 2, 3]), torch.tensor([0, 0, 1]))
    torch.library.opcheck(torch.ops.arkernels.chain_speculative_sampling.default, args)
    torch.library.opcheck(torch.ops.arkernels.chain_speculative_sampling.default, (x, None) + args[2:])

    def fn(x, ids, d, seed):
        return arkernels.chain_speculative_sampling(x, ids, d, temperature=0.8, top_k=20, seed=seed, step=2)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, ids, d, torch.arange(batch)), fn(x, ids, d, torch.arange(batch))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_no_drafts_draws_the_bonus_token():
    """k = 0: no draft, the token drawn from p_0 (the same for the CPU and Triton walks, never outside the kept set)."""
    batch, vocab = 5, 111
    x = _logits((batch, 1, vocab), 131)
    ids = torch.zeros(batch, 0, dtype=torch.int64)
    T, k, p, mp = _params(batch)
    args = (x, None, ids, T, k, p, mp, torch.arange(batch), torch.zeros(batch, dtype=torch.int64))
    got = torch.ops.arkernels.chain_speculative_sampling(*args)
    assert got[0].shape == (batch, 1) and got[1].tolist() == [0] * batch and got[2].all()
    assert all(torch.equal(a, b) for a, b in zip(got, chain_kernel(spec_walk_triton)(*args)))
    kept = arkernels.sampling_probs(x[:, 0], temperature=T, top_k=k, top_p=p, min_p=mp) > 0
    assert kept.gather(1, got[0]).all()


@pytest.mark.cuda
def test_cuda_matches_cpu():
    """On a GPU (skipped without one; the interpreter runs the Triton walk in the other tests): the Triton kernels
    (sampling_probs per position, the walk) against the CPU op on the same inputs, rules on."""
    device = "cuda"
    batch, vocab = 4, 32003
    x, d, ids, params = _case(batch, vocab, seed=141)
    kw, _ = _rules_case(batch, vocab, 142, "penalties")
    seed, step = torch.arange(batch) + 1, torch.full((batch,), 9)
    want = _run("op", x, d, ids, params, seed, step, rules=kw)
    dev = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    got = _run("op", dev(x), dev(d), dev(ids), tuple(map(dev, params)), dev(seed), dev(step),
               rules={n: dev(v) for n, v in kw.items()})
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))


_COMPILE = r"""
import inspect, json, os, re, subprocess, sys, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import arkernels.triton.spec_sampling as S
from arkernels.triton.spec_sampling_launch import NUM_WARPS

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TYPES = {"p_ptr": "*fp32", "q_ptr": "*fp32", "draft_ptr": "*i64", "draft_stride": "i32", "temp_ptr": "*fp32",
         "seed_ptr": "*i64", "step_ptr": "*i64", "tokens_ptr": "*i64", "accepted_ptr": "*i64", "valid_ptr": "*i1",
         "K": "i32", "V": "i32"}
out = []
fn = S.spec_sampling_kernel
params = list(inspect.signature(fn.fn).parameters)
for onehot in (False, True):
    c = dict(ONEHOT=onehot, BLOCK=S.BLOCK, KP=8)
    sig = {p: "constexpr" if p in c else TYPES[p] for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if p.endswith("_ptr")}
    k = triton.compile(ASTSource(fn, signature=sig, constexprs=c, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                       options=dict(num_warps=NUM_WARPS))
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(k.asm["ptx"])
        log = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.o")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = [int(v) for v in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()]
    out.append([onehot, regs, spill])
print(json.dumps(out))
"""


def test_triton_walk_compiles_for_sm90():
    """The jit code outside the interpreter: Triton's offline compile for sm_90 (H200) and ptxas, both walk variants
    (draft distribution / one-hot), no register spill (a GPU is not needed)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=900)
    if run.returncode != 0 and "ptxas" in run.stderr and "not found" in run.stderr:
        pytest.skip("no ptxas (Triton's wheel ships one)")
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert [b[0] for b in built] == [False, True] and all(b[2] == [0, 0] for b in built), built  # [ONEHOT, regs, spill]
