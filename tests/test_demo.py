"""The CLI (python -m arkernels demo / generate) on the tiny fallback and on SmolLM2, and SmolLM2 greedy
continuations of patched model.generate and arkernels.generate against stock transformers (32 tokens)."""
import re
import subprocess
import sys
import time

import pytest
import torch

import arkernels
import arkernels.models as models
import arkernels.__main__ as demo_mod
from arkernels.__main__ import main

HAS_SMOLLM2 = models.smollm2_package_folder() is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="SmolLM2 model package absent: " + models.SMOLLM2_INSTALL)
SMOLLM2_PROMPTS = ["Once upon a time,", "The capital of France is", "def add(a, b):"]
SMOLLM2_NEW_TOKENS = 32


def test_demo_falls_back_to_tiny_llama(monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    rc = main(["demo", "--max-new-tokens", "6", "--repeats", "2"])
    out, err = capsys.readouterr()
    assert models.SMOLLM2_INSTALL in err and "tiny random Llama" in err
    assert "arkernels.generate" in out and "tokens/s" in out
    assert out.count(" yes") == 2 and rc == 0  # both arkernels runs match stock greedy
    # the phases, on stderr: loading, then every way in the warm-up and in each round, then done
    assert "[demo] loading SmolLM2-135M-Instruct ..." in err
    for phase in ("warm-up", "round 1/2", "round 2/2"):
        for way in ("stock", "patched", "ours"):
            assert f"{phase}: {way} (" in err, (phase, way, err)
    assert "[demo] [####################] 9/9 done" in err
    # the table ends with what its ratios mean here, and where GPU figures come from
    assert out.rstrip().endswith(demo_mod._explain(torch.device("cpu")))
    assert "On the CPU" in demo_mod._explain(torch.device("cpu")) and "benchmarks/gpu_check.sh" in out


def test_demo_progress_lines_over_the_demo_functions():
    """``_ways`` + ``_interleaved`` on a tiny model: one line before every run (a bar, the phase, the way, the time
    so far), and a "still running" line every 20 s of a run."""
    lines = []
    model = models.tiny_llama(0)
    ways = demo_mod._ways(model, [[1, 5, 6, 7], [1, 9]], 3, 0)
    outs, med = demo_mod._interleaved(ways, 1, say=lines.append)
    lines = [line for line in lines if "still running" not in line]  # a run past 20 s on a loaded machine adds one
    assert [re.sub(r"\(\d+\.\d s\)", "(T)", line) for line in lines] == [
        "[--------------------] 0/6 warm-up: stock (T)",
        "[###-----------------] 1/6 warm-up: patched (T)",
        "[######--------------] 2/6 warm-up: ours (T)",
        "[##########----------] 3/6 round 1/1: stock (T)",
        "[#############-------] 4/6 round 1/1: patched (T)",
        "[################----] 5/6 round 1/1: ours (T)",
        "[####################] 6/6 done (T)"]
    assert outs["stock"] == outs["patched"] == outs["ours"] and all(len(t) == 3 for t in outs["ours"])
    assert set(med) == {"stock", "patched", "ours"} and all(v > 0 for v in med.values())


def test_progress_says_still_running_in_a_log():
    lines = []
    with demo_mod._Progress("round 1/3: stock", say=lines.append, every=0.05):
        time.sleep(0.3)
    assert lines[0] == "round 1/3: stock ..." and lines[-1].startswith("round 1/3: stock: done in ")
    assert any(re.fullmatch(r"round 1/3: stock: still running \(\d+ s\)", line) for line in lines[1:-1])


def test_generate_cli_tiny(monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    assert main(["generate", "--prompt", "x", "--prompt", "y", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 2 and "tokens" in err
    with pytest.raises(SystemExit):
        main(["generate"])  # --prompt is required


@pytest.mark.model
@needs_smollm2
def test_demo_smollm2_subprocess():
    proc = subprocess.run([sys.executable, "-m", "arkernels", "demo", "--max-new-tokens", "4", "--prompt",
                           "Once upon a time,"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SmolLM2-135M-Instruct" in proc.stdout and proc.stdout.count(" yes") == 2


@pytest.fixture(scope="module")
def smollm2():
    model, tok = models.load_model()
    return model, tok


@pytest.mark.model
@needs_smollm2
def test_smollm2_greedy_32_tokens_equal_stock(smollm2):
    model, tok = smollm2
    rows = [tok(p)["input_ids"] for p in SMOLLM2_PROMPTS]
    width = min(map(len, rows))
    ids = torch.tensor([r[:width] for r in rows])  # one rectangular batch, no padding: one stock call for all rows
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False,
              eos_token_id=None)
    stock = model.generate(**kw)[:, width:].tolist()
    with arkernels.patch(model):
        patched = model.generate(**kw)[:, width:].tolist()
    ours = arkernels.generate(model, ids, max_new_tokens=SMOLLM2_NEW_TOKENS, eos_token_id=[], tokenizer=tok)
    assert patched == stock
    assert ours.tokens == stock
    assert ours.texts[0].strip()  # readable text, decoded
