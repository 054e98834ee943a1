"""Charts for e2e.json and convergence.json; also re-renders them from the JSON alone.

    python benchmarks/plot_utils.py benchmarks/results/e2e.json benchmarks/results/convergence.json
    python benchmarks/plot_utils.py --table benchmarks/results/*.json      # the README's markdown rows

The JSON files hold every number a chart shows, so a node without matplotlib can run the benchmark and
the chart can be drawn later anywhere.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

COLORS = {"bf16": "#4c72b0", "coat_opt": "#dd8452", "coat_full": "#55a868"}
PARTS = [("weights_gb", "weights (16-bit, fp32 master, FP8 copies)"), ("optimizer_state_gb", "optimizer state"),
         ("grads_gb", "gradients"), ("activations_gb", "activations (saved for backward)"),
         ("other_gb", "other (transients at peak)")]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_e2e(res: dict, path: Path) -> None:
    """Memory breakdown at the equal micro-batch, the largest micro-batch, and tokens/s there."""
    plt = _plt()
    rows = res["configs"]
    labels = [r["label"].replace(" + ", "\n+ ").replace("coat_ds ", "coat_ds\n") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax = axes[0]
    for i, r in enumerate(rows):
        bd = r.get("breakdown") or {}
        bottom = 0.0
        for j, (key, name) in enumerate(PARTS):
            v = max(bd.get(key) or 0.0, 0.0)
            ax.bar(i, v, bottom=bottom, color=f"C{j}", label=name if i == 0 else None, width=0.6)
            bottom += v
        peak = (r.get("equal_batch") or {}).get("peak_alloc_gb")
        if peak:
            ax.text(i, max(bottom, peak), f"{peak:.1f} GiB", ha="center", va="bottom", fontsize=9)
    red = res.get("memory_reduction")
    ax.set(xticks=range(len(rows)), xticklabels=labels, ylabel="GiB (rank 0)",
           title=f"peak memory at micro-batch {res['equal_micro_batch']}" +
                 (f" ({red:.2f}x less)" if red else ""))
    tops = [max((r.get("equal_batch") or {}).get("peak_alloc_gb") or 0.0,
                sum(max((r.get("breakdown") or {}).get(k) or 0.0, 0.0) for k, _ in PARTS)) for r in rows]
    ax.set_ylim(0, 1.6 * max(tops + [1e-9]))
    ax.legend(fontsize=7, loc="upper left", ncol=2)

    ax = axes[1]
    mb = [(r.get("max_batch") or {}).get("micro_batch") or 0 for r in rows]
    ax.bar(range(len(rows)), mb, color=[COLORS.get(r["name"], "gray") for r in rows], width=0.6)
    for i, (v, r) in enumerate(zip(mb, rows)):
        exact = (r.get("max_batch") or {}).get("exact")
        ax.text(i, v, f"{v}" + ("" if exact else " (>=)"), ha="center", va="bottom", fontsize=9)
    ax.set(xticks=range(len(rows)), xticklabels=labels, ylabel="micro-batch", title="largest micro-batch that fits")
    ax.margins(y=0.15)

    ax = axes[2]
    tps = [(r.get("max_batch") or {}).get("tokens_per_s") or 0 for r in rows]
    ax.bar(range(len(rows)), tps, color=[COLORS.get(r["name"], "gray") for r in rows], width=0.6)
    for i, v in enumerate(tps):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
    sp = res.get("speedup_at_max_batch")
    ax.set(xticks=range(len(rows)), xticklabels=labels, ylabel="tokens/s (all ranks)",
           title="at each one's largest micro-batch" + (f" ({sp:.2f}x)" if sp else ""))
    ax.margins(y=0.15)
    ga = res.get("grad_accum_dtype", "config default")
    fig.suptitle(f"{res['model']} ({(res.get('params') or 0) / 1e9:.2f}B params), seq {res['seq_len']}, "
                 f"ZeRO-{res.get('zero_stage')}, {res['world_size']} rank(s), {res['device']}" +
                 ("" if ga == "config default" else f", grad_accum_dtype {ga}"), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_e2e_real_shapes(res: dict, path: Path) -> None:
    """e2e_real_shapes.json: per case, each configuration's peak at its largest micro-batch (or, where micro-batch
    1 did not fit, what it needed), against the device."""
    plt = _plt()
    cases = list(res["cases"].values())
    fig, axes = plt.subplots(1, len(cases), figsize=(5.5 * len(cases), 4.8), squeeze=False)
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_convergence(res: dict, path: Path) -> None:
    """Train (thin) and validation (markers) loss of every configuration, and the validation gap to BF16."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    runs = res["runs"]
    base = {s: v for s, v in (runs.get("bf16") or {}).get("val", [])}
    for name, run in runs.items():
        c = COLORS.get(name, None)
        tr = run.get("train", [])
        if tr:
            ax.plot([s for s, _ in tr], [v for _, v in tr], lw=0.8, alpha=0.6, color=c,
                    label=f"{run.get('label', name)} train")
        va = run.get("val", [])
        if va:
            ax.plot([s for s, _ in va], [v for _, v in va], "o-", ms=3, lw=1.5, color=c,
                    label=f"{run.get('label', name)} val")
        if name != "bf16" and base:
            gap = [(s, 100 * (v - base[s]) / base[s]) for s, v in va if s in base]
            if gap:
                ax2.plot([s for s, _ in gap], [g for _, g in gap], "o-", ms=3, color=c, label=run.get("label", name))
    ax.set(xlabel="step", ylabel="loss", title=f"{res.get('model')} from scratch, {res.get('data', '')}"[:90])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    lo = [v for run in runs.values() for key in ("train", "val") for _, v in run.get(key, [])]
    val = [v for run in runs.values() for _, v in run.get("val", [])]
    if lo and val:   # the whole train curve (it falls below val once the corpus repeats), not the first steps'
        ax.set_ylim(min(lo) * 0.95, max(min(val) * 2.2, min(lo) * 1.5))
    ax2.axhline(0, color="black", lw=0.8)
    ax2.axhspan(-0.5, 0.5, color="green", alpha=0.08, label="target: within 0.5%")
    ax2.set(xlabel="step", ylabel="val loss vs BF16 (%)", title="validation loss gap to BF16")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offload(res: dict, path: Path) -> None:
    """offload.json: host bytes per parameter by category (measured; predicted where a row did not run), per model."""
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in res["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.8), squeeze=False)
    cats = ["master", "optimizer_states", "master_grads", "bf16_staging", "grad_staging", "accumulated_grads"]
    for ax, model in zip(axes[0], models):
        rows = [r for r in res["rows"] if r["model"] == model]
        for i, r in enumerate(rows):
            acc, bottom = (r.get("host_accounting") or {}).get("categories"), 0.0
            if acc is None:   # not run: the predicted steady bytes per parameter, hatched
                v = ((r.get("prediction") or {}).get("per_param") or {}).get("steady_bytes") or 0.0
                ax.bar(i, v, color="none", edgecolor="gray", hatch="//", width=0.6)
                ax.text(i, v, f"not run\n{r.get('why_not', '')[:28]}", ha="center", va="bottom", fontsize=7)
                continue
            for j, c in enumerate(cats):
                v = acc[c]["per_param"]
                ax.bar(i, v, bottom=bottom, color=f"C{j}", width=0.6, label=c)
                bottom += v
            ax.text(i, bottom, f"RSS {r['host_rss_gb']:.1f} GiB\npeak {r['host_rss_peak_gb']:.1f}\n"
                    f"{'pinned' if r.get('pinned') else 'unpinned'}, {r['tokens_per_s']:,.0f} tok/s",
                    ha="center", va="bottom", fontsize=7)
        ax.set(xticks=range(len(rows)), xticklabels=[r["config"] for r in rows], ylabel="host bytes / parameter",
               title=f"{model}: ZeRO-2 Offload host memory")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)   # room for the labels above the tallest bar
        handles, labels = ax.get_legend_handles_labels()
        first = dict(zip(labels[::-1], handles[::-1]))   # one entry per category
        shown = [c for c in cats if c in first]
        ax.legend([first[c] for c in shown], shown, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict) -> str:
    """The README rows of one result file."""
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    if "runs" in res:
        lines = [f"Convergence: {res['model']} ({f((res.get('params') or 0) / 1e6, '.0f')}M), {res['steps']} steps x "
                 f"{res['tokens_per_step']} tokens, {res['device']} ({res['date'][:10]})", "",
                 "| configuration | final val loss | gap to BF16 | tokens/s |", "|---|---|---|---|"]
        base = res.get("bf16_val_loss")
        for name, run in res["runs"].items():
            v = run.get("final_val_loss")
            gap = (v - base) / base if v is not None and base else None
            lines.append(f"| {run.get('label', name)} | {f(v, '.4f')} | {f(gap, '+.2%')} | "
                         f"{f(run.get('tokens_per_s'), ',.0f')} |")
        return "\n".join(lines)
    lines = [f"End to end: {res['model']}, seq {res['seq_len']}, ZeRO-{res.get('zero_stage')}, {res['world_size']} "
             f"rank(s), {res['device']} ({res['date'][:10]})", "",
             f"| configuration | peak GiB @ mb {res['equal_micro_batch']} | weights | optimizer | grads | "
             "activations | max micro-batch | tokens/s @ max |", "|---|---|---|---|---|---|---|---|"]
    for r in res["configs"]:
        bd, eq, mx = r.get("breakdown") or {}, r.get("equal_batch") or {}, r.get("max_batch") or {}
        lines.append(f"| {r['label']} | {f(eq.get('peak_alloc_gb'), '.2f')} | {f(bd.get('weights_gb'), '.2f')} | "
                     f"{f(bd.get('optimizer_state_gb'), '.2f')} | {f(bd.get('grads_gb'), '.2f')} | "
                     f"{f(bd.get('activations_gb'), '.2f')} | {mx.get('micro_batch', '-')} | "
                     f"{f(mx.get('tokens_per_s'), ',.0f')} |")
    lines.append(f"\nmemory reduction {f(res.get('memory_reduction'), '.2f')}x (target 1.54x), speedup at max batch "
                 f"{f(res.get('speedup_at_max_batch'), '.2f')}x (target 1.43x)")
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    table = "--table" in paths
    for p in (Path(x) for x in paths if x != "--table"):
        res = json.loads(p.read_text())
        if table:
            print(markdown(res) + "\n")
            continue
        out = p.with_suffix(".png")
        plot = plot_convergence if "runs" in res else plot_e2e_real_shapes if "cases" in res else plot_e2e
        plot(res, out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
