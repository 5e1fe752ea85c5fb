"""The token rules patched ``generate`` fuses into its draw (arkernels/hf/sampler_hook.py ``_fused_rules`` /
``_HFRules`` / ``ArkernelsSampler``) against transformers' own processors, built by transformers'
``_get_logits_processor`` for the same generation config and the same left-padded batch:

- processed logits: ``arkernels.sampling_rules`` with the fused rules' arguments (``_HFRules.kwargs``) is bit-exact
  with ``LogitsProcessorList(...)(input_ids, scores)`` (the same fp32 operations), step after step while
  ``input_ids`` grows, across every boundary a rule has (the first real token after the padding,
  ``min_new_tokens`` / ``min_length`` reached); with the warpers (temperature, top-k, top-p, min-p) the distribution
  the fused draw samples (``arkernels.sampling_probs``) keeps exactly stock's kept set, with stock's probabilities
  (fp32 sums in another order: rtol 2e-5), and each draw lies in that set;
- end to end: patched greedy (and top-k 1 sampling, the same argmax through the sampling path) gives stock's tokens
  on a tiny model with each rule made to decide a token, with a control run showing the tokens differ without the
  rule (or with the boundary moved by one), so a rule applied wrongly cannot pass.

The tiny model's logits are O(0.3): a ``sequence_bias`` of a few units makes a token the greedy one, a large
repetition penalty takes it away again.
"""
import pytest
import torch

import arkernels
from arkernels.hf.sampler_hook import ArkernelsSampler
from arkernels.hf.tiny import tiny_model

PAD, EOS = 0, 2  # the tiny models' pad and EOS ids
# a left-padded batch (row 0: 3 pads, row 1: none); every real token occurs once in its row and never in the other,
# so a position wrongly counted or left out changes one token's penalty
IDS = torch.tensor([[PAD, PAD, PAD, 17, 40, 99, 123], [5, 61, 88, 140, 201, 33, 71]])
MASK = (IDS != PAD).long()
FIRST_REAL = 17  # row 0's token at position prompt_ignore_length (= its padding length, 3)
# the tokens the steps append (one column a step): a pad token generated (counted from now on), prompt tokens
# repeated, a banned token, EOS, tokens seen twice
STEPS = torch.tensor([[PAD, 17, 9, 9, 200, 11, PAD, EOS, 50, 51], [71, 5, 250, 3, 3, 12, 88, 9, EOS, 1]]).T
# generate keyword sets, one per rule the patch fuses (and all together)
RULES = {
    "repetition": dict(repetition_penalty=1.7),
    "repetition<1": dict(repetition_penalty=0.6),
    "sequence_bias": dict(sequence_bias={(9,): 3.5, (FIRST_REAL,): -2.0}),
    "bias_then_repetition": dict(sequence_bias={(FIRST_REAL,): 1.5, (30,): -4.0, (9,): 0.75}, repetition_penalty=2.5),
    "bad_words": dict(bad_words_ids=[[11], [12]]),
    "suppress_tokens": dict(suppress_tokens=[13, 14, PAD]),
    "min_length": dict(min_length=10),  # 7 prompt columns: EOS masked at lengths 7, 8, 9, released at 10
    "min_new_tokens<prompt": dict(min_new_tokens=3),  # released at length 10
    "min_new_tokens>prompt": dict(min_new_tokens=9),  # released at length 16 (the 10th step)
    "min_length+min_new_tokens": dict(min_length=12, min_new_tokens=2),  # the longer of the two: length 12
    "all": dict(repetition_penalty=1.3, sequence_bias={(9,): 2.0, (EOS,): 1.0}, bad_words_ids=[[11]],
                suppress_tokens=[13], min_new_tokens=4, min_length=9),
}
WARPERS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all": dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _processors(model, ids=IDS, mask=MASK, logits_processor=None, **gen):
    """transformers' processors for ``gen`` as generate builds them for ``ids`` / ``mask`` (the repetition penalty's
    ``prompt_ignore_length`` is the padding length it reads from the attention mask); under ``arkernels.patch``, the
    patched hook's list."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import LogitsProcessorList

    config = GenerationConfig(**gen, pad_token_id=PAD, eos_token_id=EOS)
    config._eos_token_tensor = torch.tensor([EOS])  # what generate sets before it builds the processors
    return model._get_logits_processor(config, input_ids_seq_length=ids.shape[1], device="cpu",
                                       logits_processor=LogitsProcessorList(logits_processor or []),
                                       model_kwargs={"attention_mask": mask})


def _skip_unless_generate_ignores_padding(model):
    """transformers 5.24 gives generate's repetition penalty ``prompt_ignore_length`` = each row's padding length;
    earlier releases (5.17) count every position, pads included: nothing to compare there."""
    (rep,) = [p for p in _processors(model, repetition_penalty=2.0, do_sample=False)
              if type(p).__name__ == "RepetitionPenaltyLogitsProcessor"]
    if getattr(rep, "prompt_ignore_length", None) is None:
        pytest.skip("this transformers' generate penalises the padding too (no prompt_ignore_length)")


def _fused_sampler(model, **gen) -> ArkernelsSampler:
    """The patched hook's processors for ``gen``: one ArkernelsSampler that carries every rule (nothing stock left)."""
    with arkernels.patch(model, sampler=True):
        procs = _processors(model, **gen)
    assert len(procs) == 1 and type(procs[0]) is ArkernelsSampler and procs[0].rules is not None, procs
    return procs[0]


