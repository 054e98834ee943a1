"""Issue 46's targets as arithmetic on the runs' curves; BF16's band is defined here only.

Pretraining: a preset's seed-mean final validation loss lies within BF16's band, its 3-seed mean +- max(2 std, 0.5% of
the mean), and no run of it spikes. Fine-tuning from BF16's model: the validation loss before the first step and at
the end within 0.5% of BF16's.

A spike (issue 57): a run's largest rise of the validation loss over its running minimum above BF16's band half-width,
a setback larger than the spread BF16's own seeds end in; every run is judged, BF16's seeds too. The validation
windows are fixed, so two evaluations differ by the model alone (the earlier train-loss measure's batch noise, ~0.1 a
step at 350M, read 0 for every run).
"""
from __future__ import annotations

import math
import statistics

BAND_STDS, BAND_REL = 2.0, 0.005      # BF16's mean +- the wider of 2 std and 0.5% of the mean
GAP_REL = 0.005                       # one run against BF16's (fine-tuning, convergence): within 0.5% of it
TARGETS = {"band": f"BF16's seed mean +- max({BAND_STDS:g} std, {BAND_REL:.1%} of the mean)",
           "spike": "every seed's largest rise of the validation loss over its running minimum <= BF16's band "
                    "half-width (BF16's seeds judged too)",
           "finetune": f"validation loss before the first step and at the end within {GAP_REL:.1%} of BF16's"}


def mean_std(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1); None where there are too few values."""
    return (statistics.mean(xs) if xs else None), (statistics.stdev(xs) if len(xs) > 1 else None)


def band(finals: list[float]) -> dict:
    """BF16's band from its seeds' final validation losses: mean, sample std (None for one seed), the half-width
    and which rule set it."""
    mean, std = mean_std(finals)
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


def inside(b: dict | None, x: float | None) -> bool | None:
    """Whether `x` lies in band `b` (None where either is unknown)."""
    return None if b is None or x is None else b["low"] <= x <= b["high"]


def gap(x: float | None, base: float | None) -> float | None:
    """(x - base) / base, None where either is unknown."""
    return None if x is None or not base else (x - base) / base


def close(x: float | None, base: float | None) -> bool | None:
    """Whether `x` is within GAP_REL of `base` (None where either is unknown)."""
    g = gap(x, base)
    return None if g is None else abs(g) <= GAP_REL


def pretrain(finals: dict[str, dict[int, float]], rises: dict[str, dict[int, float]]) -> dict:
    """Per configuration, from its finished runs' `finals` and `rises` (val_rise's) by seed: mean, gap to BF16's,
    within BF16's band (mean and each seed), each seed's rise against the band's half-width, both targets."""
    base = finals.get("bf16") or {}
    b = band(list(base.values())) if base else None
    allowed = b and b["half_width"]
    out = {"bf16_band": b, "allowed_rise": allowed,
           "bf16_largest_rise": max((rises.get("bf16") or {}).values(), default=None), "configs": {}}
    for name, by_seed in finals.items():
        if not by_seed:
            continue
        seeds = sorted(by_seed)
        mean, std = mean_std([by_seed[s] for s in seeds])
        rise = [(rises.get(name) or {}).get(s) for s in seeds]
        row = {"seeds": seeds, "finals": [by_seed[s] for s in seeds], "final_mean": mean, "final_std": std,
               "gap_rel": gap(mean, b and b["mean"]), "rises": rise,
               "largest_rise": max((r for r in rise if r is not None), default=None)}
        if b is not None:
            row["seeds_spike_ok"] = [None if r is None else r <= allowed for r in rise]
            row["spike_ok"] = None if None in row["seeds_spike_ok"] else all(row["seeds_spike_ok"])
        if name != "bf16" and b is not None:
            row["within_band"] = inside(b, mean)
            row["seeds_within_band"] = [inside(b, by_seed[s]) for s in seeds]
            row["meets_targets"] = row["within_band"] and row["spike_ok"] is not False
        out["configs"][name] = row
    return out


def finetune(before: dict[str, float], end: dict[str, float]) -> dict:
    """Per configuration: the validation loss before the first step and at the end, each one's gap to BF16's and
    whether both lie within GAP_REL."""
    out = {}
    for name in dict.fromkeys([*before, *end]):
        row = {"before": before.get(name), "end": end.get(name),
               **{f"gap_{k}_rel": gap(v.get(name), v.get("bf16")) for k, v in (("before", before), ("end", end))}}
        if name != "bf16":
            ok = [close(v.get(name), v.get("bf16")) for v in (before, end)]
            row.update(before_ok=ok[0], end_ok=ok[1], meets_targets=None if None in ok else all(ok))
        out[name] = row
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "bf16"))


def router(by_config: dict[str, dict[int, dict]]) -> dict | None:
    """A mixture of experts' router balance at the last validation (issue 60) per configuration: its seeds' aux loss
    and largest / smallest expert share (x experts), no worse than BF16's where its mean aux loss is at most the top
    of BF16's `band` of them; None: no run measured a router."""
    if not any(by_config.values()):
        return None
    base = [r["aux_loss"] for r in (by_config.get("bf16") or {}).values()]
    top = band(base)["high"] if base else None
    out = {}
    for name, by_seed in by_config.items():
        if by_seed:
            rows = [by_seed[s] for s in sorted(by_seed)]
            out[name] = {k: [r[k] for r in rows] for k in rows[0]}
            out[name]["no_worse_than_bf16"] = None if top is None else statistics.mean(out[name]["aux_loss"]) <= top
    return out
