"""The benchmarks' charts, also drawn later from a JSON alone (a node without matplotlib still writes the JSON):
`python -m benchmarks.plot_utils FILE.json ...`."""
from __future__ import annotations

import json
import statistics
import sys
import textwrap
from pathlib import Path

from benchmarks.configs import LABELS

COLORS = {"bf16": "#4c72b0", "coat_opt": "#dd8452", "coat_full": "#55a868"}
PARTS = [("weights_gb", "weights (16-bit, fp32 master, FP8 copies)"), ("optimizer_state_gb", "optimizer state"),
         ("grads_gb", "gradients"), ("activations_gb", "activations (saved for backward)"),
         ("other_gb", "other (transients at peak)")]
OFFLOAD_PARTS = ["master", "optimizer_states", "master_grads", "bf16_staging", "grad_staging", "accumulated_grads"]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path, dpi: int = 110, legend: int | None = None) -> None:
    """Write the figure; with `legend` (a font size) every panel gets a grid and, where it labels lines, a legend."""
    for ax in fig.axes if legend else []:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)


def bars(ax, values: list, texts: list[str], colors, xticklabels, fontsize: int = 9, **axes) -> None:
    """One bar per value with its text on top, `axes` set on the axes."""
    ax.bar(range(len(values)), values, color=colors, width=0.6)
    for i, (v, text) in enumerate(zip(values, texts)):
        ax.text(i, v, text, ha="center", va="bottom", fontsize=fontsize)
    ax.set(xticks=range(len(values)), xticklabels=xticklabels, **axes)
    ax.margins(y=0.15)


def stack(ax, i: int, parts: list[tuple[str, float]]) -> float:
    """One bar at `i` stacked from (label, value) parts, each label once in the legend -> its top."""
    bottom, seen = 0.0, ax.get_legend_handles_labels()[1]
    for j, (label, v) in enumerate(parts):
        ax.bar(i, v, bottom=bottom, color=f"C{j}", label=None if label in seen else label, width=0.6)
        bottom += v
    return bottom


def plot_e2e(res: dict, path: Path) -> None:
    """Memory breakdown at the equal micro-batch, the largest micro-batch, and tokens/s there."""
    rows = res["configs"]
    labels = [textwrap.fill(r["label"], 26) for r in rows]   # a panel is ~26 characters a bar wide
    fig, axes = _plt().subplots(1, 3, figsize=(15, 4.8))
    ax, tops = axes[0], [1e-9]
    for i, r in enumerate(rows):
        bd = r.get("breakdown") or {}
        bottom = stack(ax, i, [(name, max(bd.get(key) or 0.0, 0.0)) for key, name in PARTS])
        peak = (r.get("equal_batch") or {}).get("peak_alloc_gb")
        if peak:
            ax.text(i, max(bottom, peak), f"{peak:.1f} GiB", ha="center", va="bottom", fontsize=9)
        tops.append(max(bottom, peak or 0.0))
    red = res.get("memory_reduction")
    ax.set(xticks=range(len(rows)), xticklabels=labels, ylabel="GiB (rank 0)", ylim=(0, 1.6 * max(tops)),
           title=f"peak memory at micro-batch {res['equal_micro_batch']}" + (f" ({red:.2f}x less)" if red else ""))
    ax.legend(fontsize=7, loc="upper left", ncol=2)

    best = [r.get("max_batch") or {} for r in rows]
    colors = [COLORS.get(r["name"], "gray") for r in rows]
    mb = [b.get("micro_batch") or 0 for b in best]
    bars(axes[1], mb, [f"{v}" + ("" if b.get("exact") else " (>=)") for v, b in zip(mb, best)], colors, labels,
         ylabel="micro-batch", title="largest micro-batch that fits")
    tps = [b.get("tokens_per_s") or 0 for b in best]
    sp = res.get("speedup_at_max_batch")
    bars(axes[2], tps, [f"{v:,.0f}" for v in tps], colors, labels, ylabel="tokens/s (all ranks)",
         title="at each one's largest micro-batch" + (f" ({sp:.2f}x)" if sp else ""))
    ga = res.get("grad_accum_dtype", "config default")
    fig.suptitle(f"{res['model']} ({(res.get('params') or 0) / 1e9:.2f}B params), seq {res['seq_len']}, "
                 f"ZeRO-{res.get('zero_stage')}, {res['world_size']} rank(s), {res['device']}" +
                 ("" if ga == "config default" else f", grad_accum_dtype {ga}"), fontsize=11)
    save(fig, path)