def _steps(seed=0, scale=3.0):
    """(input_ids, scores) per step: the prompt, then one STEPS column more each step; fp32 scores ~ N(0, scale)."""
    gen = torch.Generator().manual_seed(seed)
    ids = IDS
    for j in range(STEPS.shape[0] + 1):
        yield ids, torch.randn(IDS.shape[0], 256, generator=gen) * scale
        if j < STEPS.shape[0]:
            ids = torch.cat([ids, STEPS[j][:, None]], dim=1)


# ---------------------------------------------------------------------------------------------- processed logits
@pytest.mark.parametrize("case", list(RULES))
def test_fused_rules_processed_logits_equal_transformers(case, llama):
    stock = _processors(llama, **RULES[case], do_sample=False)
    rules = _fused_sampler(llama, **RULES[case], do_sample=False).rules
    changed = 0
    for ids, scores in _steps():
        want = stock(ids, scores.clone())
        got = arkernels.sampling_rules(scores, **rules.kwargs(ids, scores))
        assert torch.equal(got, want), (case, ids.shape[1], (got != want).nonzero()[:4].tolist())
        changed += not torch.equal(want, scores)
    assert changed > 0  # the rule did something on these steps (a test of a rule that never acts cannot fail)


def test_repetition_prompt_ignore_length_is_the_padding(llama):
    """The penalty's ``prompt_ignore_length`` on a left-padded batch is each row's padding length (3, 0): row 0's
    pads are not penalised, its first real token (position 3) is, row 1's first token (position 0) is."""
    _skip_unless_generate_ignores_padding(llama)
    stock = _processors(llama, repetition_penalty=2.0, do_sample=False)
    rep = [p for p in stock if type(p).__name__ == "RepetitionPenaltyLogitsProcessor"]
    assert len(rep) == 1 and torch.equal(torch.as_tensor(rep[0].prompt_ignore_length), torch.tensor([3, 0]))
    rules = _fused_sampler(llama, repetition_penalty=2.0, do_sample=False).rules
    scores = torch.full((2, 256), 1.0)
    got = arkernels.sampling_rules(scores, **rules.kwargs(IDS, scores))
    assert torch.equal(got, stock(IDS, scores.clone()))
    assert got[0, PAD] == 1.0 and got[0, FIRST_REAL] == 0.5 and got[1, IDS[1, 0]] == 0.5 and got[1, PAD] == 1.0


@pytest.mark.parametrize("ignore", [0, 3, 4, 7])
def test_repetition_int_prompt_ignore_length_equals_transformers(ignore, llama):
    """A user's own ``RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=int)`` (it replaces generate's):
    fused, with the same boundary (positions ``>= ignore`` count), step after step."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    custom = dict(logits_processor=[RepetitionPenaltyLogitsProcessor(1.9, prompt_ignore_length=ignore)])
    stock = _processors(llama, do_sample=False, **custom)
    with arkernels.patch(llama, sampler=True):
        (sampler,) = _processors(llama, do_sample=False, logits_processor=[
            RepetitionPenaltyLogitsProcessor(1.9, prompt_ignore_length=ignore)])
    assert type(sampler) is ArkernelsSampler and sampler.rules.ignore == ignore
    for ids, scores in _steps(seed=ignore):
        assert torch.equal(arkernels.sampling_rules(scores, **sampler.rules.kwargs(ids, scores)),
                           stock(ids, scores.clone())), ids.shape[1]


def test_bias_before_repetition_order(llama):
    """transformers applies ``sequence_bias`` before the penalty: ``(x + b) / r``. With b = 1, r = 4 on a token of
    the prompt the two orders differ by far (0.25 + x/4 vs 1 + x/4), no overflow involved; the fused result is
    stock's order, and a bias placed after the penalty (a user's processor) stays stock (not fused)."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    gen = dict(sequence_bias={(FIRST_REAL,): 1.0}, repetition_penalty=4.0, do_sample=False)
    stock = _processors(llama, **gen)
    rules = _fused_sampler(llama, **gen).rules
    scores = torch.zeros(2, 256)
    got = arkernels.sampling_rules(scores, **rules.kwargs(IDS, scores))
    assert torch.equal(got, stock(IDS, scores.clone()))
    assert got[0, FIRST_REAL] == 0.25 and got[1, FIRST_REAL] == 1.0  # row 1: not in its prompt, bias only
    reverse = dict(repetition_penalty=4.0, do_sample=False,
                   logits_processor=[SequenceBiasLogitsProcessor({(FIRST_REAL,): 1.0})])
    stock_rev = _processors(llama, **reverse)
    assert [type(p).__name__ for p in stock_rev] == ["RepetitionPenaltyLogitsProcessor", "SequenceBiasLogitsProcessor"]
    assert stock_rev(IDS, scores.clone())[0, FIRST_REAL] == 1.0  # x / r + b: the other order
    with arkernels.patch(llama, sampler=True):
        patched_rev = _processors(llama, **reverse)
    assert not any(type(p) is ArkernelsSampler for p in patched_rev)  # greedy, bias after the penalty: stock


