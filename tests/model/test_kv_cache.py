"""The KV cache of model/gpt.py (prefill / decode) and eval/sample.py's generation with it: the
same tokens and logits as the full forward without a cache, on the CPU and on the XLA CPU device
(where the number of compiled programs must not grow with the number of tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from codex.eval.sample import generate, sample
from codex.model.gpt import build_model, decode, prefill
from tests.fixtures.evaluation import make_tokenizer, tiny_cfg
from tests.fixtures.procs import run_xla

torch.set_num_threads(1)

VOCAB = 300
# (n_head, n_kv_head, qk_norm): GQA and MHA, with and without QK-norm
VARIANTS = [(4, 2, True), (4, 4, True), (4, 1, False), (2, 2, False)]


def model_for(n_head: int, n_kv_head: int, qk_norm: bool, max_seq_len: int = 24):
    cfg = tiny_cfg(
        VOCAB,
        n_layer=2,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=32,
        qk_norm=qk_norm,
        max_seq_len=max_seq_len,
    )
    return build_model(cfg, seed=n_head * 10 + n_kv_head + qk_norm).eval()


@pytest.mark.parametrize("n_head,n_kv_head,qk_norm", VARIANTS)
def test_decode_logits_equal_the_full_forward(n_head, n_kv_head, qk_norm):
    model = model_for(n_head, n_kv_head, qk_norm)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = prefill(model, ids[:, :3])
        assert (logits - model(ids[:, :3])[:, -1]).abs().max() < 1e-5
        assert cache.kv.shape == (2, 2, 2, n_kv_head, 24, 32 // n_head)  # only the n_kv_head heads
        for t in range(3, 24):  # to the last position the cache holds
            logits = decode(model, ids[:, t : t + 1], cache)
            assert int(cache.pos) == t + 1
            assert (logits - model(ids[:, : t + 1])[:, -1]).abs().max() < 1e-5, t


@pytest.mark.slow
@pytest.mark.parametrize("n_head,n_kv_head,qk_norm", VARIANTS)
def test_greedy_tokens_with_the_cache_equal_those_without(n_head, n_kv_head, qk_norm):
    """40+ tokens from prompts of several lengths; max_seq_len 24, so every generation crosses it
    and takes the sliding-window path."""
    model = model_for(n_head, n_kv_head, qk_norm)
    rng = torch.Generator().manual_seed(1)
    for length in (1, 5, 13, 30):  # 30 > max_seq_len: the prompt itself is cropped
        prompt = [0] + torch.randint(3, VOCAB, (length - 1,), generator=rng).tolist()
        cached = generate(model, prompt, 45, use_cache=True)
        assert len(cached) == length + 45
        assert cached == generate(model, prompt, 45, use_cache=False), length


def test_seeded_sampling_with_the_cache_equals_without():
    tok = make_tokenizer(VOCAB)
    model = build_model(tiny_cfg(tok.get_vocab_size(), n_layer=2, max_seq_len=16), seed=4).eval()
    for seed in (1, 2):
        a = sample(model, tok, "def add", max_new_tokens=30, temperature=1.5, top_k=0, seed=seed)
        b = sample(
            model,
            tok,
            "def add",
            max_new_tokens=30,
            temperature=1.5,
            top_k=0,
            seed=seed,
            use_cache=False,
        )
        assert a == b and a.startswith("def add")
    assert sample(model, tok, "def add", max_new_tokens=30, temperature=1.5, top_k=0, seed=1) != a
    assert sample(
        model, tok, "The quick", max_new_tokens=30, temperature=0.8, top_k=5, seed=7
    ) == sample(
        model,
        tok,
        "The quick",
        max_new_tokens=30,
        temperature=0.8,
        top_k=5,
        seed=7,
        use_cache=False,
    )


def test_decode_past_the_cache_is_refused_by_prefill():
    model = model_for(4, 2, True, max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len 8"):
        prefill(model, torch.zeros(1, 9, dtype=torch.long))


def test_the_cache_under_bf16_autocast_holds_bf16_and_tracks_the_forward():
    """As run_sample runs on CUDA and TPU: K/V are cached in the autocast dtype."""
    model = model_for(4, 2, True)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = prefill(model, ids[:, :4])
        for t in range(4, 12):
            logits = decode(model, ids[:, t : t + 1], cache)
        full = model(ids)[:, -1]
    assert cache.kv.dtype == torch.bfloat16
    assert (logits.float() - full.float()).abs().max() < 0.05


def test_run_sample_on_a_gpu_preset_without_a_gpu_is_an_error(tmp_path):
    from codex.eval.sample import run_sample
    from codex.train.distributed.backend import BackendError
    from tests.fixtures.evaluation import eval_cfg, make_eval_run

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run, _, _ = make_eval_run(tmp_path)
    cfg = eval_cfg(run, max_new_tokens=4, temperature=0)
    cfg.train.hardware = "h100"
    with pytest.raises(BackendError, match="needs CUDA GPUs"):
        run_sample(cfg, "The quick")


# --- XLA: the same tokens, a fixed number of compiled programs ------------------------------------

XLA_SCRIPT = """
import json
import torch
import torch_xla
import torch_xla.debug.metrics as met
from codex.eval.sample import generate
from codex.model.gpt import build_model
from tests.fixtures.evaluation import tiny_cfg

torch.manual_seed(0)
model = build_model(
    tiny_cfg(300, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_seq_len=64), seed=3
).eval()
prompt = [0, 17, 42, 99, 5, 250, 31]
eager = {n: generate(model, prompt, n) for n in (10, 30)}
model.to(torch_xla.device())
out = {}
for n in (10, 30):
    before = (met.metric_data("CompileTime") or [0])[0]
    out[f"match_{n}"] = generate(model, prompt, n) == eager[n]
    out[f"compiles_{n}"] = (met.metric_data("CompileTime") or [0])[0] - before
print("RESULT " + json.dumps(out))
"""


@pytest.mark.xla
def test_xla_generation_matches_eager_with_a_fixed_compile_count():
    proc = run_xla(XLA_SCRIPT, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert out["match_10"] and out["match_30"], out
    # The first generation compiles prefill and decode (and the small programs around them); the
    # second, three times longer, reuses every one of them: the count does not grow with tokens.
    assert 0 < out["compiles_10"] <= 6, out
    assert out["compiles_30"] == 0, out
