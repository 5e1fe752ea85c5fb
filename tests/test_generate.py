"""arkernels.generate: ragged prompts equal stock greedy per prompt, batch invariance under seeds, EOS handling,
block release, streaming, bad arguments."""
import pytest
import torch

import arkernels
from arkernels.hf.tiny import FAMILIES, tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4], [20, 21, 22, 23, 24, 25], [7]]  # ragged, longer than window 5
NEW_TOKENS = 10


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_greedy_matches_stock(family):
    model = tiny_model(family)
    ref = [model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    res = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[], block_size=4)
    assert res.tokens == ref
    assert all(v == 0 for v in res.cache_blocks_in_use.values())  # every block back in the pool
    assert model.config._attn_implementation == "sdpa"  # the attention switch was restored
    assert res.prompt_lens == [len(p) for p in PROMPTS]


def test_generate_batch_invariance_under_seeds():
    model = tiny_model("qwen3")
    kw = dict(max_new_tokens=NEW_TOKENS, temperature=1.3, top_p=0.95, eos_token_id=[])
    batch = arkernels.generate(model, PROMPTS, seed=[11, 12, 13, 14], **kw)
    for i in (0, 2):  # the same prompt and seed alone give the same tokens as inside the batch
        alone = arkernels.generate(model, [PROMPTS[i]], seed=11 + i, **kw)
        assert alone.tokens[0] == batch.tokens[i]
    other = arkernels.generate(model, PROMPTS, seed=[99, 12, 13, 14], **kw)
    assert other.tokens[1:] == batch.tokens[1:]  # a row's seed changes only that row
    assert other.tokens[0] != batch.tokens[0]


def test_generate_eos_stops_row_and_releases_blocks():
    model = tiny_model("llama")
    free = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    eos = free.tokens[1][3]  # row 1 emits this at its 4th step: make it the EOS
    first = {r: next((i for i, t in enumerate(toks) if t == eos), None) for r, toks in enumerate(free.tokens)}
    seen = []
    res = arkernels.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                             stream=lambda row, tok: seen.append((row, tok)))
    for r, toks in enumerate(free.tokens):
        stop = first[r]
        assert res.tokens[r] == (toks if stop is None else toks[: stop + 1])  # EOS included, nothing after it
        assert res.finished_by_eos[r] == (stop is not None)
    assert len(res.tokens[1]) == 4
    assert sorted(seen) == sorted((r, t) for r, toks in enumerate(res.tokens) for t in toks)
    assert [t for r, t in seen if r == 0] == res.tokens[0]  # streamed in order
    assert all(v == 0 for v in res.cache_blocks_in_use.values())


def test_generate_text_and_tensor_inputs():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    a = arkernels.generate(model, ids, max_new_tokens=3, eos_token_id=[])
    b = arkernels.generate(model, ids.tolist(), max_new_tokens=3, eos_token_id=[])
    assert a.tokens == b.tokens and len(a.tokens[0]) == 3
    assert arkernels.generate(model, [[5]], max_new_tokens=0).tokens == [[]]


def test_generate_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="generate: .*tokenizer"):
        arkernels.generate(model, ["hello"])
    with pytest.raises(ValueError, match="generate: prompt 1"):
        arkernels.generate(model, [[1, 2], []])
    with pytest.raises(ValueError, match="generate: seed"):
        arkernels.generate(model, [[1, 2], [3]], seed=[1, 2, 3])
    with pytest.raises(ValueError, match="generate: max_new_tokens"):
        arkernels.generate(model, [[1, 2]], max_new_tokens=-1)
    with pytest.raises(NotImplementedError, match="cuda_graphs"):
        arkernels.generate(model, [[1, 2]], cuda_graphs=True)
