"""The modelled step time (train/plan/step_time.py) and the planner's choice by it: on TPU the
batch, micro-batches, layout and remat a run uses are the fastest modelled step among those that
fit, a user's explicit choice still wins, and `codex hardware --model` shows the time and MFU."""

from __future__ import annotations

import dataclasses

from click.testing import CliRunner

from codex.cli.main import cli
from codex.core.config import build_config
from codex.train.plan.batch import STEP_TOKENS_PER_DEVICE
from codex.train.plan.memory import Setting, plan
from codex.train.plan.presets import CHIP_LINKS, get_preset, preset_model
from codex.train.plan.report import model_fit
from codex.train.plan.step_time import model_flops_per_token, step_time
from tests.fixtures.runs import plan_without_run


def _rows(args: list[str]) -> dict[str, list[str]]:
    res = CliRunner().invoke(cli, ["hardware", *args])
    assert res.exit_code == 0, res.output
    return {line.split()[0]: line.split() for line in res.output.splitlines()[3:] if line.strip()}


def _every_fitting_time(model: str, hardware: str) -> dict[tuple, float]:
    """Every (layout, remat, device batch) that does STEP_TOKENS_PER_DEVICE a chip and fits,
    enumerated here apart from the planner's search, with its modelled step seconds."""
    m, p = preset_model(model), get_preset(hardware)
    T = model_fit(m, p).seq_len
    seqs = STEP_TOKENS_PER_DEVICE // T
    out = {}
    for layout in ("replicate", "fsdp"):
        for remat in ("none", "block"):
            for b in (b for b in range(1, seqs + 1) if seqs % b == 0):
                s = Setting(layout=layout, remat=remat, accum=seqs // b, optimizer="muon")
                mp = plan(m, p, b, T, s)
                if mp.fits():
                    t = step_time(m, p, mp)
                    assert t is not None
                    out[(layout, remat, b)] = t.step_s
    return out


def test_the_run_takes_the_fastest_modelled_step_that_fits_1b_on_v6e_8():
    cfg = build_config(model="1b", overrides=["train.hardware=v6e-8"])
    p = plan_without_run(cfg, get_preset("v6e-8"), 8)
    times = _every_fitting_time("1b", "v6e-8")
    assert len(times) > 4  # a real choice: several layouts, remats and batches fit
    chosen = (p.layout.parallel, p.memory.remat, p.device_batch)
    assert p.time is not None and chosen in times
    assert times[chosen] == min(times.values()), (chosen, sorted(times.items(), key=lambda x: x[1]))
    assert p.device_batch * p.seq_len * p.accum == STEP_TOKENS_PER_DEVICE
    # not the largest replicated batch with one micro-batch a step, which the plan used to pick:
    # its unhidden fp32 all-reduce and Muon's iterations on every chip make it far slower
    one = Setting(layout="replicate", optimizer="muon")
    slow = step_time(
        preset_model("1b"), get_preset("v6e-8"), plan(cfg.model, p.preset, 2, 2048, one)
    )
    assert slow is not None and slow.mfu < p.time.mfu / 2, (slow.mfu, p.time.mfu)
    # and `codex hardware --model 1b` shows that configuration, with its step time and MFU
    row = _rows(["--model", "1b"])["v6e-8"]
    assert row[6:10] == [p.layout.parallel, p.memory.remat, f"{p.device_batch}×2048", str(p.accum)]
    assert row[11:13] == [f"{p.time.step_s:.3g}", f"{p.time.mfu:.0%}"], row


def test_7b_offers_8192_tokens_a_chip_on_v6e_8_with_remat_and_on_v6e_16():
    """`codex hardware --model 7b` (Muon, the default): 8 x 1024 a chip with remat on v6e-8, and
    on v6e-16 either way. AdamW's second moment leaves v6e-8 at 4 x 1024: the backward loop's
    stacked fp32 gradient of one micro-batch (4 B / F) is still planned; the weights are kept
    stacked for the run, so no copy of them is."""
    m7 = preset_model("7b")
    for optimizer in ("adamw", "muon"):
        v6e16 = model_fit(m7, get_preset("v6e-16"), Setting(optimizer=optimizer))
        assert v6e16.remat_batch * v6e16.seq_len >= 8192, v6e16
    adamw = model_fit(m7, get_preset("v6e-8"), Setting(optimizer="adamw"))
    assert adamw.remat_batch * adamw.seq_len == 4096, adamw
    row = _rows(["--model", "7b"])["v6e-8"]
    assert row[5] == "8×1024", row  # the remat column
    fit = model_fit(m7, get_preset("v6e-8"), Setting(optimizer="muon"))
    assert (fit.layout, fit.remat, fit.batch * fit.seq_len) == ("fsdp", "block", 8192), fit


def test_a_users_explicit_choice_wins_and_is_timed():
    overrides = [
        "train.hardware=v6e-8",
        "train.parallel=replicate",
        "train.remat=none",
        "train.device_batch=2",
    ]
    p = plan_without_run(build_config(model="1b", overrides=overrides), get_preset("v6e-8"), 8)
    assert (p.layout.parallel, p.memory.remat, p.device_batch, p.accum) == (
        "replicate",
        "none",
        2,
        1,
    )
    assert p.time is not None and 0 < p.time.mfu < 1
    # remat=auto resolves to the plan's choice in the config a run applies
    from codex.train.plan.plan import make_plan, planned_vocab

    cfg = build_config(model="1b", overrides=["train.hardware=v6e-8"])
    resolved, p, _ = make_plan(cfg, get_preset("v6e-8"), 8, vocab=planned_vocab(cfg))
    assert resolved.train.remat == p.memory.remat in ("none", "block")
    # off TPU nothing is timed, and remat=auto is none
    h100 = plan_without_run(build_config(model="124m", overrides=["train.hardware=h100-8"]),
                            get_preset("h100-8"), 8)  # fmt: skip
    assert h100.time is None and h100.memory.remat == "none"


def test_the_terms_of_the_step_time():
    m, p = preset_model("1b"), get_preset("v6e-8")
    hd = m.n_embd // m.n_head
    # MaxText's convention: causal attention is half the full square's 12 L H hd T; the same
    # count the training loop logs MFU with
    assert model_flops_per_token(m, 2048) - model_flops_per_token(m, 0) == 6 * 16 * 32 * hd * 2048
    from codex.model.gpt import flops_per_token

    for name, T in (("1b", 2048), ("7b", 1024), ("tiny", 256)):
        assert model_flops_per_token(preset_model(name), T) == flops_per_token(
            preset_model(name), T
        )
    fsdp = plan(m, p, 4, 2048, Setting(layout="fsdp", accum=8))
    rep = dataclasses.replace(fsdp, layout="replicate", shards=1)
    tf, tr = step_time(m, p, fsdp), step_time(m, p, rep)
    assert tf is not None and tr is not None
    # fsdp's layer gathers run beside the compute: most of its ICI time is hidden; replicate's one
    # all-reduce after the micro-batches is not
    assert tf.exposed_ici_s < tf.ici_s / 3 and tr.exposed_ici_s == tr.ici_s > 0
    # the all-reduce moves 2 (W-1)/W of the fp32 gradient at half the bidirectional ICI rate
    ring = 2 * 7 / 8 * 4 * fsdp.params / (CHIP_LINKS["v6e"]["ici"] * 1e9 / 2)
    assert abs(tr.ici_s - ring) < 1e-9
    remat = step_time(m, p, dataclasses.replace(fsdp, remat="block"))
    assert remat is not None and remat.compute_s > tf.compute_s  # recompute costs FLOPs
    assert remat.model_flops == tf.model_flops  # that MFU does not count
    assert step_time(m, get_preset("h100-8"), fsdp) is None
