"""arkernels.generate(prompt_lookup_num_tokens=k | assistant_model=draft): speculative decoding.

The contract (arkernels/decode/spec.py): the tokens are those of the one-token loop for the same seeds, in greedy,
sampling and with every token rule, on ragged batches, windowed families, forked samples; EOS and max_new_tokens hold
exactly inside an accepted run; rejected drafts leave no block behind; drafts follow transformers' prompt-lookup rule.
Each case also checks that drafts were accepted, so the verification path is exercised, not skipped. A sampling
draft model without token rules uses Leviathan / Chen acceptance instead: the same distribution, not the same tokens.
"""
import random

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

import arkernels
from arkernels.decode.drafts import propose_ngram
from arkernels.hf.tiny import FAMILIES, tiny_model

# repetitive prompts: prompt lookup finds drafts in them; ragged; longer than the tiny models' window (5)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3], [20, 21, 22, 23, 24, 25, 20, 21], [7]]
NEW_TOKENS = 24
K = 4


def _pair(model, prompts=PROMPTS, **kw):
    kw = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4) | kw
    return arkernels.generate(model, prompts, **kw), arkernels.generate(model, prompts, prompt_lookup_num_tokens=K,
                                                                         **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_lookup_greedy_is_the_one_token_loop(family):
    model = tiny_model(family)
    plain, spec = _pair(model)
    assert spec.tokens == plain.tokens
    assert sum(spec.accepted_tokens) > 0  # verification accepted drafts: the multi-token path ran
    assert all(0 <= a <= p for a, p in zip(spec.accepted_tokens, spec.proposed_tokens))
    assert all(v == 0 for v in spec.cache_blocks_in_use.values())  # rejected drafts' blocks went back too
    assert spec.decode_tokens == plain.decode_tokens


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("rules", [{}, dict(repetition_penalty=1.02, min_new_tokens=6, frequency_penalty=0.01,
                                            presence_penalty=0.01, logit_bias={9: 0.5}, suppress_tokens=[11])])
def test_lookup_sampling_is_the_one_token_loop(family, rules):
    """A low temperature makes the draws repeat the prompt often enough that drafts are accepted; the tokens are the
    same seeded draws as without speculation, the rules seeing the drafts before each position in the history."""
    model = tiny_model(family)
    plain, spec = _pair(model, temperature=0.05, top_k=20, top_p=0.95, seed=[3, 1, 4, 1], **rules)
    assert spec.tokens == plain.tokens
    assert sum(spec.accepted_tokens) > 0


def test_lookup_rules_see_the_accepted_drafts():
    """A biased token repeats until its frequency penalty lets another one win: the run's length is decided by the
    count of the drafts before each position (a verifier that counted only the last draft, or none, keeps drafts the
    one-token loop does not emit: this case diverged at token 12 of row 1 with that bug)."""
    model = tiny_model("gemma3_text")
    plain, spec = _pair(model, logit_bias={9: 0.5}, frequency_penalty=0.01)
    assert spec.tokens == plain.tokens
    assert sum(spec.accepted_tokens) > 0


def test_lookup_forked_samples_and_streaming():
    model = tiny_model("qwen3")
    seen = []
    kw = dict(num_return_sequences=2, temperature=0.05, seed=[7, 8, 9, 10])
    plain, spec = _pair(model, **kw, stream=lambda r, t: seen.append((r, t)))
    assert spec.tokens == plain.tokens
    stream_spec = seen[len(seen) // 2:]
    assert [[t for r2, t in stream_spec if r2 == r] for r in range(len(spec.tokens))] == spec.tokens


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 13])
def test_lookup_max_new_tokens_exact(max_new):
    model = tiny_model("llama")
    plain, spec = _pair(model, max_new_tokens=max_new)
    assert spec.tokens == plain.tokens
    assert all(len(t) == max_new for t in spec.tokens)


def test_lookup_eos_inside_an_accepted_run():
    """Every token an accepted run emitted, used as the EOS id in turn: each row stops at its first occurrence,
    exactly as the one-token loop does."""
    model = tiny_model("llama")
    _, spec = _pair(model)
    row = max(range(len(PROMPTS)), key=lambda r: spec.accepted_tokens[r])
    for eos in sorted(set(spec.tokens[row][1:8])):
        plain, got = _pair(model, eos_token_id=eos)
        assert got.tokens == plain.tokens
        assert got.finished_by_eos == plain.finished_by_eos
        assert got.finished_by_eos[row]


