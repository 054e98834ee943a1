"""Accuracy (benchmarks/seed_spread.py, accuracy_scale.py): validation loss against BF16's seeds, the 125M seed
spreads and issue 46's verdicts at ~350M, with fine-tuning and the pretrained model's outliers."""
from __future__ import annotations

from pathlib import Path

from benchmarks.tables import NotYet, headline, load, num, table


def _spread(s: dict, key: str = "final") -> str:
    return f"{s[key + '_mean']:.4f} +- {s[key + '_std']:.4f}"


def _gap(s: dict) -> list[str]:
    """The gap of the mean to BF16, and whether it lies inside BF16's spread."""
    return [f"{100 * s['gap_rel_mean']:+.2f}%", "yes" if s["within_bf16_spread"] else "no"]


@table
def seed_spread(res: Path):
    """docs/results.md: validation loss at the last step, mean +- sample std over three seeds per config."""
    summary = load(res, "seed_spread.json")["default"]["summary"]
    yield ["config", "final", "best", "gap of the mean to BF16 (final)", "inside BF16's spread"]
    for key, label in (("bf16", "BF16 + FusedAdam"), ("coat_opt", "coat_ds optimizer-only"),
                       ("coat_full", "coat_ds full"), ("coat_full_bf16sr", "coat_ds full, bf16 master (`bf16_sr`)"),
                       ("coat_full_attn_fp8", "coat_ds full + `attention_fp8`"),
                       ("largest_model", "coat_ds largest-model preset (gradient release, clipping one step late)")):
        s = summary[key]
        yield [label, _spread(s), _spread(s, "best"), *(["-", "-"] if key == "bf16" else _gap(s))]


@table
def seed_spread_families(res: Path):
    """docs/results.md: the other families' seed spreads (125M, 3 seeds, bf16 against coat full)."""
    run = load(res, "seed_spread.json")
    yield ["family", "compared at step", "BF16 + FusedAdam", "coat_ds full", "gap of the mean", "inside BF16's spread"]
    for family in ("qwen3", "gemma3_text"):
        sec = run[family]
        b, c = sec["summary"]["bf16"], sec["summary"]["coat_full"]
        yield [family, sec["steps_compared"], _spread(b), _spread(c), *_gap(c)]


def _band(b: dict | None) -> str:
    return "-" if b is None else f"{b['low']:.4f} - {b['high']:.4f} ({b['set_by']}, {b['seeds']} seeds)"


def _finals(c: dict) -> str:
    return ", ".join(f"{s}: {x:.4f}" for s, x in zip(c["seeds"], c["finals"]))


def _accuracy(res: Path, *keys: str):
    """accuracy_scale.json, or its part under keys; NotYet before a device call has written that."""
    doc = load(res, "accuracy_scale.json", "Accuracy at scale")
    for key in keys:
        doc = (doc or {}).get(key)
    if not doc:
        raise NotYet("accuracy_scale", "Accuracy at scale")
    return doc


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def _yes(x) -> str:
    return "-" if x is None else "yes" if x else "no"


def _bf16_first(names) -> list[str]:
    """BF16, then the presets by name: one order whichever ran first."""
    return sorted(set(names), key=lambda n: (n != "bf16", n))


@table
def accuracy(res: Path):
    """docs/results.md: issue 46's verdicts, a preset a row: pretraining's final validation loss against BF16's seed
    band, and no spike (BF16's seeds judged too), fine-tuning BF16's model before the first step and at the end."""
    yield ["configuration", "pretraining: final val loss (seeds)", "gap to BF16's mean", "inside BF16's band, "
           "no spike", "fine-tuning: gap before the first step / at the end", "targets met"]
    doc = _accuracy(res)
    pre, ft = doc["verdicts"]["pretrain"]["configs"], doc["verdicts"]["finetune"]
    labels = {e["config"]: e["label"] for e in doc["runs"].values()}
    for name in _bf16_first([*pre, *ft]):
        p, f = pre.get(name, {}), ft.get(name, {})
        yield [labels[name],
               f"{num(p.get('final_mean'), 4)} ({len(p.get('seeds', []))})", _pct(p.get("gap_rel")),
               f"{'-' if name == 'bf16' else _yes(p.get('within_band'))}, {_yes(p.get('spike_ok'))}",
               "-" if name == "bf16" else f"{_pct(f.get('gap_before_rel'))} / {_pct(f.get('gap_end_rel'))}",
               "-" if name == "bf16" else _targets_met(p, f)]


headline("accuracy", "coat_ds lowest-memory preset")