@pytest.mark.parametrize("warp", list(WARPERS))
def test_fused_rules_with_warpers_equal_transformers(warp, llama):
    """Sampling: the fused draw's distribution (``sampling_probs`` with the sampler's warper values and the rules'
    arguments) against softmax of stock's processors + warpers, every step; each draw lies in stock's kept set."""
    gen = dict(RULES["all"], **WARPERS[warp], do_sample=True)
    stock = _processors(llama, **gen)
    sampler = _fused_sampler(llama, **gen)
    want_params = dict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **WARPERS[warp])
    assert {k: getattr(sampler, k) for k in want_params} == pytest.approx(want_params)
    for ids, scores in _steps(seed=1, scale=1.5):
        want = torch.softmax(stock(ids, scores.clone()), dim=-1)
        kw = sampler.rules.kwargs(ids, scores)
        got = arkernels.sampling_probs(scores, temperature=sampler.temperature, top_k=sampler.top_k,
                                       top_p=sampler.top_p, min_p=sampler.min_p, **kw)
        assert torch.equal(got > 0, want > 0), (warp, ids.shape[1])
        torch.testing.assert_close(got, want, atol=1e-12, rtol=2e-5)
        ids_drawn = arkernels.sample(scores, temperature=sampler.temperature, top_k=sampler.top_k,
                                     top_p=sampler.top_p, min_p=sampler.min_p, seed=ids.shape[1], **kw)
        assert bool((want.gather(1, ids_drawn[:, None]) > 0).all())


# ----------------------------------------------------------------------------------------------------- end to end
def _generate(model, patched, sample_top1=False, **gen):
    """Greedy (or top-k 1 sampling: the argmax through the sampling path) tokens of the padded batch."""
    mode = dict(do_sample=True, top_k=1, temperature=0.7) if sample_top1 else dict(do_sample=False)
    kw = dict(input_ids=IDS, attention_mask=MASK, pad_token_id=PAD, eos_token_id=EOS, **mode, **gen)
    if not patched:
        return model.generate(**kw)[:, IDS.shape[1]:]
    with arkernels.patch(model, sampler=True):
        before = ArkernelsSampler.calls
        out = model.generate(**kw)[:, IDS.shape[1]:]
        fused = ArkernelsSampler.calls - before
    return out, fused


def _check_patched(model, sample_top1, **gen):
    """Patched tokens == stock tokens, drawn by the fused sampler at every step; returns stock's tokens."""
    stock = _generate(model, False, sample_top1, **gen)
    got, fused = _generate(model, True, sample_top1, **gen)
    assert torch.equal(got, stock), (gen, got.tolist(), stock.tolist())
    assert fused == got.shape[1]
    return stock


MODES = [pytest.param(False, id="greedy"), pytest.param(True, id="sample_top1")]


@pytest.mark.parametrize("sample_top1", MODES)
def test_generate_repetition_penalises_first_real_token(sample_top1, llama):
    """Row 0's first real token (position prompt_ignore_length) biased to the top: the penalty must take it away
    (row 1 has no such token in its prompt and picks it); without the penalty row 0 picks it too."""
    gen = dict(sequence_bias={(FIRST_REAL,): 2.0}, max_new_tokens=3)
    stock = _check_patched(llama, sample_top1, repetition_penalty=1000.0, **gen)
    assert stock[0, 0] != FIRST_REAL and stock[1, 0] == FIRST_REAL
    assert _check_patched(llama, sample_top1, **gen)[0, 0] == FIRST_REAL  # control: no penalty