def test_lookup_logprobs_equal_the_one_token_loop():
    model = tiny_model("llama")
    plain, spec = _pair(model, logprobs=3)
    assert spec.tokens == plain.tokens
    for a_row, b_row in zip(plain.logprobs, spec.logprobs):
        assert len(a_row) == len(b_row)
        for a, b in zip(a_row, b_row):
            assert (a.token, a.rank, [t for t, _, _ in a.top]) == (b.token, b.rank, [t for t, _, _ in b.top])
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_lookup_batch_invariance():
    model = tiny_model("mistral")
    kw = dict(temperature=0.05, seed=[3, 1, 4, 1])
    _, batch = _pair(model, **kw)
    for r, p in enumerate(PROMPTS):
        _, alone = _pair(model, [p], **(kw | dict(seed=kw["seed"][r])))
        assert alone.tokens[0] == batch.tokens[r]


def _transformers_candidates(history, k, n, eos):
    gen = PromptLookupCandidateGenerator(eos_token_id=torch.tensor(sorted(eos)) if eos else None,
                                         num_output_tokens=k, max_matching_ngram_size=n, max_length=10_000)
    out, _ = gen.get_candidates(torch.tensor([history]))
    return out[0, len(history):].tolist()


def test_propose_is_transformers_prompt_lookup():
    rng = random.Random(0)
    for _ in range(300):
        L = rng.randint(1, 24)
        history = [rng.randint(0, 5) for _ in range(L)]  # a small alphabet: many n-gram matches
        k, n = rng.randint(1, 6), rng.randint(1, 4)
        eos = set(rng.sample(range(6), rng.randint(0, 2)))
        assert propose_ngram(history, k, n, eos) == _transformers_candidates(history, k, n, eos), (history, k, n, eos)


@pytest.mark.parametrize("kw, says", [
    (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens must be None or an int >= 1"),
    (dict(prompt_lookup_num_tokens=2.0), "prompt_lookup_num_tokens must be None or an int >= 1"),
    (dict(prompt_lookup_num_tokens=True), "prompt_lookup_num_tokens must be None or an int >= 1"),
    (dict(prompt_lookup_num_tokens=2, max_matching_ngram_size=0), "max_matching_ngram_size must be None or an int"),
    (dict(max_matching_ngram_size=2), "max_matching_ngram_size goes with prompt_lookup_num_tokens"),
    (dict(prompt_lookup_num_tokens=2, cuda_graphs=True, logprobs=1), "logprobs= runs on the eager decode path"),
])
def test_lookup_bad_arguments(kw, says):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=says):
        arkernels.generate(model, PROMPTS, max_new_tokens=4, **kw)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("draft_kind", ["itself", "other-seed"])
def test_draft_model_is_the_one_token_loop(family, draft_kind):
    """A draft model (the target itself: every draft kept; another random model: most rejected) changes how many
    forwards run, never the tokens, greedy and sampled; its cache gives every block back."""
    model = tiny_model(family)
    draft = model if draft_kind == "itself" else tiny_model(family, seed=1)
    for kw in (dict(), dict(temperature=0.05, seed=[3, 1, 4, 1], repetition_penalty=1.02)):
        plain, spec = _pair(model, **kw)
        got = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4,
                                 assistant_model=draft, num_assistant_tokens=3, **kw)
        assert got.tokens == plain.tokens
        assert all(0 <= a <= p for a, p in zip(got.accepted_tokens, got.proposed_tokens))
        if draft_kind == "itself" and not kw:
            assert got.accepted_tokens == got.proposed_tokens  # greedy draft == greedy target: nothing rejected
        assert sum(got.proposed_tokens) > 0
    assert draft.config._attn_implementation == "sdpa"  # the draft's attention restored


def test_draft_model_refusals():
    model = tiny_model("llama")
    other_vocab = tiny_model("llama", vocab_size=300)
    with pytest.raises(ValueError, match=r"assistant_model's vocabulary \(300\) is not the model's"):
        arkernels.generate(model, PROMPTS, max_new_tokens=2, assistant_model=other_vocab)
    with pytest.raises(ValueError, match="num_assistant_tokens goes with assistant_model"):
        arkernels.generate(model, PROMPTS, max_new_tokens=2, num_assistant_tokens=3)
    with pytest.raises(ValueError, match="num_assistant_tokens must be None or an int >= 1"):
        arkernels.generate(model, PROMPTS, max_new_tokens=2, assistant_model=model, num_assistant_tokens=0)
    with pytest.raises(ValueError, match="pass assistant_model or prompt_lookup_num_tokens, not both"):
        arkernels.generate(model, PROMPTS, max_new_tokens=2, assistant_model=model, prompt_lookup_num_tokens=2)