def plot_e2e_real_shapes(res: dict, path: Path) -> None:
    """Per case, each configuration's peak at its largest micro-batch (or what micro-batch 1 needed), per device."""
    cases = list(res["cases"].values())
    fig, axes = _plt().subplots(1, len(cases), figsize=(5.5 * len(cases), 4.8), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows, top = case["summary"], 0.0
        for i, r in enumerate(rows):
            fits = bool(r["max_micro_batch"])
            v = (r["peak_reserved_gb"] if fits else r["needed_gb_at_1"]) or 0.0
            ax.bar(i, v, width=0.6, color=COLORS.get(r["name"], "#55a868"), hatch="" if fits else "//",
                   edgecolor="black" if not fits else None)
            text = (f"micro-batch {r['max_micro_batch']}\n{r['tokens_per_s'] or 0:,.0f} tok/s" if fits else
                    f"OOM at 1\nneeds >= {v:.0f} GiB" if v else "OOM at 1")
            ax.text(i, v, text, ha="center", va="bottom", fontsize=8)
            top = max(top, v)
        ax.set(xticks=range(len(rows)), xticklabels=[r["name"] for r in rows], ylabel="GiB (peak reserved)",
               title=f"{case['model']}, seq {case['seq_len']}\n{case['device']}", ylim=(0, 1.2 * top or 1.0))
    save(fig, path)


def gap_axes(ax, ylabel: str, title: str, label: str = "within 0.5%") -> None:
    """A panel of gaps to BF16 in percent: the zero line and the 0.5% target's band."""
    ax.axhline(0, color="black", lw=0.8)
    ax.axhspan(-0.5, 0.5, color="green", alpha=0.08, label=label)
    ax.set(xlabel="step", ylabel=ylabel, title=title)


def loss_ylim(ax, low: list[float]) -> None:
    """From just below the lowest loss to half above it: the curves' tails, not the first steps'."""
    if low:
        ax.set_ylim(min(low) * 0.97, min(low) * 1.5)


def plot_e2e_scaling(res: dict, path: Path) -> None:
    """Per model, tokens/s per GPU against GPUs, each preset and stage at its largest (solid) and common micro-batch."""
    models = list(dict.fromkeys(s["model"] for s in res["summary"]))
    fig, axes = _plt().subplots(1, max(len(models), 1), figsize=(6 * max(len(models), 1), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines: dict[tuple, list] = {}
        for s in res["summary"]:
            if s["model"] == model:
                lines.setdefault((s["preset"], s["zero_stage"]), []).append(s)
        for i, ((preset, stage), rows) in enumerate(lines.items()):
            for which, style in (("largest", "o-"), ("common", "s--")):
                pts = [(s["world_size"], s[which]["tokens_per_s_per_gpu"]) for s in rows if s.get(which)]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{preset}, ZeRO-{stage}" * (which == "largest"))
        worlds = sorted({s["world_size"] for s in res["summary"]})
        ax.set_xscale("log", base=2)
        ax.set(xlabel="GPUs", ylabel="tokens/s per GPU", title=f"{model}, seq {res['seq_len']}", ylim=(0, None),
               xticks=worlds, xticklabels=worlds)
    fig.suptitle(f"{res.get('device')}: largest micro-batch (solid), common micro-batch (dashed)", fontsize=10)
    save(fig, path, legend=6)


def plot_convergence(res: dict, path: Path) -> None:
    """Train (thin) and validation (markers) loss of every configuration, and the validation gap to BF16."""
    fig, (ax, ax2) = _plt().subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    runs = res["runs"]
    base = dict((runs.get("bf16") or {}).get("val", []))
    for name, run in runs.items():
        c, label = COLORS.get(name), run.get("label", name)
        for key, fmt, style in (("train", "-", {"lw": 0.8, "alpha": 0.6}), ("val", "o-", {"ms": 3, "lw": 1.5})):
            if run.get(key):
                ax.plot(*zip(*run[key]), fmt, color=c, label=f"{label} {key}", **style)
        gap = [(s, 100 * (v - base[s]) / base[s]) for s, v in run.get("val", []) if s in base]
        if name != "bf16" and gap:
            ax2.plot(*zip(*gap), "o-", ms=3, color=c, label=label)
    ax.set(xlabel="step", ylabel="loss", title=f"{res.get('model')} from scratch, {res.get('data', '')}"[:90])
    lo = [v for run in runs.values() for key in ("train", "val") for _, v in run.get(key, [])]
    val = [v for run in runs.values() for _, v in run.get("val", [])]
    if lo and val:   # the whole train curve (it falls below val once the corpus repeats), not the first steps'
        ax.set_ylim(min(lo) * 0.95, max(min(val) * 2.2, min(lo) * 1.5))
    gap_axes(ax2, "val loss vs BF16 (%)", "validation loss gap to BF16", "target: within 0.5%")
    save(fig, path, legend=8)


def plot_offload(res: dict, path: Path) -> None:
    """Host bytes per parameter by category (measured; predicted where a row did not run), per model."""
    models = list(dict.fromkeys(r["model"] for r in res["rows"]))
    fig, axes = _plt().subplots(1, len(models), figsize=(5.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in res["rows"] if r["model"] == model]
        for i, r in enumerate(rows):
            acc = (r.get("host_accounting") or {}).get("categories")
            if acc is None:   # not run: the predicted steady bytes per parameter, hatched
                v = ((r.get("prediction") or {}).get("per_param") or {}).get("steady_bytes") or 0.0
                ax.bar(i, v, color="none", edgecolor="gray", hatch="//", width=0.6)
                ax.text(i, v, f"not run\n{r.get('why_not', '')[:28]}", ha="center", va="bottom", fontsize=7)
                continue
            bottom = stack(ax, i, [(c, acc[c]["per_param"]) for c in OFFLOAD_PARTS])
            ax.text(i, bottom, f"RSS {r['host_rss_gb']:.1f} GiB\npeak {r['host_rss_peak_gb']:.1f}\n"
                    f"{'pinned' if r.get('pinned') else 'unpinned'}, {r['tokens_per_s']:,.0f} tok/s",
                    ha="center", va="bottom", fontsize=7)
        ax.set(xticks=range(len(rows)), xticklabels=[r["config"] for r in rows], ylabel="host bytes / parameter",
               title=f"{model}: ZeRO-2 Offload host memory")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)   # room for the labels above the tallest bar
        ax.legend(fontsize=7, loc="upper right")
    save(fig, path)


def plot_long_context(res: dict, path: Path) -> None:
    """Per row (configuration, layers, tokens): peak GPU memory against the cap, and tokens/s where a step was timed."""
    rows = sorted((r for r in res["rows"] if r["fits"]), key=lambda r: (r["config"], -r["layers"], r["seq"]))
    ballast = lambda r: f" + {r['emulated_layers'] - r['layers']} as ballast" if r.get("emulated_layers") else ""  # noqa: E731
    names = [f"{r['config']}\n{r['layers']} layers{ballast(r)}, {r['seq']:,}" for r in rows]
    fig, (ax, ax2) = _plt().subplots(1, 2, figsize=(12, 0.6 * len(rows) + 2.2))
    ax.barh(names, [r["peak_alloc_gib"] or 0 for r in rows], color="#55a868")   # None: a CPU smoke's
    ax.axvline(res["cap_gib"], color="red", ls="--", label=f"cap {res['cap_gib']:g} GiB")
    for i, r in ((i, r) for i, r in enumerate(rows) if r["peak_alloc_gib"] is not None):
        ax.text(r["peak_alloc_gib"], i, f" {r['peak_alloc_gib']:.1f} ({r['gpu_bytes_per_token'] / 1024:.0f} KB/token)",
                va="center", fontsize=7)
    ax.set(xlabel="peak GPU GiB allocated", title=f"{res['model']}: one {res['device']}, micro-batch 1")
    ax2.barh(names, [r["tokens_per_s"] or 0 for r in rows], color="#4c72b0")
    ax2.set(xlabel="tokens/s (0: first step only)", title="speed")
    ax2.set_yticks([])
    save(fig, path, legend=8)


def plot_hf_trainer(res: dict, path: Path) -> None:
    """Tokens/s and peak memory of every run that finished, Trainer beside the plain loop."""
    rows = [r for r in res["runs"] if r.get("tokens_per_s")]
    labels = [f"{r['path']}\n{r['preset']}\n{r['model']} mb{r['micro_batch']}\n{r['tuning']}" for r in rows]
    colors = [("#1f77b4" if r["path"] == "trainer" else "#aec7e8") if r["preset"] == "bf16" else
              ("#d62728" if r["path"] == "trainer" else "#ff9896") for r in rows]
    fig, ax = _plt().subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
    bars(ax, [r["tokens_per_s"] / 1e3 for r in rows], [f"{r['tokens_per_s'] / 1e3:.1f}k" + (
        f"\n{r['peak_alloc_gb']:.1f} GiB" if r.get("peak_alloc_gb") else "") for r in rows], colors, labels, 7,
         ylabel="tokens/s (thousands, median step)")
    ax.tick_params(axis="x", labelsize=6)
    ax.set_title(f"HF Trainer vs plain deepspeed.initialize loop, {res['device']}, seq {res['seq_len']}", fontsize=9)
    save(fig, path, dpi=120)


def plot_seed_spread(res: dict, path: Path) -> None:
    """Per section: the validation curves (seeds thin, mean thick) and each seed's final loss with BF16's band."""
    keys = sorted((k for k, v in res.items() if isinstance(v, dict) and "summary" in v),
                  key=lambda k: (k != "default", k != "long_data"))
    fig, axes = _plt().subplots(len(keys), 2, figsize=(14, 4.8 * len(keys)), squeeze=False,
                                gridspec_kw={"width_ratios": [2, 1]})
    for (ax, ax2), key in zip(axes, keys):
        sec = res[key]
        for i, (name, runs) in enumerate(sec["runs"].items()):
            c = COLORS.get(name, f"C{i + 3}")
            curves = [dict(e["val"]) for e in runs.values() if e["val"]]
            for v in curves:
                ax.plot(*zip(*v.items()), lw=0.7, alpha=0.5, color=c)
            steps, mean, _ = _seed_mean(curves) if curves else ([], [], [])
            ax.plot(steps, mean, lw=2.2, color=c, label=f"{LABELS[name]} (mean of {len(curves)})")
            st = sec["summary"][name]
            ax2.scatter([i] * len(st["final"]), st["final"], color=c, s=14)
            if st["final_std"] is not None:
                ax2.errorbar(i, st["final_mean"], yerr=st["final_std"], fmt="_", color=c, capsize=6, ms=16)
        band = sec.get("bf16_band")   # verdicts.band (files before issue 59: [min - std, max + std])
        if band:
            ax2.axhspan(*((band["low"], band["high"]) if isinstance(band, dict) else band), color="gray", alpha=0.15,
                        label="BF16's band" if isinstance(band, dict) else "BF16 [min, max] +- 1 std")
        rc, names = sec["recipe"], list(sec["runs"])
        ax.set(xlabel="step", ylabel="validation loss",
               title=f"{key}: {rc['model']}, seq {rc['seq_len']} x {rc['micro_batch']}, {rc['data']}"[:100])
        loss_ylim(ax, [x for st in sec["summary"].values() for x in st["final"]])
        ax2.set(xlim=(-0.5, len(names) - 0.5), xticks=range(len(names)),
                xticklabels=[n.replace("_", "\n", 1) for n in names],
                ylabel=f"val loss at step {sec['steps_compared']}", title="each seed, mean +- std")
    save(fig, path, legend=8)


def _curves(runs: list[dict]) -> dict[str, list[dict[int, float]]]:
    """Each configuration's validation curves, one {step: loss} per seed."""
    out: dict[str, list[dict[int, float]]] = {}
    for e in runs:
        if e.get("val"):
            out.setdefault(e["config"], []).append({s: v for s, _, v in e["val"]})
    return out


def _seed_mean(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Steps every seed reached, the seeds' mean there and their sample std (0 for one seed)."""
    steps = sorted(set.intersection(*[set(c) for c in curves]))
    vals = [[c[s] for c in curves] for s in steps]
    return steps, [statistics.mean(v) for v in vals], [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]


def _gap_curve(ax, base: tuple, steps: list[int], mean: list[float], **style) -> None:
    """A curve's gap to `base` (_seed_mean's steps, mean) in %, at the steps both have."""
    b = dict(zip(base[0], base[1]))
    gap = [(s, 100 * (m - b[s]) / b[s]) for s, m in zip(steps, mean) if s in b]
    if gap:
        ax.plot(*zip(*gap), "o-", ms=3, **style)


def plot_accuracy_scale(res: dict, path: Path) -> None:
    """Pretraining's validation loss (BF16's seeds: mean +- 2 std; each preset's seed mean), its gap to BF16's mean,
    the fine-tuning's validation loss from BF16's model (step 0: before the first step)."""
    fig, (ax, ax2, ax3) = _plt().subplots(1, 3, figsize=(18, 5), gridspec_kw={"width_ratios": [3, 2, 2]})
    runs = list(res["runs"].values())
    colors = {name: COLORS.get(name) or f"C{i + 2}" for i, name in enumerate(["bf16", "exact", "lowest_memory",
                                                                              "largest_model", "long_context"])}
    pre = _curves([e for e in runs if e["phase"] == "pretrain"])
    base = _seed_mean(pre["bf16"]) if pre.get("bf16") else None
    finals = []
    for name, curves in pre.items():
        steps, mean, std = _seed_mean(curves)
        if not steps:
            continue
        finals.append(mean[-1])
        ax.plot(steps, mean, "o-" if name != "bf16" else "-", ms=3, color=colors.get(name),
                label=f"{name} (mean of {len(curves)})")
        if name == "bf16":
            ax.fill_between(steps, [m - 2 * s for m, s in zip(mean, std)], [m + 2 * s for m, s in zip(mean, std)],
                            color=colors[name], alpha=0.2, label="bf16 mean +- 2 std")
        elif base:
            _gap_curve(ax2, base, steps, mean, color=colors.get(name), label=name)
    if base:
        ax2.fill_between(base[0], [-200 * s / m for m, s in zip(base[1], base[2])],
                         [200 * s / m for m, s in zip(base[1], base[2])], color=colors["bf16"], alpha=0.2,
                         label="bf16 +- 2 std")
    loss_ylim(ax, finals)
    ft_curves = _curves([e for e in runs if e["phase"] == "finetune"])
    if len(pre) < 2 and ft_curves.get("bf16"):   # BF16 pretrained alone (--recipe long): the fine-tuning's gap
        ft_base = _seed_mean(ft_curves["bf16"])
        for name, curves in ft_curves.items():
            if name != "bf16":
                _gap_curve(ax2, ft_base, *_seed_mean(curves)[:2], color=colors.get(name), label=name)
    gap_axes(ax2, "vs BF16's seed mean (%)", "gap to BF16" + " (fine-tuning)" * (len(pre) < 2))
    rc = res["recipe"]["pretrain"]
    ax.set(xlabel="step", ylabel="validation loss", title=f"pretraining: llama-{rc['model_size']}, "
           f"{rc['tokens'] / 1e6:.3g}M tokens of {rc['corpus']}, seq {rc['seq_len']}")
    for name, curves in ft_curves.items():
        steps, mean, _ = _seed_mean(curves)
        ax3.plot(steps, mean, "o-", ms=3, color=colors.get(name), label=name)
    ft = res["recipe"]["finetune"]
    ax3.set(xlabel="step", ylabel="validation loss", title=f"fine-tuning BF16's model: {ft['corpus']}, seq "
            f"{ft['seq_len']:,}, {ft['steps']:,} steps")
    save(fig, path, legend=8)


def kind(res: dict) -> str | None:
    """Which benchmark wrote a results file, from a field only it writes (None: a file without a chart). A field that
    every harness file has (calls, rows) says nothing: offload.json has both since it merges through the harness."""
    if "gpu_bytes_per_token" in (res.get("rows") or [{}])[0]:
        return "long_context"
    for key, name in (("verdicts", "accuracy_scale"), ("gpu_memory_gb", "e2e_scaling"), ("hf_config", "hf_trainer"),
                      ("host_available_gb", "offload"), ("bf16_val_loss", "convergence"), ("cases", "e2e_real_shapes"),
                      ("equal_micro_batch", "e2e")):
        if key in res:
            return name
    return "seed_spread" if any(isinstance(v, dict) and "summary" in v for v in res.values()) else None


def main(paths: list[str]) -> int:
    for p in map(Path, paths):
        res = json.loads(p.read_text())
        if kind(res) is None:
            print(f"{p}: no chart draws this file", file=sys.stderr)
            continue
        globals()[f"plot_{kind(res)}"](res, p.with_suffix(".png"))
        print(f"wrote {p.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
