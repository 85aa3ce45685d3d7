"""Generate text from a model: `codex sample --run DIR --prompt TEXT`, on the run's hardware.

With the KV cache (model/gpt.py prefill / decode, the default) each new token costs one decode
step. Without it (use_cache=False) every token re-runs the model on the last max_seq_len tokens:
the reference the cache is tested against. Past max_seq_len both predict from a sliding window of
the last max_seq_len tokens, a fresh prefill per token with the cache. Sampling runs on the CPU
from the fp32 logits, so a seed gives the same text on every device up to its numerics.
docs/eval.md, "Sampling", has the details.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from codex.core import rundir
from codex.model.gpt import decode, prefill
from codex.pipeline.tokenizer.tokenizer import load_tokenizer
from codex.train.checkpoint.read import load_model
from codex.train.launch import open_backend

log = logging.getLogger("codex.sample")

BOS, EOS = "<|bos|>", "<|eos|>"
# what a stop token means, for the line that says why generation ended
STOP_MEANING = {EOS: "the end of a text", BOS: "the start of a new document"}


@dataclass(frozen=True)
class Sample:
    """A continuation and why it ended."""

    text: str  # the prompt and the generated tokens, decoded together
    new_tokens: int  # tokens generated, the stop token not counted
    max_new_tokens: int
    stop: str | None  # the special token that ended it; None: max_new_tokens were generated

    def why(self) -> str:
        """One line: where generation stopped and why."""
        if self.stop is None:
            return (
                f"stopped after {self.new_tokens} new tokens, the limit "
                "(--max-new-tokens, eval.max_new_tokens)"
            )
        return (
            f"stopped after {self.new_tokens} of at most {self.max_new_tokens} new "
            f"tokens: the model wrote {self.stop}, {STOP_MEANING[self.stop]}"
        )


def sample(model, tokenizer, prompt: str, **options) -> str:
    """The prompt followed by up to `max_new_tokens` generated tokens, as text: continue_prompt's
    text, with its keyword options (max_new_tokens, temperature, top_k, seed, use_cache)."""
    return continue_prompt(model, tokenizer, prompt, **options).text


def continue_prompt(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    use_cache: bool = True,
) -> Sample:
    """The prompt followed by up to `max_new_tokens` generated tokens, and why generation ended.

    temperature 0 is greedy (argmax); top_k 0 samples from the whole vocabulary. Generation stops
    early at <|eos|> or <|bos|> (the start of a new document). The same seed gives the same text.
    Runs on the model's device, under whatever autocast the caller holds.

    8 parameters: keyword generation options with defaults, as Hugging Face's generate takes
    them."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    if bos is None:
        raise ValueError(
            f"the tokenizer has no {BOS} token; was it trained by `codex data tokenize`?"
        )
    stop = {bos} | ({eos} if eos is not None else set())
    prompt_ids = [bos] + tokenizer.encode(prompt).ids
    was_training = model.training
    model.eval()
    try:
        ids, ended = _generate(
            model, prompt_ids, max_new_tokens, temperature, top_k, seed, stop, use_cache
        )
    finally:
        model.train(was_training)
    # Decode prompt and continuation together: a byte-level token can complete a UTF-8 character
    # the prompt's last token started.
    return Sample(
        text=tokenizer.decode(ids, skip_special_tokens=True),
        new_tokens=len(ids) - len(prompt_ids),
        max_new_tokens=max_new_tokens,
        stop=None if ended is None else (BOS if ended == bos else EOS),
    )


@torch.no_grad()
def generate(
    model,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop: set[int] | frozenset[int] = frozenset(),
    use_cache: bool = True,
) -> list[int]:
    """ids followed by up to max_new_tokens tokens (stopping before a token in `stop`).

    8 parameters: keyword generation options with defaults, as Hugging Face's generate takes
    them."""
    return _generate(model, ids, max_new_tokens, temperature, top_k, seed, stop, use_cache)[0]


def _generate(
    model,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    stop: set[int] | frozenset[int],
    use_cache: bool,
) -> tuple[list[int], int | None]:
    """generate's ids, and the token in `stop` that ended them (None: max_new_tokens reached).

    8 parameters: generate's, passed on."""
    max_seq_len = _max_seq_len(model)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids, cache = list(ids), None
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(torch.tensor([ids[-max_seq_len:]], device=device))[:, -1]
        # the prompt, or a sliding window (module doc)
        elif cache is None or len(ids) > max_seq_len:
            logits, cache = prefill(model, torch.tensor([ids[-max_seq_len:]], device=device))
        else:  # ids[-1] is the one token not in the cache yet, at position len(ids) - 1
            logits = decode(model, torch.tensor([ids[-1:]], device=device), cache)
        if device.type == "xla":
            _xla_sync()
        nxt = pick_token(logits[0].float().cpu(), temperature, top_k, gen)
        if nxt in stop:
            return ids, nxt
        ids.append(nxt)
    return ids, None


def _xla_sync() -> None:
    """Run the step's program and materialise every live tensor, the cache included: reading only
    the logits back would leave the cache's updates pending, and the graph would grow by one decode
    step (a new program) per token. torch_xla is imported here, only on an XLA device."""
    import torch_xla

    torch_xla.sync()


def pick_token(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """The next token from one position's logits [vocab] (CPU, fp32): argmax at temperature 0,
    else a draw from softmax(logits / temperature) over the top_k most likely (0 = all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))


def _max_seq_len(model) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    n = getattr(cfg, "max_seq_len", None)
    if not n:
        raise ValueError("sample: the model has no cfg.max_seq_len; expected a model.gpt.GPT")
    return int(n)


def run_sample(cfg, prompt: str) -> str | None:
    """Load RUN's checkpoint cfg.eval.checkpoint and its tokenizer, and continue `prompt` with the
    cfg.eval sampling settings (max_new_tokens, temperature, top_k, seed) on cfg.train.hardware
    (CPU, CUDA or XLA, under the backend's bf16 autocast where it uses one; a preset whose
    hardware is missing is an error, as in training). One log line says why it stopped.

    Under a multi-process launch every rank generates the same text (the same seed; an XLA SPMD
    program must run on every host anyway) and only rank 0 returns it; the others return None.
    """
    e = cfg.eval
    with open_backend(cfg) as backend:
        model, _, info = load_model(cfg, e.checkpoint)
        # not prepare_model: torch.compile would recompile per shape
        model = model.to(backend.device)
        tokenizer = load_tokenizer(rundir.tokenizer_dir(info["data_run"]))
        with backend.autocast():
            out = continue_prompt(
                model,
                tokenizer,
                prompt,
                max_new_tokens=e.max_new_tokens,
                temperature=e.temperature,
                top_k=e.top_k,
                seed=e.seed,
            )
        if not backend.is_main:
            return None
        log.info(out.why())
        return out.text