def _sharp(seed: int, negate: bool = False):
    """A tiny Llama over 16 tokens whose head is scaled up (logits spread over a few units, so a wrong acceptance
    rule shows in the token counts); ``negate``: the head's sign flipped (a draft that prefers the target's unlikely
    tokens)."""
    from arkernels.models import tiny_llama

    model = tiny_llama(seed, vocab_size=16)
    model.lm_head.weight.data.mul_(-12.0 if negate else 12.0)
    return model


@pytest.mark.parametrize("draft_kind", ["itself", "other-seed", "anti"])
def test_sampled_draft_model_emits_the_target_distribution(draft_kind):
    """Sampling without token rules: drafts drawn from the draft model and kept by Leviathan / Chen acceptance
    (chain_speculative_sampling). 1500 rows (one seed each) of the same prompt: the tokens at indices 1 and 2 (the
    first ones a speculative step emits) have the one-token loop's distribution (two-sample chi-square), whatever the
    draft; the test has power: the anti draft's own draws are rejected by the same test."""
    from scipy import stats

    n, prompt = 1500, [[5, 6, 7, 8, 9, 5, 6]]
    target = _sharp(0)
    draft = {"itself": target, "other-seed": _sharp(1), "anti": _sharp(0, negate=True)}[draft_kind]
    kw = dict(max_new_tokens=3, eos_token_id=[], temperature=0.8, seed=list(range(n)))
    plain = arkernels.generate(target, prompt * n, **kw)
    spec = arkernels.generate(target, prompt * n, assistant_model=draft, num_assistant_tokens=2, **kw)

    def counts(result, j):
        return torch.bincount(torch.tensor([t[j] for t in result.tokens]), minlength=16)

    def same(a, b):
        keep = (a + b) > 0
        return stats.chi2_contingency(torch.stack([a[keep], b[keep]]).numpy()).pvalue > 1e-3

    for j in (1, 2):
        assert same(counts(plain, j), counts(spec, j)), j
    accepted, proposed = sum(spec.accepted_tokens), sum(spec.proposed_tokens)
    assert proposed > 0 and 0 < accepted <= proposed
    if draft_kind == "itself":
        assert accepted == proposed  # p == q: min(1, p / q) = 1
    if draft_kind == "anti":
        assert accepted < proposed // 2
        own = arkernels.generate(draft, prompt * n, **kw)
        assert not same(counts(plain, 1), counts(own, 1))


def test_sampled_draft_model_with_rules_keeps_the_one_token_tokens():
    """Token rules (or logprobs) in a sampling call: greedy drafts kept while they equal the one-token loop's draws
    (drafts.speculative_sampling), so the tokens are the one-token loop's for the same seeds."""
    target, draft = _sharp(0), _sharp(1)
    for kw in (dict(repetition_penalty=1.3), dict(logprobs=2)):
        kw |= dict(max_new_tokens=12, eos_token_id=[], temperature=0.8, seed=[1, 2, 3])
        prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 4, 3, 4, 3], [9]]
        plain = arkernels.generate(target, prompts, **kw)
        spec = arkernels.generate(target, prompts, assistant_model=draft, num_assistant_tokens=3, **kw)
        assert spec.tokens == plain.tokens and sum(spec.proposed_tokens) > 0


# ---- cuda_graphs=True / compile=True: the static verification step (arkernels/decode/spec_step.py) ----------------
RULES = dict(temperature=0.05, seed=[3, 1, 4, 1], repetition_penalty=1.02, min_new_tokens=6, frequency_penalty=0.01,
             presence_penalty=0.01, logit_bias={9: 0.5}, suppress_tokens=[11])


@pytest.mark.parametrize("family", FAMILIES)
def test_static_lookup_is_the_one_token_loop(family):
    """k + 1 positions per row in one fixed-shape step, the rows padded to batch-size buckets as rows finish: the
    one-token loop's tokens, greedy, seeded sampling and sampling with every token rule (the drafts before each
    position in its history); drafts accepted; a row's padded positions never counted as accepted drafts; every
    block back."""
    model = tiny_model(family)
    for kw in (dict(), dict(temperature=0.05, top_k=20, top_p=0.95, seed=[3, 1, 4, 1]), RULES):
        plain, _ = _pair(model, **kw)
        got = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4,
                                 prompt_lookup_num_tokens=K, cuda_graphs=True, **kw)
        assert got.tokens == plain.tokens
        assert sum(got.accepted_tokens) > 0
        assert all(0 <= a <= p for a, p in zip(got.accepted_tokens, got.proposed_tokens))
        assert all(v == 0 for v in got.cache_blocks_in_use.values())


