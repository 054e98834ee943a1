"""Quantization error of Adam's moments: E4M3 / E5M2, with and without range expansion, and torchao's scheme.

The moments come from a real AdamW run on a small MLP (CPU, seconds) or from a saved state (--state, as
convergence's BF16 run saves it); prints a table and writes benchmarks/results/quant_error.json."""
from __future__ import annotations

import torch

from benchmarks.common import RESULTS, parser, provenance, write_json
from benchmarks.render_tables import markdown
from coat_ds.formats import relative_error

SCHEMES = [  # name, format, group size, expansion
    ("coat e4m3 expand", "e4m3", 128, True),
    ("coat e4m3 absmax", "e4m3", 128, False),
    ("coat e5m2 expand", "e5m2", 128, True),
    ("coat e5m2 absmax", "e5m2", 128, False),
    ("torchao AdamWFp8 (e4m3 absmax, block 256)", "e4m3", 256, False),
]


def adam_moments(steps: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """First and second moments of torch AdamW after `steps` steps on a small regression MLP."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2048, 64)
    y = torch.sin(x[:, :8] * 2) + 0.1 * torch.randn(2048, 8)
    for _ in range(steps):
        idx = torch.randint(0, 2048, (128,))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    m, v = (torch.cat([opt.state[p][k].reshape(-1) for p in model.parameters()]) for k in ("exp_avg", "exp_avg_sq"))
    return m, v


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, out=(str(RESULTS / "quant_error.json"), "the JSON file"), steps=(200, "AdamW steps"))
    ap.add_argument("--state", help="a torch.save'd dict with 'exp_avg' and 'exp_avg_sq' flat tensors")
    args = ap.parse_args(argv)
    if args.state:
        st = torch.load(args.state)
        m, v, source = st["exp_avg"].float(), st["exp_avg_sq"].float(), args.state
    else:
        m, v = adam_moments(args.steps)
        source = f"torch AdamW, MLP 64-256-256-8, {args.steps} steps"
    rows = [{"scheme": name, "format": fmt, "group_size": g, "expansion": exp,
             "m_rel_err": relative_error(m, fmt, g, exp), "v_rel_err": relative_error(v, fmt, g, exp)}
            for name, fmt, g, exp in SCHEMES]
    print(markdown(["scheme", "m rel err", "v rel err"],
                   [[r["scheme"], f"{r['m_rel_err']:.4%}", f"{r['v_rel_err']:.4%}"] for r in rows]))
    write_json(args.out, {**provenance(), "device": "cpu", "source": source, "numel": m.numel(), "rows": rows},
               indent=2)


if __name__ == "__main__":
    main()
