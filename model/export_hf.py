"""A codex checkpoint as a standard Hugging Face model directory (`codex export --format hf`).

codex's block is Qwen3ForCausalLM's (qk_norm=true) or LlamaForCausalLM's (qk_norm=false), which
transformers, vLLM and lm-eval-harness load with no custom code. The weights are renamed one to one
and written in fp32 without the vocabulary's padding rows; the run's tokenizer.json becomes a
PreTrainedTokenizerFast that puts <|bos|> first. An option no standard architecture has
(model.mlp=relu2, ...) makes the export refuse with a ConfigError naming it. The weight map and
the numerics: docs/export.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, cast

import torch

from codex.core import fsio, rundir
from codex.core.config import ConfigError, to_yaml
from codex.core.config.model import ModelConfig
from codex.model.gpt import GPT, mlp_hidden

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# model.* options whose every value maps onto Qwen3 / Llama (mlp: only "swiglu", checked below).
# init_std only matters at initialisation; preset only names where the values came from.
# a kernel choice (sdpa or TPU flash): the same function
MAPPED_OPTIONS = {
    "preset",
    "n_layer",
    "n_head",
    "n_kv_head",
    "n_embd",
    "mlp",
    "mlp_hidden",
    "qk_norm",
    "tie_embeddings",
    "rope_theta",
    "norm_eps",
    "vocab_size",
    "max_seq_len",
    "init_std",
    "zero_init_proj",  # an initialisation only: the trained weights map as usual
    "attention",
}


def check_exportable(m: ModelConfig) -> str:
    """The HF architecture name for model config `m`, or ConfigError naming the option that has
    none."""
    if m.mlp != "swiglu":
        raise ConfigError(
            f"model.mlp={m.mlp}: not exportable to a standard Hugging Face architecture "
            "(Qwen3 and Llama have a gated SwiGLU MLP); train with model.mlp=swiglu to export"
        )
    for f in dataclasses.fields(ModelConfig):
        if f.name in MAPPED_OPTIONS:
            continue
        # Every ModelConfig field has a default or a default_factory.
        factory = cast(Callable[[], object], f.default_factory)
        default = f.default if f.default is not dataclasses.MISSING else factory()
        if getattr(m, f.name) != default:
            raise ConfigError(
                f"model.{f.name}={getattr(m, f.name)!r}: the Hugging Face export does not know how "
                "to map this option (model/export_hf.py MAPPED_OPTIONS)"
            )
    return "Qwen3ForCausalLM" if m.qk_norm else "LlamaForCausalLM"


def hf_config(m: ModelConfig):
    """The transformers config of the matching architecture (vocab_size = the real, unpadded
    vocab)."""
    from transformers import LlamaConfig, Qwen3Config  # optional dependency: only export needs it

    arch = check_exportable(m)
    common: dict[str, Any] = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.n_embd,
        intermediate_size=mlp_hidden(m),
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.n_kv_head,
        head_dim=m.n_embd // m.n_head,
        hidden_act="silu",
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rope_theta)},
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=m.init_std,
        architectures=[arch],
        dtype="float32",
    )
    if arch == "Qwen3ForCausalLM":
        return Qwen3Config(use_sliding_window=False, **common)
    return LlamaConfig(mlp_bias=False, **common)


def hf_state_dict(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """codex parameter names -> HF names, padding rows of wte / lm_head dropped; fp32 copies."""
    V = m.vocab_size
    out = {
        "model.embed_tokens.weight": state["wte.weight"][:V],
        "model.norm.weight": state["norm_f.weight"],
        "lm_head.weight": state["lm_head.weight"][:V],
    }
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "mlp_norm.weight": "post_attention_layernorm.weight",
        "attn.c_q.weight": "self_attn.q_proj.weight",
        "attn.c_k.weight": "self_attn.k_proj.weight",
        "attn.c_v.weight": "self_attn.v_proj.weight",
        "attn.c_proj.weight": "self_attn.o_proj.weight",
        "mlp.w_gate.weight": "mlp.gate_proj.weight",
        "mlp.w_up.weight": "mlp.up_proj.weight",
        "mlp.w_down.weight": "mlp.down_proj.weight",
    }
    if m.qk_norm:
        names.update(
            {
                "attn.q_norm.weight": "self_attn.q_norm.weight",
                "attn.k_norm.weight": "self_attn.k_norm.weight",
            }
        )
    for i in range(m.n_layer):
        for ours, theirs in names.items():
            out[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
    known = {"wte.weight", "norm_f.weight", "lm_head.weight"} | {
        f"blocks.{i}.{k}" for i in range(m.n_layer) for k in names
    }
    extra = sorted(set(state) - known)
    if extra:  # a codex parameter with no HF home would be silently lost
        raise ConfigError(
            "the checkpoint has parameters the Hugging Face export does not map: "
            f"{', '.join(extra[:5])}"
        )
    return {k: v.detach().to(torch.float32).clone() for k, v in out.items()}


def build_hf_model(model, m: ModelConfig):
    """The transformers model with codex `model`'s weights; load_state_dict(strict=True), so a
    missing or unexpected name fails here rather than in a user's from_pretrained."""
    from transformers import AutoModelForCausalLM  # optional dependency: only export needs it

    config = hf_config(m)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = hf_state_dict(model.state_dict(), m)
    if m.tie_embeddings and "lm_head.weight" not in hf.state_dict():
        weights.pop("lm_head.weight")  # tied: transformers keeps one copy, under embed_tokens
    hf.load_state_dict(weights, strict=True)
    if m.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def hf_tokenizer(run: str, max_seq_len: int):
    """RUN/tokenizer/tokenizer.json as a PreTrainedTokenizerFast that puts <|bos|> first, as every
    training document starts with it (docs/export.md, "The tokenizer")."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast  # optional dependency: only export needs it

    path = fsio.join(rundir.tokenizer_dir(run), "tokenizer.json")
    tok = Tokenizer.from_str(fsio.read_text(path))
    for name, i in ((BOS, BOS_ID), (EOS, EOS_ID), (PAD, PAD_ID)):
        if tok.token_to_id(name) != i:
            raise ValueError(f"{path}: {name} has id {tok.token_to_id(name)}, expected {i}")
    tok.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_seq_len,
        split_special_tokens=True,
    )


def export_hf(model: GPT, run_cfg, info: dict, out: str, max_shard_size: str | int = "2GB") -> dict:
    """Write a checkpoint's model (as train/checkpoint/read.py's load_model returns it: the model,
    its Config, the checkpoint info) as a HF model directory at `out` (local path).

    Everything is written into a temporary folder beside `out`, renamed to `out` at the end: an
    interrupted export leaves no half directory. Returns {"path", "architecture", "step", ...}.
    """
    _require_transformers()
    check_export_target(out)
    m = run_cfg.model
    arch = check_exportable(m)
    data_run = info.get("data_run", info["run"])  # the run holding its tokenizer
    tokenizer = hf_tokenizer(data_run, m.max_seq_len)
    if len(tokenizer) != m.vocab_size:
        raise ValueError(
            f"{rundir.tokenizer_dir(data_run)}: {len(tokenizer)} tokens, but the checkpoint "
            f"{info['path']} was trained with model.vocab_size={m.vocab_size}"
        )
    hf = build_hf_model(model, m)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.tmp-", dir=parent)
    try:
        hf.generation_config.update(
            bos_token_id=BOS_ID, eos_token_id=[EOS_ID, BOS_ID], pad_token_id=PAD_ID, do_sample=False
        )
        hf.save_pretrained(tmp, max_shard_size=max_shard_size)
        # transformers < 5 (and the vLLM releases pinned to it) read a top-level rope_theta,
        # ignoring rope_parameters (without it they would silently use 10000), and know the
        # tokenizer class by its old name.
        _update_json(os.path.join(tmp, "config.json"), rope_theta=float(m.rope_theta))
        tokenizer.save_pretrained(tmp)
        _update_json(
            os.path.join(tmp, "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast"
        )
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(model_card(info["run"], run_cfg, info, arch))
        fsio.open_up(tmp)  # mkdtemp made it 0700
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "path": out,
        "architecture": arch,
        "vocab_size": m.vocab_size,
        "step": info["step"],
        "train_tokens": info["train_tokens"],
        "checkpoint": info["path"],
        "config_fingerprint": info["config_fingerprint"],
    }


def check_export_target(out: str) -> None:
    """Refuse an --out that is remote or exists, or a machine without transformers (exit 2),
    before a checkpoint is read."""
    _require_transformers()
    if fsio.is_remote(out):
        raise ConfigError(
            f"--out {out}: export writes a local directory; copy it to remote storage afterwards"
        )
    if os.path.exists(out):
        raise ConfigError(f"--out {out} already exists; remove it or choose another directory")


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401  optional dependency: only export needs it
    except ImportError:
        raise ConfigError(
            "codex export --format hf needs transformers and safetensors: pip install 'codex[hf]'"
        ) from None


def _update_json(path: str, **updates) -> None:
    with open(path) as f:
        config = json.load(f)
    config.update(updates)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def model_card(run: str, run_cfg, info: dict, arch: str) -> str:
    """README.md: what the model is, what it was trained on and how long, how well it does."""
    step = info["step"]
    eval_path = fsio.join(rundir.eval_dir(run), f"step_{step}.json")
    bpb = f"not measured (run `codex eval --run RUN --checkpoint {step:d}`)"
    if fsio.exists(eval_path):
        bpb = f"{float(fsio.read_json(eval_path)['bits_per_byte']):.4f} ({eval_path})"
    m = run_cfg.model
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [codex, {arch.removesuffix("ForCausalLM").lower()}]
---

# codex model: {os.path.basename(run.rstrip("/"))}, step {step}

A {m.n_layer}-layer decoder-only transformer (d_model {m.n_embd}, {m.n_head} heads, \
{m.n_kv_head} KV heads,
vocabulary {m.vocab_size}) trained with codex and exported as `{arch}` (no custom code).

| | |
|---|---|
| run | `{run}` |
| checkpoint | step {step} (`{info["path"]}`) |
| tokens seen | {info["train_tokens"]:,} |
| validation bits per byte | {bpb} |
| config fingerprint | `{info["config_fingerprint"]}` |

Every training document starts with `<|bos|>`; the tokenizer puts it in front of each encoding, and
generation stops at `<|eos|>` or `<|bos|>`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("DIR")
model = AutoModelForCausalLM.from_pretrained("DIR")
out = model.generate(**tok("def fibonacci(n):", return_tensors="pt"), max_new_tokens=50, \
do_sample=False)
print(tok.decode(out[0], skip_special_tokens=True))
```

## Training

Trained by `codex train --run {run} --config config.yaml` with this configuration (config.yaml):

```yaml
{to_yaml(run_cfg).rstrip()}
```
"""
