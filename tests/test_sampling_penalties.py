"""Token rules in the fused sampler (logit bias, repetition / frequency / presence penalties, bans, min_new_tokens)
against transformers' own logits processors on the same logits (processed logits equal, kept sets exact), against
vLLM's documented frequency / presence rule (arkernels.reference.token_rules_ref, written from the rule), and the
Triton kernels (interpreter, conftest) against the CPU kernel token for token."""
import math
import pathlib
import re

import pytest
import torch
from scipy import stats

import arkernels
from arkernels import token_state_layout as layout
from arkernels.ops.sampling import rule_tensors
from arkernels.reference.sampling import sampling_probs_ref, token_rules_ref
from arkernels.token_state_layout import COUNT_MAX
from arkernels.triton import sampling as triton_sampling
from arkernels.triton.sampling_launch import sample_triton, sampling_probs_triton, sampling_rules_triton

BINDINGS = pathlib.Path(__file__).parent.parent / "csrc" / "torch_bindings.cpp"

VOCABS = [111, 5003]  # odd sizes; 5003 spans several 1024-wide chunks and programs per row
IMPLS = ["op", "triton"]
EOS = [3, 7]


def _case(batch, vocab, seed, scale=3.0):
    """Logits, ragged prompts and generated tokens, per-row rule values and the resulting token_state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=gen) * scale
    x[:, 5] = 0.0  # a zero logit in every row's history: repetition must keep it 0 (no sign case)
    prompts = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
               + [5] for _ in range(batch)]
    # repeats from a narrow range (counts > 1) and a few ids anywhere in the vocabulary (every block of a row)
    generated = [torch.randint(0, min(vocab, 40), (int(torch.randint(0, 25, (1,), generator=gen)),),
                               generator=gen).tolist() + torch.randint(0, vocab, (3,), generator=gen).tolist()
                 for _ in range(batch)]
    generated[0] = []  # a row with no new token yet: min_new_tokens masks its EOS
    rules = dict(
        repetition_penalty=[1.0, 1.3, 0.7, 2.0][:batch],
        frequency_penalty=[0.0, 0.5, -0.25, 1.5][:batch],
        presence_penalty=[0.0, 0.3, 1.0, -0.5][:batch],
        min_new_tokens=[2, 0, 100, 1][:batch],
    )
    banned = [[10, 11], [], [4], [10, 12, 13]][:batch]
    bias = [{20: 5.0, 21: -3.5}, {}, {22: 100.0, 1: -math.inf}, {20: 0.25}][:batch]
    st = arkernels.token_state(prompts, vocab, banned=banned, eos_token_id=EOS)
    for b, g in enumerate(generated):
        for t in g:
            arkernels.update_token_state(st, torch.tensor([t]), torch.tensor([b]))
    kw = dict(token_state=st, new_tokens=torch.tensor([len(g) for g in generated]),
              min_new_tokens=torch.tensor(rules["min_new_tokens"]),
              repetition_penalty=torch.tensor(rules["repetition_penalty"]),
              frequency_penalty=torch.tensor(rules["frequency_penalty"]),
              presence_penalty=torch.tensor(rules["presence_penalty"]),
              logit_bias=arkernels.logit_bias_table(bias, vocab))
    ref = token_rules_ref(x, prompts, generated, logit_bias=bias, banned=banned, eos_token_id=EOS, **rules)
    return x, prompts, generated, rules, banned, bias, kw, ref


def _op_args(x, kw):
    """The op-level tensors of the keyword form (what the Triton launchers take)."""
    return rule_tensors("test", x, kw["token_state"], kw.get("history_rows"), kw.get("new_tokens", 0),
                  kw.get("min_new_tokens", 0), kw.get("repetition_penalty", 1.0), kw.get("frequency_penalty", 0.0),
                  kw.get("presence_penalty", 0.0), kw.get("logit_bias"))


def _rules_impl(impl, x, kw):
    if impl == "triton":
        return sampling_rules_triton(x, *_op_args(x, kw))
    return arkernels.sampling_rules(x, **kw)


def _hf_processed(x, prompts, generated, rules, banned, bias, b):
    """Row ``b`` through transformers' own processors, in its order (bias, repetition, bad words, min new tokens), on fp32 scores as generate hands them."""
    from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                        NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                                                        SequenceBiasLogitsProcessor, SuppressTokensLogitsProcessor)

    ids = torch.tensor([prompts[b] + generated[b]])
    procs = LogitsProcessorList()
    if bias[b]:
        procs.append(SequenceBiasLogitsProcessor({(t,): v for t, v in bias[b].items()}))
    if rules["repetition_penalty"][b] != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(float(rules["repetition_penalty"][b])))
    bad = [[t] for t in banned[b] if t not in EOS]
    if bad:
        procs.append(NoBadWordsLogitsProcessor(bad, EOS))
    if rules["min_new_tokens"][b] > 0:
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompts[b]), rules["min_new_tokens"][b], EOS))
    return procs(ids, x[b:b + 1].clone())[0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", VOCABS)
def test_processed_logits_equal_transformers_and_reference(impl, vocab):
    x, prompts, generated, rules, banned, bias, kw, ref = _case(4, vocab, seed=vocab)
    got = _rules_impl(impl, x, kw)
    assert torch.equal(got, ref)  # every rule, frequency / presence included (vLLM's rule, in the reference)
    for b in range(4):
        if rules["frequency_penalty"][b] or rules["presence_penalty"][b]:
            continue  # not transformers processors: the reference alone checks them
        assert torch.equal(got[b], _hf_processed(x, prompts, generated, rules, banned, bias, b)), b
    # the row whose rules include frequency / presence: transformers' processors first, then vLLM's two lines
    b = 1
    hf = _hf_processed(x, prompts, generated, dict(rules, frequency_penalty=[0] * 4), banned, bias, b)
    counts = torch.bincount(torch.tensor(generated[b], dtype=torch.int64), minlength=vocab).float()
    vllm = hf - torch.tensor(rules["frequency_penalty"][b]) * counts
    vllm = vllm - torch.tensor(rules["presence_penalty"][b]) * (counts > 0).float()
    assert torch.equal(got[b], vllm)


@pytest.mark.parametrize("impl", IMPLS)
def test_suppress_tokens_and_min_new_tokens_release(impl):
    """suppress_tokens are bans; EOS is masked while new_tokens < min_new_tokens (row 0: 4 < 5) and comes back once
    the row reaches it (row 1: 5)."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, SuppressTokensLogitsProcessor

    x = torch.randn(2, 111, generator=torch.Generator().manual_seed(3))
    st = arkernels.token_state([[1], [2]], 111, banned=[8, 9, 50], eos_token_id=EOS)
    got = _rules_impl(impl, x, dict(token_state=st, new_tokens=torch.tensor([4, 5]), min_new_tokens=5))
    suppressed = SuppressTokensLogitsProcessor([8, 9, 50])(None, x.clone())
    masked = MinNewTokensLengthLogitsProcessor(1, 5, EOS)(torch.zeros(1, 5, dtype=torch.long), suppressed[:1])
    assert torch.equal(got[0], masked[0]) and torch.equal(got[1], suppressed[1])
    assert torch.isneginf(got[0, EOS]).all() and torch.isfinite(got[1, EOS]).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", VOCABS)  # 5003: several 2048-wide blocks per row in sampling_probs' loops
def test_kept_sets_exact_with_rules(impl, vocab):
    x, prompts, generated, rules, banned, bias, kw, ref = _case(4, vocab, seed=9)
    # row 1 keeps every token (its penalties reach every block of the row), row 0 top-p, row 3 top-k + top-p + min-p
    T = torch.tensor([1.0, 0.8, 0.0, 1.2])
    k = torch.tensor([0, 0, 0, 30], dtype=torch.int32)
    p = torch.tensor([0.9, 1.0, 1.0, 0.75])
    mp = torch.tensor([0.0, 0.0, 0.0, 0.05])
    want = sampling_probs_ref(ref, T, k, p, mp)
    if impl == "triton":
        got = sampling_probs_triton(x, T, k, p, mp, *_op_args(x, kw))
    else:
        got = arkernels.sampling_probs(x, temperature=T, top_k=k, top_p=p, min_p=mp, **kw)
    assert torch.equal(got > 0, want > 0)
    # fp32 softmax vs fp64: relative error of exp(z) in fp32 is ~|z| * 2**-24 (< 3e-6 here); relative, not
    # absolute, so a wrong penalty on a rare token (p ~ 1e-7) still shows
    torch.testing.assert_close(got.double(), want, atol=1e-12, rtol=2e-5)


def test_triton_draws_the_cpu_tokens_fast_path_and_fallback():
    """Same token from the CPU op, the Triton fast path and the full-row fallback (cap 1 forces it), rules on."""
    x, *_, kw, ref = _case(4, 5003, seed=4)
    args = _op_args(x, kw)
    T = torch.tensor([1.0, 0.7, 0.0, 1.5])
    k = torch.tensor([0, 20, 0, 0], dtype=torch.int32)
    p = torch.tensor([0.95, 1.0, 1.0, 1.0])
    mp = torch.tensor([0.0, 0.0, 0.0, 0.02])
    for step in range(3):
        seed, st = torch.arange(4) * 7 + 1, torch.full((4,), step)
        want = arkernels.sample(x, temperature=T, top_k=k, top_p=p, min_p=mp, seed=seed, step=st, **kw)
        fast, _, (ncand, _) = sample_triton(x, T, k, p, mp, seed, st, *args, debug=True)
        slow, _, (ncand1, _) = sample_triton(x, T, k, p, mp, seed, st, *args, cap=1, debug=True)
        assert torch.equal(fast, want) and torch.equal(slow, want)
        assert (ncand[[0, 1, 3]] > 0).all() and (ncand1[[0, 1, 3]] < 0).all()  # both paths really ran
    assert want[2] == ref[2].argmax()  # greedy row: argmax of the processed logits


def test_draws_follow_processed_distribution_chi_square():
    """Row 1 of the case (repetition, frequency and presence penalties, bias-free) drawn 4000 times with distinct
    seeds, every draw reading table row 1: the frequencies follow the reference's processed distribution."""
    x, *_, kw, ref = _case(4, 111, seed=5, scale=1.0)
    one = {n: (v[1].item() if isinstance(v, torch.Tensor) and v.dim() == 1 else v) for n, v in kw.items()}
    q = sampling_probs_ref(ref[1:2], [0.9], [0], [1.0], [0.0])[0]
    n = 4000
    ids = arkernels.sample(x[1:2].expand(n, -1), temperature=0.9, seed=torch.arange(n),
                           history_rows=torch.ones(n, dtype=torch.int64), **one)
    obs = torch.bincount(ids, minlength=111).double()
    assert obs[q == 0].sum() == 0  # nothing outside the kept set (banned, masked EOS)
    exp = q * n
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    assert stats.chisquare(o, e).pvalue > 1e-3


def test_update_token_state_counts_saturates_and_skips_padding():
    st = arkernels.token_state([[1, 2], [3]], 10, banned=[9], eos_token_id=0)
    before = st.clone()
    arkernels.update_token_state(st, torch.tensor([2, -1]))  # row 1's id is padding
    arkernels.update_token_state(st, torch.tensor([5, 10]), torch.tensor([0, 1]))  # 10 is outside the vocab
    arkernels.update_token_state(st, torch.tensor([4]), torch.tensor([7]))  # row 7 does not exist
    want = before.clone()
    want[0, 2] += 1
    want[0, 5] += 1
    assert torch.equal(st, want)
    st[1, 4] |= COUNT_MAX  # a full count stays full, the flag bits untouched
    flags = st[1, 4] & ~COUNT_MAX
    arkernels.update_token_state(st, torch.tensor([4]), torch.tensor([1]))
    assert int(st[1, 4] & COUNT_MAX) == COUNT_MAX and int(st[1, 4] & ~COUNT_MAX) == int(flags)
    forked = st[torch.tensor([0, 0, 1])]  # beams / num_return_sequences: fork by indexing
    assert torch.equal(forked[1], st[0])


def test_token_state_layout_is_one_contract():
    """arkernels/token_state_layout.py is the one definition: the Triton kernels' constexprs are its values, and the
    two places that state the bits in words (the schema comment in csrc/torch_bindings.cpp, ``token_state``'s
    docstring) state its bits."""
    flags = [layout.PROMPT_BIT, layout.BAN_BIT, layout.EOS_BIT]
    assert layout.COUNT_MASK == layout.COUNT_MAX == (1 << layout.COUNT_BITS) - 1
    assert layout.SEEN_MASK == layout.COUNT_MASK | layout.PROMPT_BIT
    assert all(f & layout.COUNT_MASK == 0 for f in flags) and len(set(flags)) == 3
    assert max(flags) < 2**31  # an int32 word: no flag in the sign bit
    for name in ("COUNT_MASK", "SEEN_MASK", "BAN_BIT", "EOS_BIT"):
        assert getattr(triton_sampling, name).value == getattr(layout, name), name
    want = (layout.COUNT_BITS - 1, *(f.bit_length() - 1 for f in flags))
    texts = {"csrc/torch_bindings.cpp": BINDINGS.read_text().replace("//", " "),
             "token_state": arkernels.token_state.__doc__}
    for where, text in texts.items():
        words = re.search(r"bits 0-(\d+) the count[^,]*, bit (\d+)[^,]*prompt, bit (\d+) banned, bit (\d+) an EOS id",
                          " ".join(text.split()))
        assert words is not None and tuple(map(int, words.groups())) == want, where


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_rules_and_out_of_range_history(impl):
    """history_rows outside the table (or a row with neutral values) apply nothing: the logits pass unchanged."""
    x, *_, kw, _ = _case(4, 111, seed=6)
    kw = dict(kw, history_rows=torch.tensor([-1, 4, 1000, 1]))
    got = _rules_impl(impl, x, kw)
    plain = arkernels.sampling_rules(x)
    assert torch.equal(got[:3], plain[:3]) and not torch.equal(got[3], plain[3])
    # logits rows sharing a table row (and the same per-row values) see the same rules
    kw2 = {n: (v[1].item() if isinstance(v, torch.Tensor) and v.dim() == 1 else v) for n, v in kw.items()}
    kw2["history_rows"] = torch.tensor([1, 1, 1, 1])
    got2 = _rules_impl(impl, x[[1, 1, 1, 1]], kw2)
    assert torch.equal(got2[0], got2[3])


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_inf_rows_with_rules(impl):
    x = torch.randn(3, 111)
    x[0] = float("nan")
    x[1, 4] = float("inf")
    x[2, :] = float("-inf")
    x[2, 6] = 1.0
    st = arkernels.token_state([[4], [4], [6]], 111, banned=[6])
    kw = dict(token_state=st, repetition_penalty=2.0, logit_bias=arkernels.logit_bias_table([{}, {4: 1e38}, {}], 111))
    got = _rules_impl(impl, x, kw)
    assert torch.isneginf(got[0]).all() and not torch.isnan(got).any()
    # +inf -> the largest float; + 1e38 overflows to inf (as in transformers' fp32 scores), stays inf through the
    # penalty, and is clamped once more at the end
    assert got[1, 4] == torch.finfo(torch.float32).max
    ids, valid = arkernels.sample(x, temperature=1.0, seed=1, return_valid=True, **kw)
    assert valid.tolist() == [False, True, False] and ids[1] == 4 and ids[0] == 0 and ids[2] == 0


BAD = [
    (dict(repetition_penalty=1.2), "repetition_penalty need token_state"),
    (dict(token_state="st", repetition_penalty=0.0), "repetition_penalty must be a number > 0"),
    (dict(token_state="st", frequency_penalty=float("nan")), "frequency_penalty must be a number finite"),
    (dict(token_state="st", repetition_penalty=torch.tensor([1.0, -1.0])), r"repetition_penalty must be > 0"),
    (dict(token_state="st", min_new_tokens=-1), "min_new_tokens must be >= 0"),
    (dict(token_state=torch.zeros(2, 10, dtype=torch.int64)), "token_state must be torch.int32"),
    (dict(token_state=torch.zeros(2, 9, dtype=torch.int32)), r"token_state must be \[rows, vocab=10\]"),
    (dict(token_state=torch.zeros(3, 10, dtype=torch.int32)), "without history_rows the tables need one row"),
    (dict(token_state="st", history_rows=torch.tensor([0.0, 1.0])), "history_rows must be an integer tensor"),
    (dict(token_state="st", logit_bias=torch.zeros(3, 10)), "same rows"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_rules_bad_inputs(case):
    kw, match = BAD[case]
    kw = {n: (arkernels.token_state([[1], [2]], 10) if isinstance(v, str) else v) for n, v in kw.items()}
    with pytest.raises(ValueError, match="sample: .*" + match):
        arkernels.sample(torch.zeros(2, 10), **kw)
    with pytest.raises(ValueError, match=r"token_state: prompt holds token id 10, outside \[0, 10\)"):
        arkernels.token_state([[10]], 10)
    with pytest.raises(ValueError, match=r"logit_bias_table: row 0: bias of token 1 must be finite or -inf"):
        arkernels.logit_bias_table([{1: math.inf}], 10)


def test_rules_op_level_checks_and_opcheck():
    ops, x = torch.ops.arkernels, torch.zeros(2, 10)
    st = torch.zeros(2, 10, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="sampling_rules: history is required with token_state"):
        ops.sampling_rules(x, st, None, None, None)
    with pytest.raises(RuntimeError, match=r"sampling_rules: history must be \[batch=2, 3\]"):
        ops.sampling_rules(x, st, torch.zeros(2, 2, dtype=torch.int64), None, None)
    x, *_, kw, _ = _case(4, 111, seed=7)
    a = _op_args(x, kw)
    torch.library.opcheck(torch.ops.arkernels.sampling_rules.default, (x, *a))
    T, k = torch.tensor([1.0, 0.0, 0.5, 1.0]), torch.tensor([0, 4, 10, 0], dtype=torch.int32)
    p, mp = torch.tensor([0.9, 1.0, 0.8, 1.0]), torch.zeros(4)
    torch.library.opcheck(torch.ops.arkernels.sampling_probs.default, (x, T, k, p, mp, *a))
    torch.library.opcheck(torch.ops.arkernels.sample.default, (x, T, k, p, mp, torch.arange(4), torch.zeros(4, dtype=torch.int64), *a))


def test_rules_compile_fullgraph():
    x, *_, kw, _ = _case(4, 111, seed=8)

    def step_fn(logits, seed, step):
        ids = arkernels.sample(logits, temperature=0.7, top_k=20, seed=seed, step=step, **kw)
        arkernels.update_token_state(kw["token_state"], ids)
        return ids

    st0 = kw["token_state"].clone()
    compiled = torch.compile(step_fn, fullgraph=True, backend="aot_eager")
    got = compiled(x, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    st1 = kw["token_state"].clone()
    kw["token_state"].copy_(st0)
    want = step_fn(x, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(got, want) and torch.equal(st1, kw["token_state"])


# ---------------------------------------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------------------------------------
def test_top_logprobs_exact_ids_ranks_and_ties():
    from arkernels.ops.sampling import raw_logprobs, top_logprobs

    x = torch.round(torch.randn(3, 111, generator=torch.Generator().manual_seed(2)) * 2) / 2  # many ties
    x[1] = float("nan")  # no finite logit: all -inf, never NaN
    x[2, 17] = float("inf")
    lp = raw_logprobs(x)
    want = torch.log_softmax(torch.where(torch.isnan(x), float("-inf"), x).clamp(max=3.4028234663852886e38), -1)
    assert torch.equal(lp[[0, 2]], want[[0, 2]]) and torch.isneginf(lp[1]).all()
    ids = torch.tensor([5, 0, 17])
    chosen, rank, top_ids, top_lp = top_logprobs(lp, ids, 6)
    assert torch.equal(chosen, lp[torch.arange(3), ids])
    for b in range(3):
        # the documented order: logprob descending, equal logprobs by lowest id first (a stable sort of the ids)
        order = sorted(range(111), key=lambda i: (-float(lp[b, i]), i))[:6]
        assert top_ids[b].tolist() == order and torch.equal(top_lp[b], lp[b, order])
        assert int(rank[b]) == int((lp[b] >= lp[b, ids[b]]).sum())  # vLLM's rank: ties count against the token
    assert rank[2] == 1 and rank[1] == 111


def test_generate_logprobs_raw_and_processed():
    from arkernels.hf.tiny import tiny_model

    model = tiny_model("llama")
    prompts = [[1, 5, 9], [2, 7, 7, 3]]
    kw = dict(max_new_tokens=4, temperature=0.8, top_k=12, seed=[1, 2], eos_token_id=None, repetition_penalty=1.3)
    raw = arkernels.generate(model, prompts, logprobs=3, **kw)
    proc = arkernels.generate(model, prompts, logprobs=3, logprobs_mode="processed", **kw)
    plain = arkernels.generate(model, prompts, **kw)
    assert raw.tokens == proc.tokens == plain.tokens  # logprobs never change the draw
    # recompute the first token's logits with stock (prefill of the prompt) and compare
    for b, p in enumerate(prompts):
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[:, -1].float()
        first = raw.logprobs[b][0]
        assert first.token == raw.tokens[b][0] and len(first.top) == 3
        lp = torch.log_softmax(logits, -1)[0]
        assert abs(first.logprob - float(lp[first.token])) < 1e-5
        assert [t for t, _, _ in first.top] == torch.topk(lp, 3).indices.tolist()
        st = arkernels.token_state([p], logits.shape[1])
        q = arkernels.sampling_probs(logits, temperature=0.8, top_k=12, token_state=st, repetition_penalty=1.3)[0]
        pf = proc.logprobs[b][0]
        assert abs(pf.logprob - math.log(float(q[pf.token]))) < 1e-5
        assert sum(1 for _, v, _ in pf.top if v > -math.inf) == min(3, int((q > 0).sum()))
    with pytest.raises(ValueError, match="generate: logprobs must be None or an int >= 0"):
        arkernels.generate(model, prompts, logprobs=-1)
    with pytest.raises(ValueError, match="generate: logprobs_mode must be 'raw' or 'processed'"):
        arkernels.generate(model, prompts, logprobs=1, logprobs_mode="raw_logits")


# ---------------------------------------------------------------------------------------------------------
# arkernels.generate and patched model.generate with the rules
# ---------------------------------------------------------------------------------------------------------
IDS = torch.tensor([[0, 0, 5, 9, 5, 11], [1, 2, 7, 7, 3, 7]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
RULE_CASES = {
    "repetition": dict(repetition_penalty=1.5),
    "repetition<1": dict(repetition_penalty=0.7),
    "bans": dict(bad_words_ids=[[140]], suppress_tokens=[192], min_new_tokens=3),
    "all": dict(repetition_penalty=1.2, min_new_tokens=4, bad_words_ids=[[140], [101]], suppress_tokens=[192],
                sequence_bias={(3,): 2.5, (50,): -1.0}),
}


@pytest.fixture(scope="module")
def llama():
    from arkernels.hf.tiny import tiny_model

    return tiny_model("llama")


@pytest.mark.parametrize("case", list(RULE_CASES))
def test_patched_greedy_with_rules_gives_stock_tokens_and_fuses(case, llama):
    from arkernels.hf.sampler_hook import ArkernelsSampler

    cfg = dict(RULE_CASES[case], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=101)
    stock = llama.generate(input_ids=IDS, attention_mask=MASK, **cfg)
    with arkernels.patch(llama, sampler=True):
        before = ArkernelsSampler.calls
        got = llama.generate(input_ids=IDS, attention_mask=MASK, **cfg)
        ran = ArkernelsSampler.calls - before
    assert torch.equal(got, stock)
    assert ran == got.shape[1] - IDS.shape[1]  # the fused draw made every token (no stock processor ran)
    if case == "all":
        assert not (got[:, IDS.shape[1]:IDS.shape[1] + 4] == 101).any()  # min_new_tokens: no EOS before 4 tokens


def test_patched_sampling_with_rules_matches_processed_distribution(llama):
    """Sampled: the fused draw keeps transformers' kept set on the processed logits of the prompt, and over many
    seeded one-token calls its frequencies follow that distribution (chi-square)."""
    from transformers import GenerationConfig

    from arkernels.hf.sampler_hook import ArkernelsSampler

    cfg = dict(do_sample=True, temperature=0.9, top_k=30, repetition_penalty=1.4, bad_words_ids=[[7]],
               pad_token_id=0, eos_token_id=None)
    ids = IDS[1:]
    with torch.no_grad():
        logits = llama(ids).logits[:, -1].float()
    config = GenerationConfig(**cfg)
    config._eos_token_tensor = None  # what generate sets before it builds the processors
    stock = llama._get_logits_processor(config, input_ids_seq_length=ids.shape[1], device="cpu")
    q = torch.softmax(stock(ids, logits.clone()), -1)[0].double()
    n = 300
    with arkernels.patch(llama, sampler=True):
        before = ArkernelsSampler.calls
        torch.manual_seed(0)
        draws = [int(llama.generate(input_ids=ids, max_new_tokens=1, **cfg)[0, -1]) for _ in range(n)]
        assert ArkernelsSampler.calls - before == n
    obs = torch.bincount(torch.tensor(draws), minlength=q.numel()).double()
    assert obs[q == 0].sum() == 0  # banned token 7 and everything top-k drops: never drawn
    exp = q * n
    big = exp >= 5
    small = ~big & (exp > 0)  # pooled into one bin (when any)
    o, e = obs[big], exp[big]
    if small.any():
        o, e = torch.cat([o, obs[small].sum()[None]]), torch.cat([e, exp[small].sum()[None]])
    assert stats.chisquare(o, e * (o.sum() / e.sum())).pvalue > 1e-3


def test_patched_unfusable_rules_stay_stock(llama):
    from transformers import GenerationConfig

    from arkernels.hf.sampler_hook import ArkernelsSampler

    config = GenerationConfig(do_sample=False, bad_words_ids=[[5, 6]])
    config._eos_token_tensor = None
    with arkernels.patch(llama, sampler=True):
        multi = llama._get_logits_processor(config, input_ids_seq_length=3, device="cpu")
        ngram = llama._get_logits_processor(GenerationConfig(do_sample=True, top_k=5, repetition_penalty=1.2,
                                                             no_repeat_ngram_size=2), input_ids_seq_length=3,
                                            device="cpu")
    assert not any(isinstance(p, ArkernelsSampler) for p in multi)  # greedy with a multi-token bad word: stock
    assert type(ngram[-1]) is ArkernelsSampler and ngram[-1].rules is None  # stock processors, then our draw
    assert any(type(p).__name__ == "RepetitionPenaltyLogitsProcessor" for p in ngram)


def test_generate_greedy_with_rules_matches_stock(llama):
    for case in ("repetition", "all"):
        cfg = dict(RULE_CASES[case])
        sb = cfg.pop("sequence_bias", None)
        for b in range(2):
            p = IDS[b][MASK[b].bool()].tolist()
            stock = llama.generate(input_ids=torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                   eos_token_id=101, sequence_bias=sb, **cfg)[0, len(p):].tolist()
            got = arkernels.generate(llama, [p], max_new_tokens=8, eos_token_id=101,
                                     logit_bias={k[0]: v for k, v in (sb or {}).items()}, **cfg).tokens[0]
            assert got == stock, (case, b)


def test_generate_rules_static_step_and_forks(llama):
    """cuda_graphs=True (the padded static step, eager on the CPU) draws the eager path's tokens with the rules, and
    num_return_sequences forks each prompt's history (sample 0 = the single-sequence call)."""
    kw = dict(max_new_tokens=6, temperature=0.9, top_k=20, seed=[4, 5], eos_token_id=None, frequency_penalty=0.7,
              presence_penalty=0.3, repetition_penalty=1.1, logit_bias=[{3: 3.0}, {}], min_new_tokens=[2, 0])
    prompts = [[1, 5, 9, 5], [2, 7]]
    eager = arkernels.generate(llama, prompts, num_return_sequences=2, **kw)
    static = arkernels.generate(llama, prompts, num_return_sequences=2, cuda_graphs=True, **kw)
    single = arkernels.generate(llama, prompts, **kw)
    assert eager.tokens == static.tokens
    assert [eager.tokens[0], eager.tokens[2]] == single.tokens
    with pytest.raises(ValueError, match="generate: bad_words_ids takes single tokens only"):
        arkernels.generate(llama, prompts, bad_words_ids=[[1, 2]])
    with pytest.raises(ValueError, match="generate: repetition_penalty must be > 0"):
        arkernels.generate(llama, prompts, repetition_penalty=0.0)
    with pytest.raises(ValueError, match=r"generate: min_new_tokens must be an int or one per prompt \(2\)"):
        arkernels.generate(llama, prompts, min_new_tokens=[1, 2, 3])


# ---------------------------------------------------------------------------------------------------------
# Triton's offline sm_90 compile (no GPU needed): the interpreter accepts code the compiler refuses (a variable
# rebound to another shape inside a loop), so every sampling kernel, rules on and off, every tile height R, is
# compiled here too, with the launchers' options (LAUNCH) and the runtime's 16-byte divisibility specialisation
# of pointers and row strides (what a GPU launch compiles); ptxas -v (Triton's own flags) must report no spill
# ---------------------------------------------------------------------------------------------------------
_COMPILE = r"""
import inspect, json, os, re, subprocess, sys, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import arkernels.triton.sampling as S
import arkernels.triton.sampling_select as SEL

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
INT_PTRS = {"topk_ptr": "*i32", "carg_ptr": "*i32", "hist_ptr": "*i32", "rhist_ptr": "*i32", "passes_ptr": "*i32",
            "state_ptr": "*i32", "hrow_ptr": "*i64", "seed_ptr": "*i64", "step_ptr": "*i64", "cidx_ptr": "*i32",
            "ncand_ptr": "*i32", "rcol_ptr": "*i32", "ids_ptr": "*i64", "valid_ptr": "*i1", "logits_ptr": "*bf16",
            "ticket_ptr": "*i64", "cut_ptr": "*i32", "off_ptr": "*i32"}
search = dict(SEARCH_BLOCK=S.SEARCH_BLOCK, P=S.PIVOTS, MAX_PASSES=S.MAX_PASSES)
# sample's two kernels as an H200 runs them: programmatic dependent launch on (PDL, launch_pdl)
jobs = [(S.sampling_stats_kernel, dict(BLOCK=S.STATS_BLOCK, R=r, NCP=128, SP=S.MAX_SPLITS, DEBUG=False, PDL=True))
        for r in (1, 2, S.TILE_CHUNKS)]
jobs += [(S.sampling_compact_kernel, dict(BLOCK=S.STATS_BLOCK, R=r, DRAW_BLOCK=S.DRAW_BLOCK, NCP=128, SP=S.MAX_SPLITS,
                                          DEBUG=False, KMAX=SEL.KMAX, DT=SEL.DRAW_TILE, PDL=True, **search))
         for r in (1, 2, S.TILE_CHUNKS)]
jobs += [(S.sampling_probs_kernel, dict(BLOCK=S.DRAW_BLOCK, **search)),
         (S.sampling_rules_kernel, dict(BLOCK=S.DRAW_BLOCK))]
out = []
for fn, consts in jobs:
    params = list(inspect.signature(fn.fn).parameters)
    for state, bias in (((False, False), (True, False), (True, True)) if "STATE" in params else ((None, None),)):
        c = dict(consts, STATE=state, BIAS=bias) if state is not None else dict(consts)
        sig = {p: "constexpr" if p in c else INT_PTRS.get(p, "*fp32") if p.endswith("_ptr")
               else "i64" if p.startswith("stride") else "i32" for p in params}
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
                 if p not in c and (p.endswith("_ptr") or p.startswith("stride"))}
        k = triton.compile(ASTSource(fn, signature=sig, constexprs=c, attrs=attrs), target=GPUTarget("cuda", 90, 128),
                           options=dict(S.LAUNCH[fn.__name__], **({"launch_pdl": True} if c.get("PDL") else {})))
        with tempfile.TemporaryDirectory() as d:
            src = os.path.join(d, "k.ptx")
            open(src, "w").write(k.asm["ptx"])
            log = subprocess.run([PTXAS, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o",
                                  os.path.join(d, "k.o")], capture_output=True, text=True, check=True).stderr
        regs = int(re.search(r"Used (\d+) registers", log).group(1))
        spill = [int(v) for v in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()]
        ptx = k.asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        loads = [i for i in (body.find("ld.global"), body.find("atom.global"), body.find("red.global")) if i >= 0]
        out.append([fn.__name__, c.get("R"), state, bias, len(k.asm["cubin"]), regs, spill, ptx.count("bar.sync"),
                    ptx.count("atom.global.gpu.acq_rel.add.u64"), ptx.count("atom.global.gpu.relaxed.add.u32"),
                    body.find("griddepcontrol.wait"), min(loads) if loads else -1])
print(json.dumps(out))
"""


def test_triton_kernels_compile_for_sm90():
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
    assert len(built) == 3 * 3 + 3 * 3 + 2 * 3 and all(b[4] > 0 for b in built)
    spilled = [b for b in built if b[6] != [0, 0]]
    assert not spilled, spilled  # [kernel, R, STATE, BIAS, cubin bytes, registers, spill stores/loads, bar.sync, ...]
    # sample's two kernels each take one ticket per program (the row's last one goes on); the stats kernel adds its
    # histogram into the row's with global atomics (no merge kernel)
    two = [b for b in built if b[0] in ("sampling_stats_kernel", "sampling_compact_kernel")]
    assert len(two) == 18 and all(b[8] == 1 for b in two), two
    assert all(b[9] > 0 for b in two if b[0] == "sampling_stats_kernel"), two
    # programmatic dependent launch: the grid dependency wait comes before the first global access
    assert all(0 <= b[10] < b[11] for b in two), [b[:4] + b[10:] for b in two]
    assert all(b[10] == -1 for b in built if b not in two)


def test_patched_num_return_sequences_draw_distinct_samples(llama):
    """Each returned sequence has its own stream (row r: seed + r * stride); row 0 is the one-sequence call."""
    cfg = dict(max_new_tokens=6, do_sample=True, temperature=1.5, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([[1, 5, 9]])
    with arkernels.patch(llama, sampler=True):
        torch.manual_seed(0)
        many = llama.generate(input_ids=ids, num_return_sequences=3, **cfg)
        torch.manual_seed(0)
        one = llama.generate(input_ids=ids, **cfg)
    assert len({tuple(r) for r in many[:, 3:].tolist()}) == 3  # 256 tokens at T 1.5: equal rows = a shared stream
    assert torch.equal(many[0], one[0])