@pytest.mark.parametrize("sample_top1", MODES)
def test_generate_repetition_ignores_the_padding(sample_top1, llama):
    """The pad token biased to the top: row 0's pads lie before prompt_ignore_length, so they are not penalised and
    row 0 picks the pad token; a penalty that counts every position (a user's processor without
    prompt_ignore_length) takes it away."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    _skip_unless_generate_ignores_padding(llama)
    gen = dict(sequence_bias={(PAD,): 2.0}, max_new_tokens=3)
    stock = _check_patched(llama, sample_top1, repetition_penalty=1000.0, **gen)
    assert stock[0, 0] == PAD and stock[1, 0] == PAD
    control = _check_patched(llama, sample_top1, logits_processor=[RepetitionPenaltyLogitsProcessor(1000.0)], **gen)
    assert control[0, 0] != PAD  # the pads counted: penalised


def _min_length_rule(rule, n):
    """generate keywords for one of the EOS-holding rules. generate turns ``min_new_tokens`` into ``min_length =
    prompt + n`` as well (both processors run), so "processor" passes a user's ``MinNewTokensLengthLogitsProcessor``
    alone: there the count after the prompt is the only thing that holds EOS back."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    if rule == "processor":
        return dict(logits_processor=[MinNewTokensLengthLogitsProcessor(IDS.shape[1], n, EOS)])
    return {rule: n}


@pytest.mark.parametrize("sample_top1", MODES)
@pytest.mark.parametrize("rule,n", [("min_new_tokens", 3), ("min_new_tokens", 9), ("processor", 3), ("processor", 9),
                                    ("min_length", 10), ("min_length", 5)])
def test_generate_min_length_rules_hold_back_eos(rule, n, sample_top1, llama):
    """EOS biased to the top: it comes exactly when the rule releases it: after n new tokens (min_new_tokens, counted
    after the 7-column prompt, n below and above the prompt length) or at total length n (min_length; 5 < the
    prompt: no effect); without the rule, at once."""
    gen = dict(sequence_bias={(EOS,): 5.0}, max_new_tokens=12)
    stock = _check_patched(llama, sample_top1, **_min_length_rule(rule, n), **gen)
    new = max(n - IDS.shape[1], 0) if rule == "min_length" else n
    assert not (stock[:, :new] == EOS).any() and bool((stock[:, new] == EOS).all())
    assert bool((_check_patched(llama, sample_top1, **gen)[:, 0] == EOS).all())  # control: no rule


@pytest.mark.parametrize("sample_top1", MODES)
def test_generate_bans_decide_tokens(sample_top1, llama):
    """Three tokens biased to the top (11 > 13 > 14): bad_words_ids bans 11, suppress_tokens 13, so 14 comes first;
    without the bans 11 does."""
    gen = dict(sequence_bias={(11,): 5.0, (13,): 4.0, (14,): 3.0}, max_new_tokens=2)
    stock = _check_patched(llama, sample_top1, bad_words_ids=[[11]], suppress_tokens=[13], **gen)
    assert bool((stock[:, 0] == 14).all())
    assert bool((_check_patched(llama, sample_top1, suppress_tokens=[13], **gen)[:, 0] == 11).all())
    assert bool((_check_patched(llama, sample_top1, bad_words_ids=[[11]], **gen)[:, 0] == 13).all())


@pytest.mark.parametrize("sample_top1", MODES)
def test_generate_bias_before_repetition_decides(sample_top1, llama):
    """Row 0's prompt token biased by +1 with penalty 50: transformers' order (bias, then penalty) gives
    (x + 1) / 50 ~ 0.02, below the model's top logits (~0.3), so another token wins; the reverse order (a user's
    bias processor after the penalty, stock either way) gives x / 50 + 1 and picks it."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    stock = _check_patched(llama, sample_top1, sequence_bias={(FIRST_REAL,): 1.0}, repetition_penalty=50.0,
                           max_new_tokens=2)
    assert stock[0, 0] != FIRST_REAL
    reverse = dict(input_ids=IDS, attention_mask=MASK, pad_token_id=PAD, eos_token_id=EOS, max_new_tokens=2,
                   do_sample=False, repetition_penalty=50.0,
                   logits_processor=[SequenceBiasLogitsProcessor({(FIRST_REAL,): 1.0})])
    rev = llama.generate(**reverse)[:, IDS.shape[1]:]
    assert rev[0, 0] == FIRST_REAL
    with arkernels.patch(llama, sampler=True):
        assert torch.equal(llama.generate(**reverse)[:, IDS.shape[1]:], rev)