@pytest.mark.parametrize("max_new", [1, 2, 5, 13])
def test_static_lookup_max_new_tokens_and_eos_exact(max_new):
    """Rows near max_new_tokens propose fewer than k drafts (padded positions); an EOS inside an accepted run ends its
    row there; the batch shrinks through smaller buckets."""
    model = tiny_model("llama")
    kw = dict(max_new_tokens=max_new, block_size=4)
    free = arkernels.generate(model, PROMPTS, eos_token_id=[], **kw)
    eos = [free.tokens[0][max_new // 2]] if max_new > 2 else []
    plain = arkernels.generate(model, PROMPTS, eos_token_id=eos, **kw)
    got = arkernels.generate(model, PROMPTS, eos_token_id=eos, prompt_lookup_num_tokens=K, cuda_graphs=True, **kw)
    assert got.tokens == plain.tokens and got.finished_by_eos == plain.finished_by_eos


def test_static_lookup_rules_see_the_accepted_drafts():
    """test_lookup_rules_see_the_accepted_drafts on the static step: the drafts before each position counted in its
    history inside the step."""
    model = tiny_model("gemma3_text")
    kw = dict(logit_bias={9: 0.5}, frequency_penalty=0.01)
    plain, _ = _pair(model, **kw)
    got = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4,
                             prompt_lookup_num_tokens=K, cuda_graphs=True, **kw)
    assert got.tokens == plain.tokens
    assert sum(got.accepted_tokens) > 0


def test_static_draft_model():
    """A draft model with the static verification step: greedy (the target itself: every draft kept; another model)
    gives the one-token loop's tokens; sampled drafts (Leviathan / Chen on the step's logits) give the eager
    speculative loop's tokens for the same seeds."""
    model, other = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    kw = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4, num_assistant_tokens=3)
    plain, _ = _pair(model)
    for draft in (model, other):
        got = arkernels.generate(model, PROMPTS, assistant_model=draft, cuda_graphs=True, **kw)
        assert got.tokens == plain.tokens
        if draft is model:
            assert got.accepted_tokens == got.proposed_tokens
    sampled = dict(kw, temperature=0.7, seed=[1, 2, 3, 4])
    eager = arkernels.generate(model, PROMPTS, assistant_model=other, **sampled)
    got = arkernels.generate(model, PROMPTS, assistant_model=other, cuda_graphs=True, **sampled)
    assert got.tokens == eager.tokens and got.accepted_tokens == eager.accepted_tokens


@pytest.mark.parametrize("family,rules", [("llama", {}), ("qwen3", RULES)], ids=["greedy", "rules"])
def test_static_lookup_compiled_one_graph_per_bucket(monkeypatch, family, rules):
    """compile=True: the same tokens as the one-token loop, one dynamo graph per batch-size bucket used (none per step,
    no graph break), greedy and sampling with every token rule."""
    from torch._dynamo.utils import counters

    from arkernels.decode import spec_step

    buckets = set()
    verify = spec_step.SpecStep.verify

    def counted(self, rows, *args):
        buckets.add(spec_step.bucket(len(rows), self.batch))
        return verify(self, rows, *args)

    monkeypatch.setattr(spec_step.SpecStep, "verify", counted)
    model = tiny_model(family)
    kw = dict(max_new_tokens=NEW_TOKENS, block_size=4, eos_token_id=[], **rules)
    plain = arkernels.generate(model, PROMPTS, **kw)
    eos = [plain.tokens[1][6]]  # row 1 ends early: a smaller bucket
    plain = arkernels.generate(model, PROMPTS, **dict(kw, eos_token_id=eos))
    torch._dynamo.reset()
    counters.clear()
    try:
        got = arkernels.generate(model, PROMPTS, prompt_lookup_num_tokens=K, compile=True, **dict(kw, eos_token_id=eos))
        assert got.tokens == plain.tokens and sum(got.accepted_tokens) > 0
        assert len(buckets) >= 2
        assert counters["stats"]["unique_graphs"] == len(buckets)
        assert not counters["graph_break"]
        assert model.config._attn_implementation == "sdpa"
    finally:
        torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_static_lookup_cuda_graphs(compile):
    # the static verification step captured per bucket on a GPU (the multi-query decode kernel, q = k + 1 = 5 rows
    # per sequence): the eager speculative loop's tokens. Not run yet (no GPU here)
    model = tiny_model("gemma3_text", dtype=torch.bfloat16, head_dim=64).cuda()
    kw = dict(max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=16, prompt_lookup_num_tokens=K)
    ref = arkernels.generate(model, PROMPTS, **kw)
    torch._dynamo.reset()
    try:
        got = arkernels.generate(model, PROMPTS, cuda_graphs=not compile, compile=compile, **kw)
    finally:
        torch._dynamo.reset()
    assert got.tokens == ref.tokens and sum(got.accepted_tokens) > 0
