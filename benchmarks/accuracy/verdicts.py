"""Issue 46's targets as arithmetic, on the runs' curves.

Pretraining: a coat preset's final validation loss (the mean of its seeds) lies within BF16's band, BF16's 3-seed
mean +- max(2 std, 0.5% of the mean): the wider of "within 2 std" and "within 0.5%"; and no run of it has a loss
spike. Fine-tuning from BF16's model: the validation loss before the first step, and at the end, within 0.5% of
BF16's.

A spike (issue 57): the largest rise of a run's validation loss over its running minimum (the lowest value at any
earlier evaluation), against BF16's band half-width: a setback larger than the spread BF16's own seeds end in is a
spike. Every run is judged by it, BF16's seeds too (one of them can fail it; its row then says so), and a
configuration passes where each of its seeds does. The validation loss is measured on the same fixed windows at
evaluation, so two evaluations differ by the model alone, not by the sample (the train loss's batch-to-batch noise,
~0.1 a step at 350M, set a floor of ~0.1 under the earlier train-loss measure, which read 0 for every run, BF16's
included, and compared against BF16's largest, which BF16's own seeds could not exceed). It sees what lasts to an
evaluation (every 5% of the run); each step's train loss is in the run's log.jsonl.
"""
from __future__ import annotations

import math
import statistics

BAND_STDS, BAND_REL = 2.0, 0.005      # BF16's mean +- the wider of 2 std and 0.5% of the mean
FINETUNE_REL = 0.005                  # fine-tuning: within 0.5% of BF16's, before the first step and at the end
TARGETS = {"band": f"BF16's seed mean +- max({BAND_STDS:g} std, {BAND_REL:.1%} of the mean)",
           "spike": "every seed's largest rise of the validation loss over its running minimum <= BF16's band "
                    "half-width (BF16's seeds judged too)",
           "finetune": f"validation loss before the first step and at the end within {FINETUNE_REL:.1%} of BF16's"}


def band(finals: list[float]) -> dict:
    """BF16's band from its seeds' final validation losses: mean, sample std (n - 1; None for one seed), the
    half-width and which rule set it."""
    mean = statistics.mean(finals)
    std = statistics.stdev(finals) if len(finals) > 1 else None
    by_std = BAND_STDS * std if std is not None else 0.0
    half = max(by_std, BAND_REL * mean)
    return {"seeds": len(finals), "mean": mean, "std": std, "half_width": half, "low": mean - half, "high": mean + half,
            "set_by": f"{BAND_STDS:g} std" if by_std > BAND_REL * mean else f"{BAND_REL:.1%} of the mean"}


def val_rise(val: list[list]) -> dict:
    """The largest rise of a validation curve ([step, tokens, loss] per evaluation) over its running minimum: the
    rise, the step it was seen at and the step of the minimum it rose over (0.0 and None where it never rose)."""
    low, low_step, worst = math.inf, None, {"rise": 0.0, "at_step": None, "over_step": None}
    for step, _, loss in val:
        if loss - low > worst["rise"]:
            worst = {"rise": loss - low, "at_step": step, "over_step": low_step}
        if loss < low:
            low, low_step = loss, step
    return worst


def gap(x: float | None, base: float | None) -> float | None:
    return None if x is None or not base else (x - base) / base


def pretrain(finals: dict[str, dict[int, float]], rises: dict[str, dict[int, float]]) -> dict:
    """Per configuration: its seeds' final losses, mean, gap to BF16's mean, within BF16's band (the mean, and each
    seed), its seeds' largest validation-loss rises against the allowed rise (BF16's band half-width; BF16's seeds
    too), and whether it meets both targets. `finals` and `rises` (val_rise's): the finished runs' values by
    configuration and seed."""
    base = finals.get("bf16") or {}
    b = band(list(base.values())) if base else None
    allowed = b and b["half_width"]
    out = {"bf16_band": b, "allowed_rise": allowed,
           "bf16_largest_rise": max((rises.get("bf16") or {}).values(), default=None), "configs": {}}
    for name, by_seed in finals.items():
        if not by_seed:
            continue
        mean = statistics.mean(by_seed.values())
        seeds = sorted(by_seed)
        rise = [(rises.get(name) or {}).get(s) for s in seeds]
        row = {"seeds": seeds, "finals": [by_seed[s] for s in seeds], "final_mean": mean,
               "final_std": statistics.stdev(by_seed.values()) if len(by_seed) > 1 else None,
               "gap_rel": gap(mean, b and b["mean"]), "rises": rise,
               "largest_rise": max((r for r in rise if r is not None), default=None)}
        if b is not None:
            row["seeds_spike_ok"] = [None if r is None else r <= allowed for r in rise]
            row["spike_ok"] = None if None in row["seeds_spike_ok"] else all(row["seeds_spike_ok"])
        if name != "bf16" and b is not None:
            row["within_band"] = b["low"] <= mean <= b["high"]
            row["seeds_within_band"] = [b["low"] <= by_seed[s] <= b["high"] for s in seeds]
            row["meets_targets"] = row["within_band"] and row["spike_ok"] is not False
        out["configs"][name] = row
    return out


def finetune(before: dict[str, float], end: dict[str, float]) -> dict:
    """Per configuration: the validation loss before the first step and at the end, each one's gap to BF16's and
    whether both lie within FINETUNE_REL."""
    out = {}
    for name in dict.fromkeys([*before, *end]):
        row = {"before": before.get(name), "end": end.get(name),
               "gap_before_rel": gap(before.get(name), before.get("bf16")),
               "gap_end_rel": gap(end.get(name), end.get("bf16"))}
        if name != "bf16":
            row["before_ok"] = None if row["gap_before_rel"] is None else abs(row["gap_before_rel"]) <= FINETUNE_REL
            row["end_ok"] = None if row["gap_end_rel"] is None else abs(row["gap_end_rel"]) <= FINETUNE_REL
            row["meets_targets"] = None if None in (row["before_ok"], row["end_ok"]) else \
                row["before_ok"] and row["end_ok"]
        out[name] = row
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "bf16"))
