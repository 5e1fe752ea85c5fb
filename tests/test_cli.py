"""What a newcomer meets first: the command line's user errors (one line, exit status 2, before any model work) and
help; ``arkernels.generate`` fed the way transformers users feed ``model.generate`` (input_ids + attention_mask, a
tokenizer's output, padded tensors), its argument checks before the prefill; ``patch``'s checks at patch time; and
patched ``model.generate`` at the edges of the sampling values transformers accepts (stock's tokens or kept sets)."""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import arkernels
from arkernels.hf.sampler_hook import ArkernelsSampler
from arkernels.hf.tiny import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256  # the tiny models' vocabulary (arkernels.hf.tiny)


def tiny_tokenizer():
    """A word-level tokenizer over the tiny models' 256 ids: "<pad>" 0, "<s>" 1, "</s>" 2, "t3" .. "t255"; each
    prompt starts with "<s>"; left padding (what decoder-only batches use)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")


# ---- the command line as a subprocess --------------------------------------------------------------------------------
def run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "arkernels", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Checkpoint folders: a tiny Llama without a tokenizer, and a tiny Falcon (its attention does not go through
    transformers' registry, so arkernels cannot serve it) with one."""
    from transformers import FalconConfig, FalconForCausalLM

    root = tmp_path_factory.mktemp("models")
    tiny_model("llama").save_pretrained(root / "no_tokenizer")
    falcon = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, bos_token_id=1, eos_token_id=2))
    falcon.save_pretrained(root / "falcon")
    tiny_tokenizer().save_pretrained(root / "falcon")
    return root


