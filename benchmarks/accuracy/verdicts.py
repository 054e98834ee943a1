"""Issue 46's targets as arithmetic, on the runs' curves.

Pretraining: a coat preset's final validation loss (the mean of its seeds) lies within BF16's band, BF16's 3-seed
mean +- max(2 std, 0.5% of the mean): the wider of "within 2 std" and "within 0.5%"; and its largest loss spike in
the second half of the run is no larger than BF16's largest (over BF16's seeds). Fine-tuning from BF16's model: the
validation loss before the first step, and at the end, within 0.5% of BF16's.

A spike: the largest rise of the smoothed train loss above its running minimum (the lowest smoothed value so far,
from step 1), over the steps of the run's second half. Smoothed: the trailing mean over 1% of the run's steps (31 at
3,100), which averages the batch-to-batch noise down by sqrt(31) and still follows a spike of tens of steps. Pure
batch noise makes the smoothed curve rise a little above its running minimum too (about 4.5 of its standard
deviations over the ~50 independent windows of a half); a rise below SPIKE_SIGMAS of them is no spike (0). The
per-step noise is estimated from the second half's first differences (std / sqrt 2: the noise of independent
batches, the slow trend left out).
"""
from __future__ import annotations

import math
import statistics

BAND_STDS, BAND_REL = 2.0, 0.005      # BF16's mean +- the wider of 2 std and 0.5% of the mean
FINETUNE_REL = 0.005                  # fine-tuning: within 0.5% of BF16's, before the first step and at the end
SMOOTH_FRACTION = 0.01                # the trailing mean's window, as a fraction of the run's steps
SPIKE_SIGMAS = 6.0                    # a rise above this many standard deviations of the smoothed noise is a spike
TARGETS = {"band": f"BF16's seed mean +- max({BAND_STDS:g} std, {BAND_REL:.1%} of the mean)",
           "spike": "largest second-half spike <= BF16's largest",
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


def smooth(values: list[float], window: int) -> list[float]:
    """The trailing mean over `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def largest_spike(steps: list[int], losses: list[float], total_steps: int) -> dict:
    """The run's largest second-half spike (module docstring): the rise, the noise floor, the spike (the rise where
    above the floor, else 0) and its step."""
    window = max(1, round(total_steps * SMOOTH_FRACTION))
    smoothed, low, rises = smooth(losses, window), math.inf, []
    for step, s in zip(steps, smoothed):
        low = min(low, s)
        if step > total_steps / 2:
            rises.append((s - low, step))
    half = [v for step, v in zip(steps, losses) if step > total_steps / 2]
    diffs = [b - a for a, b in zip(half, half[1:])]
    noise = statistics.stdev(diffs) / math.sqrt(2) if len(diffs) > 1 else 0.0
    floor = SPIKE_SIGMAS * noise / math.sqrt(window)
    rise, at = max(rises, default=(0.0, None))
    return {"rise": rise, "at_step": at, "floor": floor, "spike": rise if rise > floor else 0.0, "window": window,
            "step_noise": noise}


def gap(x: float | None, base: float | None) -> float | None:
    return None if x is None or not base else (x - base) / base


def pretrain(finals: dict[str, dict[int, float]], spikes: dict[str, dict[int, float]]) -> dict:
    """Per configuration: its seeds' final losses, mean, gap to BF16's mean, within BF16's band (the mean, and each
    seed), its largest spike against BF16's largest, and whether it meets both targets. `finals` and `spikes`: the
    finished runs' values by configuration and seed."""
    base = finals.get("bf16") or {}
    b = band(list(base.values())) if base else None
    bf16_spike = max((spikes.get("bf16") or {}).values(), default=None)
    out = {"bf16_band": b, "bf16_largest_spike": bf16_spike, "configs": {}}
    for name, by_seed in finals.items():
        if not by_seed:
            continue
        mean = statistics.mean(by_seed.values())
        spike = max((spikes.get(name) or {}).values(), default=None)
        row = {"seeds": sorted(by_seed), "finals": [by_seed[s] for s in sorted(by_seed)], "final_mean": mean,
               "final_std": statistics.stdev(by_seed.values()) if len(by_seed) > 1 else None,
               "gap_rel": gap(mean, b and b["mean"]), "largest_spike": spike}
        if name != "bf16" and b is not None:
            row["within_band"] = b["low"] <= mean <= b["high"]
            row["seeds_within_band"] = [b["low"] <= by_seed[s] <= b["high"] for s in sorted(by_seed)]
            row["spike_ok"] = None if spike is None or bf16_spike is None else spike <= bf16_spike
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