def _targets_met(pre: dict, ft: dict) -> str:
    """A preset's verdict over both phases: "so far" while one of them has no verdict yet."""
    met = [x for x in (pre.get("meets_targets"), ft.get("meets_targets")) if x is not None]
    if not met:
        return "-"
    if not all(met):
        return "no"
    return "yes" if pre and ft else f"so far (no {'pretraining' if ft else 'fine-tuning'} yet)"


@table
def accuracy_scale(res: Path):
    """docs/results.md: every pretraining configuration's seeds, BF16's band, and each seed's largest rise of the
    validation loss over its running minimum, against the band's half-width (verdicts.py: a spike)."""
    yield ["configuration", "seeds: final val loss", "mean +- std", "gap to BF16's mean", "BF16's band", "inside",
           "largest val-loss rise over its running minimum, per seed: within the band's half-width"]
    v = _accuracy(res)["verdicts"]["pretrain"]
    for name in _bf16_first(v["configs"]):
        c = v["configs"][name]
        yield [name, _finals(c), f"{c['final_mean']:.4f} +- {num(c['final_std'], 4)}", _pct(c["gap_rel"]),
               _band(v["bf16_band"]) if name == "bf16" else "",
               _yes(c.get("within_band")) if name != "bf16" else "-",
               ", ".join(f"{s}: {num(r, 4)}" for s, r in zip(c["seeds"], c["rises"])) + f": {_yes(c.get('spike_ok'))}"]


@table
def accuracy_scale_finetune(res: Path):
    """docs/results.md: fine-tuning BF16's pretrained model with each configuration, from the same weights."""
    yield FINETUNE_HEADER
    yield from _finetune_rows(_accuracy(res, "verdicts", "finetune"))


FINETUNE_HEADER = ["configuration", "val loss before the first step", "gap to BF16", "val loss at the end",
                   "gap to BF16", "both within 0.5%"]


def _finetune_rows(finetune: dict, peaks: dict | None = None):
    """The fine-tuning verdicts (verdicts.finetune), BF16 first; with `peaks` (config -> GB) each one's peak memory."""
    for name in _bf16_first(finetune):
        f = finetune[name]
        yield [name, num(f["before"], 4), _pct(f["gap_before_rel"]), num(f["end"], 4), _pct(f["gap_end_rel"]),
               _yes(f.get("meets_targets")), *([num(peaks.get(name), 1)] if peaks is not None else [])]


@table
def accuracy_long(res: Path):
    """docs/results.md: issue 61's fine-tuning at long context (accuracy_scale.py --recipe long): BF16's pretrained
    model fine-tuned with each configuration from the same weights, and each run's peak GPU memory."""
    yield [*FINETUNE_HEADER, "peak GPU memory (GB)"]
    if not (res / "accuracy_long.json").is_file():
        raise NotYet("accuracy_scale --recipe long", "Accuracy at scale")
    doc = load(res, "accuracy_long.json")
    peaks = {e["config"]: e["peak_mem_gb"] for e in doc["runs"].values() if e["phase"] == "finetune"}
    yield from _finetune_rows(doc["verdicts"]["finetune"], peaks)


@table
def accuracy_scale_outliers(res: Path):
    """docs/results.md: max |x| over RMS at BF16's pretrained model's decoder-layer inputs, per layer."""
    yield ["decoder layer", "max abs of its input", "RMS", "max abs / RMS"]
    for r in _accuracy(res, "outliers", "layers"):
        yield [r["layer"], num(r["max_abs"], 2), num(r["rms"], 3), num(r["ratio"], 1)]


@table
def accuracy_moe(res: Path):
    """docs/results.md: issue 60's mixture-of-experts pretraining (accuracy_scale.py --recipe moe): each
    configuration's final validation loss against BF16's band, and its router's balance at the last validation."""
    yield ["configuration", "seeds: final val loss", "gap to BF16's mean", "BF16's band", "inside",
           "router aux loss, per seed", "largest / smallest expert share x experts", "router no worse than BF16's"]
    if not (res / "accuracy_moe.json").is_file():
        raise NotYet("accuracy_scale --recipe moe", "Accuracy at scale")
    doc = load(res, "accuracy_moe.json")
    v, router = doc["verdicts"]["pretrain"], doc["verdicts"].get("router") or {}
    for name in _bf16_first(v["configs"]):
        c, r = v["configs"][name], router.get(name) or {}
        yield [name, _finals(c), _pct(c["gap_rel"]), _band(v["bf16_band"]) if name == "bf16" else "",
               _yes(c.get("within_band")) if name != "bf16" else "-",
               ", ".join(f"{x:.4f}" for x in r.get("aux_loss", [])) or "-",
               ", ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(r.get("share_max", []), r.get("share_min", []))) or "-",
               "-" if name == "bf16" else _yes(r.get("no_worse_than_bf16"))]
