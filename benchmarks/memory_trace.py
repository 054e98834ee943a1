"""Who holds a GPU's memory at a step's peak: torch's allocator trace (`torch.cuda.memory._record_memory_history`)
replayed to its highest point, the blocks alive there grouped by the Python line that allocated them; the planner
(coat_ds/plan.py) names what it expects at the peak, this what is there. `e2e.py --memory-trace` records one step."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

GIB = float(1 << 30)
MAX_ENTRIES = 2_000_000        # a 70B-wide step of a dozen layers allocates ~10^4 blocks; a whole one ~10^5
OWN = ("/torch/", "/contextlib.py", "/functools.py")   # frames that allocate on someone else's behalf


def site(frames: list[dict], depth: int = 3) -> str:
    """The innermost `depth` frames outside torch itself, innermost first: the code that asked for the block."""
    mine = [f for f in frames if not any(o in f.get("filename", "") for o in OWN)]
    return " < ".join(f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in mine[:depth]) or "(torch)"


def _short(path: str) -> str:
    for cut in ("site-packages/", "/coat_ds/", "/benchmarks/", "/examples/"):
        if cut in path:
            head = cut.strip("/") + "/" if cut != "site-packages/" else ""
            return head + path.split(cut, 1)[1]
    return path.rsplit("/", 1)[-1]


def peak_sites(trace: list[dict], base_bytes: int, top: int = 25) -> dict:
    """The trace's highest point of allocated bytes (`base_bytes` before it began) and the blocks alive there by
    allocating site, largest first, and the allocation that reached it; a block is freed when requested free, as
    torch's memory_allocated() counts."""
    cur, best, best_i = base_bytes, base_bytes, -1
    sizes: dict[int, int] = {}
    for i, e in enumerate(trace):
        act, addr = e.get("action"), e.get("addr")
        if act == "alloc":
            sizes[addr] = e["size"]
            cur += e["size"]
            if cur > best:
                best, best_i = cur, i
        elif act == "free_requested":
            cur -= sizes.pop(addr, e["size"])
    live: dict[int, dict] = {}
    for e in trace[:best_i + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") == "free_requested":
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = {}
    for e in live.values():
        g = groups.setdefault(site(e.get("frames", [])), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    in_trace = sum(v[0] for v in groups.values())
    return {"peak_gb": best / GIB, "before_trace_gb": (best - in_trace) / GIB, "in_trace_gb": in_trace / GIB,
            "at": site(trace[best_i].get("frames", []), depth=6) if best_i >= 0 else None,
            "sites": [{"gb": b / GIB, "blocks": n, "site": s} for s, (b, n) in ranked[:top]],
            "other_sites_gb": sum(b for _, (b, _n) in ranked[top:]) / GIB}


@contextmanager
def recorded(device: int, on: bool) -> Iterator[dict]:
    """Record the allocator's trace on CUDA `device` while the block runs; afterwards the yielded dict holds
    peak_sites() of it (left empty when `on` is false or CUDA is absent)."""
    import torch

    out: dict = {}
    if not (on and torch.cuda.is_available()):
        yield out
        return
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=MAX_ENTRIES, clear_history=True)
    try:
        yield out
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out.update(peak_sites(trace, base), entries=len(trace), truncated=len(trace) >= MAX_ENTRIES)
