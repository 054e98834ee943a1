"""benchmarks/memory_trace.py: the allocator trace replayed to its peak (the GPU run records a real one; here a
trace of known shape, every number checked)."""
from benchmarks.memory_trace import GIB, peak_sites, site

TORCH = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}


def frame(name: str, line: int, path: str = "/r/coat_ds/activation/gemm.py") -> dict:
    return {"filename": path, "line": line, "name": name}


def ev(action: str, addr: int, size: int, *frames: dict) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_site_skips_torch_frames_and_names_the_caller_chain():
    chain = [TORCH, frame("fwd", 10), frame("layer", 20, "/v/site-packages/transformers/models/llama/m.py")]
    assert site(chain) == "coat_ds/activation/gemm.py:10 fwd < transformers/models/llama/m.py:20 layer"
    assert site([TORCH]) == "(torch)"


def test_peak_is_the_highest_point_and_lists_what_lives_there():
    a, b = frame("grad", 1), frame("act", 2)
    g = int(GIB)
    trace = [ev("alloc", 1, 3 * g, TORCH, a), ev("alloc", 2, 2 * g, b), ev("free_requested", 2, 2 * g),
             ev("free_completed", 2, 2 * g),
             ev("alloc", 3, g, b), ev("alloc", 4, 2 * g, a),        # peak: 10 (base) + 3 + 1 + 2 = 16
             ev("free_requested", 99, 4 * g),                       # a block from before the trace: off the base
             ev("alloc", 5, 2 * g, b)]                              # 14: below the peak
    out = peak_sites(trace, base_bytes=10 * g)
    assert out["peak_gb"] == 16 and out["in_trace_gb"] == 6 and out["before_trace_gb"] == 10
    assert out["sites"] == [{"gb": 5.0, "blocks": 2, "site": "coat_ds/activation/gemm.py:1 grad"},
                            {"gb": 1.0, "blocks": 1, "site": "coat_ds/activation/gemm.py:2 act"}]
    assert out["at"] == "coat_ds/activation/gemm.py:1 grad" and out["other_sites_gb"] == 0


def test_an_empty_trace_peaks_at_the_base():
    out = peak_sites([], base_bytes=int(GIB))
    assert out["peak_gb"] == 1 and out["sites"] == [] and out["at"] is None