USER_ERRORS = [  # (arguments, what the one line must say)
    (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature must be >= 0"),
    (["generate", "--prompt", "hi", "--top-k", "-3"], "--top-k must be >= 0"),
    (["generate", "--prompt", "hi", "--min-p", "2"], "--min-p must be in [0, 1]"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens must be an int >= 0"),
    (["generate", "--prompt", ""], "--prompt is empty"),
    (["demo", "--repeats", "0"], "--repeats must be >= 1"),
    (["demo", "--threads", "-2"], "--threads must be >= 0"),
    (["generate", "--prompt", "hi", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
    (["generate", "--prompt", "hi", "--model", "{tmp}"], "no config.json in that folder"),
    (["generate", "--prompt", "hi", "--model", "{no_tokenizer}"], "the folder has no tokenizer"),
    (["demo", "--model", "{no_tokenizer}"], "the folder has no tokenizer"),
    (["generate", "--prompt", "hi", "--model", "{falcon}"], "'falcon'"),
    (["generate", "--prompt", "hi", "--device", "cuda:0" if not torch.cuda.is_available() else "mps"],
     "--device" if not torch.cuda.is_available() else "arkernels runs on cpu or cuda"),
]
# One of each kind of user error the issue lists runs as a real process (exit status and stderr as a shell sees
# them); the whole grid runs in-process through the same main() (a subprocess costs a torch import: 3-12 s here).
SUBPROCESS = {0, 9, 11, 13}


def _args(args, folders):
    return [a.format(no_tokenizer=folders / "no_tokenizer", falcon=folders / "falcon", tmp=folders) for a in args]


def _one_error_line(stderr: str, cmd: str, says: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("[transformers]")]
    assert len(lines) == 1 and lines[0].startswith(f"arkernels {cmd}: error: "), stderr
    assert says in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args,says", USER_ERRORS, ids=[" ".join(a)[:48] for a, _ in USER_ERRORS])
def test_cli_user_error_is_one_line_exit_2(args, says, folders, capsys, monkeypatch):
    import arkernels.models
    from arkernels.__main__ import main

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(arkernels.models, "load_model", no_loading)
    assert main(_args(args, folders)) == 2
    out, err = capsys.readouterr()
    _one_error_line(err, args[0], says)
    assert out == ""  # nothing generated, no model line


@pytest.mark.parametrize("i", sorted(SUBPROCESS), ids=[" ".join(USER_ERRORS[i][0])[:48] for i in sorted(SUBPROCESS)])
def test_cli_user_error_subprocess(i, folders):
    args, says = USER_ERRORS[i]
    proc = run_cli(*_args(args, folders))
    assert proc.returncode == 2, proc.stderr
    _one_error_line(proc.stderr, args[0], says)
    assert proc.stdout == ""


def test_cli_tokenizer_outside_the_model_vocabulary_is_a_user_error(capsys, monkeypatch):
    """A tokenizer that does not belong to the model (ids past its vocabulary): generate's own check, one line."""
    import arkernels.__main__ as cli
    from arkernels.models import tiny_llama

    monkeypatch.setattr(cli, "_load", lambda *a: (tiny_llama(0, vocab_size=64), tiny_tokenizer(), "tiny"))
    assert cli.main(["generate", "--prompt", "t100 t5", "--max-new-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    _one_error_line(err, "generate", "prompt 0 holds token id 100, outside the model's vocabulary [0, 64)")
    assert out == ""  # the prompt is printed with the first token, which never came


def test_cli_debug_shows_the_traceback():
    proc = run_cli("generate", "--debug", "--prompt", "hi", "--top-p", "0")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "UserError: --top-p must be" in proc.stderr


def test_cli_subcommand_usage_and_help(capsys):
    from arkernels.__main__ import build_parser, main

    with pytest.raises(SystemExit) as exit_:  # --prompt missing: the subcommand's usage, not the top-level one
        main(["generate"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: arkernels generate ")
    assert "the following arguments are required: --prompt" in err
    parser = build_parser()
    top = parser.format_help()
    assert "``" not in top and "demo" in top and "generate" in top and "--debug" in top
    subs = parser._subparsers._group_actions[0].choices
    gen = subs["generate"].format_help()
    for opt, default in [("--temperature", "0.0"), ("--top-k", "0"), ("--top-p", "1.0"), ("--min-p", "0.0"),
                         ("--seed", "0"), ("--max-new-tokens", "64"),
                         ("--device", "cuda" if torch.cuda.is_available() else "cpu")]:
        entry = re.search(rf"^  {opt}\b.*?(?=^  -|\Z)", gen, re.S | re.M)  # the option's help paragraph
        assert entry and f"(default: {default})" in " ".join(entry.group(0).split()), (opt, gen)
    demo = " ".join(subs["demo"].format_help().split())
    assert "(default: 3)" in demo and "~/.cache/arkernels" in demo


def test_cli_every_option_has_help():
    from arkernels.__main__ import build_parser

    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices
    for p in [parser, *subs.values()]:
        for action in p._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (p.prog, action.option_strings)


# ---- arkernels.generate fed like model.generate ----------------------------------------------------------------------
PROMPTS = ["t5 t6 t7 t8 t9 t10 t11", "t20 t21", "t30 t31 t32 t33"]  # ragged: the batch pads 1 + 6 + 4 tokens
NEW = 6


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def stock_new_tokens(model, ids, mask, **kw):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0, **kw)
    return out[:, ids.shape[1]:].tolist()


def test_generate_left_padded_batch_with_mask_equals_stock(llama, tok):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    assert (enc["input_ids"][:, 0] == tok.pad_token_id).any()  # really left-padded
    stock = stock_new_tokens(llama, enc["input_ids"], enc["attention_mask"])
    alone = [stock_new_tokens(llama, torch.tensor([tok(p)["input_ids"]]), None)[0] for p in PROMPTS]
    assert stock == alone  # stock with the mask = each prompt unpadded (the reference is sound)
    ours = arkernels.generate(llama, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                              max_new_tokens=NEW, eos_token_id=[])
    assert ours.tokens == stock and ours.prompt_lens == [len(tok(p)["input_ids"]) for p in PROMPTS]
    # the way transformers users pass a batch, and the tokenizer's output as one argument
    assert arkernels.generate(llama, **enc, max_new_tokens=NEW, eos_token_id=[]).tokens == stock
    assert arkernels.generate(llama, enc, max_new_tokens=NEW, eos_token_id=[]).tokens == stock
    assert arkernels.generate(llama, dict(enc), max_new_tokens=NEW, eos_token_id=[]).tokens == stock


def test_generate_right_padded_batch_with_mask(llama, tok):
    tok_right = tiny_tokenizer()
    tok_right.padding_side = "right"
    enc = tok_right(PROMPTS, return_tensors="pt", padding=True)
    assert (enc["attention_mask"][:, -1] == 0).any()  # really right-padded
    unpadded = arkernels.generate(llama, [tok(p)["input_ids"] for p in PROMPTS], max_new_tokens=NEW, eos_token_id=[])
    assert arkernels.generate(llama, **enc, max_new_tokens=NEW, eos_token_id=[]).tokens == unpadded.tokens


def test_generate_refuses_a_padded_tensor_without_mask(llama, tok):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="generate: input_ids row 1 starts with the pad token id 0.*attention_mask"):
        arkernels.generate(llama, enc["input_ids"], max_new_tokens=NEW)
    with pytest.raises(ValueError, match="starts with the pad token id 0"):
        arkernels.generate(llama, input_ids=torch.tensor([[0, 0, 1, 17, 29]]), max_new_tokens=NEW)
    # an unpadded tensor is fine, and a mask of all ones changes nothing
    ids = torch.tensor([[1, 17, 29, 40]])
    a = arkernels.generate(llama, ids, max_new_tokens=3, eos_token_id=[]).tokens
    assert arkernels.generate(llama, ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                              eos_token_id=[]).tokens == a


def test_generate_text_prompts_with_tokenizer(llama, tok):
    res = arkernels.generate(llama, PROMPTS, tokenizer=tok, max_new_tokens=NEW, eos_token_id=[])
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert res.tokens == arkernels.generate(llama, ids, max_new_tokens=NEW, eos_token_id=[]).tokens
    assert res.texts == [tok.decode(t, skip_special_tokens=True) for t in res.tokens]


BAD_CALLS = [  # (positional prompts, keyword arguments, the message)
    ([[5, 6]], dict(seed=1.5), "generate: seed must be an int64"),
    ([[5, 6]], dict(seed=[1.5]), "generate: seed must be an int64"),
    ([[5, 6]], dict(seed=True), "generate: seed must be an int64"),
    ([[5, 6]], dict(seed=torch.tensor([1.0])), "generate: seed must be an int"),
    ([[5, VOCAB]], {}, rf"generate: prompt 0 holds token id {VOCAB}, outside the model's vocabulary \[0, {VOCAB}\)"),
    ([[5, -1]], {}, "generate: prompt 0 holds token id -1"),
    ([[5, 6.0]], {}, "generate: prompt 0 must be a list of int token ids"),
    (torch.empty(1, 0, dtype=torch.int64), {}, r"generate: input_ids is empty \(shape \(1, 0\)\)"),
    (torch.empty(0, 3, dtype=torch.int64), {}, "generate: input_ids is empty"),
    (torch.tensor([[5.0, 6.0]]), {}, "generate: input_ids must be an integer"),
    ([], {}, "generate: pass a non-empty list of prompts"),
    (None, {}, "generate: no prompts"),
    ([[5, 6], []], {}, "generate: prompt 1 is empty"),
    ([[5, 6]], dict(top_p=0.0), r"generate: top_p must be in \(0, 1\]"),
    ([[5, 6]], dict(top_k=2.0), "generate: top_k must be an int"),
    ([[5, 6]], dict(top_k=-1), "generate: top_k must be >= 0"),
    ([[5, 6]], dict(temperature=-0.5), "generate: temperature must be >= 0"),
    ([[5, 6]], dict(temperature=float("nan")), "generate: temperature must be >= 0"),
    ([[5, 6]], dict(min_p=1.5), r"generate: min_p must be in \[0, 1\]"),
    ([[5, 6]], dict(max_new_tokens=2.5), "generate: max_new_tokens must be an int >= 0"),
    ([[5, 6]], dict(block_size=0), "generate: block_size must be an int >= 1"),
    ([[5, 6]], dict(num_return_sequences=0), "generate: num_return_sequences must be an int >= 1"),
    ([[5, 6]], dict(stream=3), "generate: stream must be a callable"),
    (torch.tensor([[5, 6]]), dict(attention_mask=torch.ones(1, 3)), "generate: attention_mask must have input_ids' "),
    (torch.tensor([[5, 6]]), dict(attention_mask=torch.tensor([[0, 0]])), "generate: attention_mask row 0 is all "),
    (torch.tensor([[5, 6]]), dict(attention_mask=torch.tensor([[2, 1]])), "generate: attention_mask must hold only"),
    ([[5, 6]], dict(input_ids=[[5, 6]]), "generate: pass the prompts positionally or as input_ids=, not both"),
    ({"input_ids": [[5, 6]], "pixel_values": 1}, {}, r"keys arkernels.generate does not take: \['pixel_values'\]"),
    ({"input_ids": [[5, 6]], "token_type_ids": [[0, 1]]}, {}, "generate: token_type_ids other than all zeros"),
]


@pytest.mark.parametrize("prompts,kw,says", BAD_CALLS, ids=[s[10:40] for _, _, s in BAD_CALLS])
def test_generate_checks_arguments_before_the_prefill(prompts, kw, says, monkeypatch):
    model = tiny_model("llama")

    def forward(*a, **k):
        raise AssertionError("the model ran before the arguments were checked")

    monkeypatch.setattr(model, "forward", forward)
    with pytest.raises(ValueError, match=says):
        arkernels.generate(model, prompts, max_new_tokens=kw.pop("max_new_tokens", 3), **kw)


def test_generate_accepts_integer_seeds_of_every_kind(llama):
    kw = dict(max_new_tokens=4, temperature=1.0, eos_token_id=[])
    a = arkernels.generate(llama, [[5, 6], [7]], seed=[3, 4], **kw).tokens
    assert arkernels.generate(llama, [[5, 6], [7]], seed=torch.tensor([3, 4], dtype=torch.int32), **kw).tokens == a
    import numpy as np

    assert arkernels.generate(llama, [[5, 6], [7]], seed=[np.int64(3), 4], **kw).tokens == a


def test_generate_warns_past_max_position_embeddings():
    model = tiny_model("llama", max_position_embeddings=8)
    with pytest.warns(UserWarning, match="past the model's predefined maximum length"):
        arkernels.generate(model, [[5, 6, 7, 8, 9, 10]], max_new_tokens=4, eos_token_id=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arkernels.generate(model, [[5, 6, 7, 8]], max_new_tokens=4, eos_token_id=[])  # exactly at the limit: silent


def test_patched_generate_past_max_position_embeddings_equals_stock():
    """Stock warns (its MaxLengthCriteria) and goes on; patched must too, with the same tokens."""
    model = tiny_model("llama", max_position_embeddings=8)
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    stock = model.generate(torch.tensor([[1, 5, 6, 7, 8]]), **kw)
    with arkernels.patch(model):
        assert model.generate(torch.tensor([[1, 5, 6, 7, 8]]), **kw).tolist() == stock.tolist()


# ---- patch checks what it can at patch time --------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [0, -4, 2.5, True])
def test_patch_refuses_bad_block_size(block_size):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="arkernels.patch: block_size must be an int >= 1"):
        arkernels.patch(model, block_size=block_size)
    assert model.config._attn_implementation == "sdpa" and "_get_logits_processor" not in model.__dict__


def test_float64_model_refused_up_front():
    model = tiny_model("llama", dtype=torch.float64)
    with pytest.raises(TypeError, match="arkernels.patch: the model's dtype is torch.float64"):
        arkernels.patch(model)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="generate: the model's dtype is torch.float64"):
        arkernels.generate(model, [[5, 6]], max_new_tokens=2)


# ---- patched model.generate at the edges of the sampling values transformers accepts ---------------------------------
SAMPLE_PROMPT = torch.tensor([[1, 40, 41, 42, 43]])
# greedy-like: stock keeps one token (absent ties), so stock sampling = patched sampling = greedy, whatever the seed
GREEDY_LIKE = [dict(top_p=0.0), dict(temperature=1e-6), dict(min_p=1.0), dict(top_k=1), dict(top_p=1e-9),
               dict(top_k=1, top_p=0.0, min_p=1.0, temperature=0.3)]
# sampled: the kept sets must be the same
SAMPLED = [dict(top_k=VOCAB * 10), dict(top_k=2**40), dict(min_p=0.0), dict(top_p=0.999999), dict(top_p=0.5),
           dict(temperature=2.0, top_k=VOCAB + 1, min_p=0.0), dict(temperature=1e-4, top_p=0.9), dict(min_p=0.5),
           dict(top_p=float("nan")), dict(temperature=0.5, top_k=7, top_p=0.8, min_p=0.05)]


def _sample_kw(edge):
    return {"do_sample": True, "max_new_tokens": NEW, "eos_token_id": None, "pad_token_id": 0, "top_k": 0, **edge}


@pytest.mark.parametrize("edge", GREEDY_LIKE, ids=str)
def test_patched_generate_greedy_like_edges_equal_stock(edge, llama):
    greedy = llama.generate(SAMPLE_PROMPT, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    stock = llama.generate(SAMPLE_PROMPT, **_sample_kw(edge))
    with arkernels.patch(llama, sampler=True):
        torch.manual_seed(1)
        patched = llama.generate(SAMPLE_PROMPT, **_sample_kw(edge))
    assert stock.tolist() == greedy.tolist() and patched.tolist() == stock.tolist()


def test_patched_generate_overflowing_temperature_fails_as_stock(llama):
    """A temperature so small that stock's ``scores / T`` overflows: stock's multinomial refuses the NaN row; patched
    hands the call to stock's warpers, so it fails the same way instead of drawing the argmax."""
    kw = _sample_kw(dict(temperature=1e-40))
    with pytest.raises(RuntimeError, match="probability tensor contains") as stock:
        llama.generate(SAMPLE_PROMPT, **kw)
    with arkernels.patch(llama, sampler=True), pytest.raises(RuntimeError, match="probability tensor contains") as patched:
        llama.generate(SAMPLE_PROMPT, **kw)
    assert str(patched.value) == str(stock.value)


def _processors(model, edge):
    """The processors ``model.generate`` builds for ``edge`` (patched or not): recorded from a real 1-token call."""
    seen = []
    had = model.__dict__.get("_get_logits_processor")  # patch's wrapper, or None: the class method
    original = model._get_logits_processor

    def spy(*a, **k):
        seen.append(original(*a, **k))
        return seen[-1]

    model.__dict__["_get_logits_processor"] = spy
    try:
        model.generate(SAMPLE_PROMPT, **dict(_sample_kw(edge), max_new_tokens=1))
    finally:
        if had is None:
            del model.__dict__["_get_logits_processor"]
        else:
            model.__dict__["_get_logits_processor"] = had
    return seen[-1]


@pytest.mark.parametrize("edge", SAMPLED + GREEDY_LIKE, ids=str)
def test_patched_generate_sampled_edges_keep_stock_sets(edge, llama):
    """Stock's warpers and whatever the patched model uses instead keep the same tokens of the same logits (several
    logit rows: the prompt's positions); an ``ArkernelsSampler`` stands in only where it reproduces stock."""
    logits = llama(SAMPLE_PROMPT).logits[0].detach().float()  # [positions, vocab]
    stock = _processors(llama, edge)
    with arkernels.patch(llama, sampler=True) as handle:
        patched = _processors(llama, edge)
        assert handle.active
    # the support of what multinomial draws from (a finite score can still round to probability 0: temperature 1e-6)
    stock_kept = torch.softmax(stock(SAMPLE_PROMPT, logits.clone()), dim=-1) > 0
    fused = [p for p in patched if isinstance(p, ArkernelsSampler)]
    if fused:
        s = fused[0]
        probs = arkernels.sampling_probs(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                         min_p=s.min_p)
        assert torch.equal(probs > 0, stock_kept), edge
    else:  # handed back: stock's own warpers, unchanged
        assert [type(p) for p in patched] == [type(p) for p in stock]
    if edge.get("top_p") == 0.0:  # transformers keeps one token, the fused sampler takes (0, 1]: stock serves it
        assert not fused  # (a NaN top_p is "off" to transformers: no top-p warper at all)
    # and the patched call itself runs to the end with tokens stock could draw at its first step
    with arkernels.patch(llama, sampler=True):
        out = llama.generate(SAMPLE_PROMPT, **_sample_kw(edge))
    assert out.shape == (1, SAMPLE_PROMPT.shape[1] + NEW) and bool(stock_kept[-1, out[0, SAMPLE_PROMPT.shape[1]]])
