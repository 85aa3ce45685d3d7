"""Generate text from a model: `codex sample --run DIR --prompt TEXT`.

A plain loop without a KV cache, like nanoGPT's `generate`: every new token re-runs the model on
the last max_seq_len tokens. O(n^2) in the generated length, fine for a few hundred tokens and
obviously correct. The prompt starts with <|bos|> because every training document does.
"""

from __future__ import annotations

import torch

from codex import rundir
from eval.load import load_model
from pipeline.tokenizer import load_tokenizer

BOS, EOS = "<|bos|>", "<|eos|>"


def sample(model, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
           top_k: int = 50, seed: int = 0) -> str:
    """The prompt followed by up to `max_new_tokens` generated tokens, as text.

    temperature 0 is greedy (argmax); top_k 0 samples from the whole vocabulary. Generation stops
    early at <|eos|> or <|bos|> (the start of a new document). The same seed gives the same text.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if bos is None:
        raise ValueError(f"the tokenizer has no {BOS} token; was it trained by `codex data tokenize`?")
    stop = {bos} | ({eos} if eos is not None else set())
    max_seq_len = _max_seq_len(model)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    ids = [bos] + tokenizer.encode(prompt).ids
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(idx[:, -max_seq_len:])[:, -1, :].float()
                if temperature == 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k > 0 and top_k < logits.shape[-1]:
                        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = torch.softmax(logits, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=gen)
                if int(nxt) in stop:
                    break
                idx = torch.cat([idx, nxt], dim=1)
    finally:
        model.train(was_training)
    # Decode prompt and continuation together: a byte-level token can complete a UTF-8 character
    # the prompt's last token started.
    return tokenizer.decode(idx[0].tolist(), skip_special_tokens=True)


def _max_seq_len(model) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    n = getattr(cfg, "max_seq_len", None)
    if not n:
        raise ValueError("sample: the model has no cfg.max_seq_len; expected a model.gpt.GPT")
    return int(n)


def run_sample(cfg, prompt: str) -> str:
    """Load RUN's checkpoint cfg.eval.checkpoint and its tokenizer, and continue `prompt` with the
    cfg.eval sampling settings (max_new_tokens, temperature, top_k, seed)."""
    e = cfg.eval
    model, _, _ = load_model(cfg, e.checkpoint)
    tokenizer = load_tokenizer(rundir.tokenizer_dir(cfg.run))
    return sample(model, tokenizer, prompt, max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                  top_k=e.top_k, seed=e.seed)
