"""The per-parameter form of a checkpoint without DeepSpeed: two ranks' partitions cut through FP8 groups are
gathered back into whole parameters exactly, and the universal file form round-trips (launched/test_deepspeed.py
runs the same code through real engines). Files are read with DeepSpeed's classes only: one carrying code is
refused unrun."""
import os
import pickle
from dataclasses import astuple

import pytest
import torch

from coat_ds.deepspeed.checkpoint.files import (LAYOUTS, CheckpointError, ParamState, canonical, check_contents,
                                                ds_globals, torch_load)
from coat_ds.deepspeed.zero.layout import Segment, meta_offsets
from coat_ds.formats import Fp8Moment, get_format, quantize
from coat_ds.optim.coat_adamw import fp8_moments, fp8_zeros

G = 32
GROUP = {"params": [0], "group_size": G, "v_format": "e5m2", "fp8_state": True, "expansion": True}
# two parameters (300 and 70 values) over two ranks: the cut at 185 falls inside a group of "a"
RANKS = [[Segment("a", 300, 0, 0, 185)], [Segment("a", 300, 185, 0, 115), Segment("b", 70, 0, 115, 70)]]


def _param_state(numel: int, seed: int) -> ParamState:
    torch.manual_seed(seed)
    m, v = (Fp8Moment(*quantize(x, fmt, G), G, get_format(fmt))
            for x, fmt in ((torch.randn(numel), "e4m3"), (torch.rand(numel) * 1e-4, "e5m2")))
    return ParamState(torch.randn(numel), torch.tensor(7.0), m, v, G, "e5m2", numel)


def _whole() -> dict[str, ParamState]:
    return {"a": _param_state(300, 0), "b": _param_state(70, 1)}


def _rank_dicts(whole: dict[str, ParamState]) -> list[dict]:
    """What each rank's ZeRO-1/2 optimizer file holds, cut from `whole` with ParamState.scatter."""
    out = []
    for segments in RANKS:
        numel = sum(s.numel for s in segments)
        flat = torch.zeros(numel)
        st = fp8_zeros(flat.shape, GROUP, flat.device, sum(len(s.groups(G)) for s in segments))
        for seg, meta in zip(segments, meta_offsets(segments, G)):
            whole[seg.name].scatter(seg, meta, flat, fp8_moments(st, GROUP))
            st["step"] = whole[seg.name].step.clone()
        base = {"state": {0: st}, "param_groups": [GROUP],
                LAYOUTS: {0: {"layout": [astuple(s) for s in segments], "flat_index": 0}}}
        out.append({"base_optimizer_state": base, "single_partition_of_fp32_groups": [flat]})
    return out


def test_partitions_gather_back_to_whole_parameters():
    whole = _whole()
    canon = canonical(_rank_dicts(whole))
    assert sorted(canon) == ["a", "b"]
    for name, c in canon.items():
        w = whole[name]
        assert c.filled == c.master.numel() and torch.equal(c.master, w.master) and c.step == 7
        for got, want in ((c.m, w.m), (c.v, w.v)):
            assert got.fmt == want.fmt and got.codes.dtype == want.fmt.dtype
            assert torch.equal(got.codes.view(torch.uint8), want.codes.view(torch.uint8))
            assert torch.equal(got.scale, want.scale) and torch.equal(got.expo, want.expo)
            assert torch.equal(got.dequantize(), want.dequantize())


def test_missing_rank_is_refused():
    with pytest.raises(CheckpointError, match="parameter a: saved ranks cover 115 of 300 values"):
        canonical(_rank_dicts(_whole())[1:])


@pytest.mark.parametrize("as_bits", [False, True])
def test_file_form_round_trips(as_bits):
    c = _param_state(300, 2)
    sd = c.to_file()
    assert {"exp_avg_q", "exp_avg_scale", "exp_avg_expo", "exp_avg_sq_q", "group_size", "fp8", "v_format"} <= set(sd)
    if as_bits:  # files written before Fp8Moment held uint8 codes
        sd = dict(sd, exp_avg_q=sd["exp_avg_q"].view(torch.uint8), exp_avg_sq_q=sd["exp_avg_sq_q"].view(torch.uint8))
    back = ParamState.from_file(sd, c.master.view(10, 30))
    assert back.filled == 300 and torch.equal(back.master, c.master)
    for got, want in ((back.m, c.m), (back.v, c.v)):
        assert got.codes.dtype == want.fmt.dtype and torch.equal(got.dequantize(), want.dequantize())


class _RunsCode:
    """Unpickling it creates the file `marker`: through io.open (an unsupported global) or through os.system (a
    global of a module torch blocks)."""

    def __init__(self, marker, shell: bool = False):
        self.marker, self.shell = str(marker), shell

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",)) if self.shell else (open, (self.marker, "w"))


class _Planted:
    """A class outside DeepSpeed's checkpoint contents whose unpickling creates the file `marker` (its setstate)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __setstate__(self, state: dict) -> None:
        open(state["marker"], "w").close()


PAYLOADS = {"function": (lambda m: _RunsCode(m), "io.open"), "blocked module": (lambda m: _RunsCode(m, True),
            f"{os.system.__module__}.system"), "class": (lambda m: _Planted(m), f"{__name__}._Planted")}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's reader meets protocol 5, as planned
@pytest.mark.parametrize("protocol", [2, 5])
@pytest.mark.parametrize("kind", PAYLOADS)
def test_a_file_carrying_code_is_refused_unrun(tmp_path, kind, protocol):
    """DeepSpeed's own classes load; a file whose unpickling runs code (an unsupported function or class, a module
    torch blocks; torch.save's protocol 2 or pickle's 5) is named in one line, its global named, and never runs,
    though DeepSpeed's torch.load(weights_only=False) would run it."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    tag, marker = tmp_path / "t", tmp_path / "ran"
    tag.mkdir()
    good, bad = tag / "mp_rank_00_model_states.pt", tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "loss_scaler": DynamicLossScaler(8.0, 4, 1.0, 1, False)}, good)
    make, name = PAYLOADS[kind]
    torch.save({"optimizer_state_dict": {"step": 3}, "extra": make(marker)}, bad, pickle_protocol=protocol)
    back = torch_load(str(good))
    assert type(back["loss_scaler"]) in ds_globals() and back["loss_scaler"].cur_scale == 8.0
    with pytest.raises(CheckpointError) as err:
        check_contents(str(tmp_path))
    assert str(err.value) == (f"checkpoint file refused unread: {bad} holds objects outside DeepSpeed's checkpoint "
                              f"contents (global {name}); unpickling it could run code")
    assert not marker.exists()
    torch.load(bad, weights_only=False)
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_refusals_are_told_from_truncation_by_the_pickle_not_torchs_text(tmp_path):
    """A file cut short or garbled is truncated or corrupt, never code, even where torch's reader calls a name cut
    off mid-line an unsupported global (an old-format file); a whole pickle torch's reader refuses without any
    global outside (protocol 4) is refused; no line advises weights_only=False."""
    def refusal(path) -> str:
        with pytest.raises(CheckpointError) as err:
            torch_load(str(path))
        assert "\n" not in str(err.value) and "weights_only" not in str(err.value)
        return str(err.value)

    cut, old, garbled, proto4 = (tmp_path / f"{n}.pt" for n in ("cut", "old", "garbled", "proto4"))
    torch.save({"w": torch.ones(2)}, cut)
    os.truncate(cut, cut.stat().st_size // 2)
    assert refusal(cut).startswith(f"checkpoint file unreadable (truncated or corrupt): {cut} (RuntimeError: ")
    torch.save({"w": torch.ones(2)}, old, _use_new_zipfile_serialization=False)
    whole = old.read_bytes()
    old.write_bytes(whole[:whole.index(b"_rebuild_tensor") + 8])  # inside the name of a global torch allows
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global: GLOBAL torch._utils._rebui"):
        torch.load(old, weights_only=True)  # what the cut reads as to torch
    assert refusal(old) == (f"checkpoint file unreadable (truncated or corrupt): {old} "
                            "(pickle ValueError: no newline found when trying to read stringnl)")
    garbled.write_bytes(b"\xf2" + bytes(99))
    assert refusal(garbled).startswith(f"checkpoint file unreadable (truncated or corrupt): {garbled} (pickle ")
    torch.save({"w": torch.ones(2)}, proto4, pickle_protocol=4)
    assert refusal(proto4) == (f"checkpoint file refused unread: {proto4} holds objects outside DeepSpeed's "
                               "checkpoint contents (pickle instructions torch's weights-only reader refuses); "
                               "unpickling it could run code")


def _rss_file() -> int:
    """This process's resident pages of mapped files (RssFile), bytes."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("RssFile:"))


ENTRY = 4 * 2**20   # values of each partition's tensors in the file below (16 MiB as fp32)
SLACK = 4 * 2**20   # RssFile also counts the pages of shared libraries that run for the first time


def _optimizer_file(path, partitions: int = 6) -> list[dict]:
    """A ZeRO-1/2 optimizer file of `partitions` flat partitions (fp32 master, two fp32 moments each), as DeepSpeed
    saves one; returns the states written."""
    torch.manual_seed(0)
    states = [{"step": torch.tensor(3.0), "exp_avg": torch.randn(ENTRY), "exp_avg_sq": torch.rand(ENTRY)}
              for _ in range(partitions)]
    osd = {"base_optimizer_state": {"state": dict(enumerate(states)), "param_groups": [GROUP]},
           "single_partition_of_fp32_groups": [torch.randn(ENTRY) for _ in range(partitions)]}
    torch.save({"optimizer_state_dict": osd, "ds_version": "0.19.8"}, path)
    return states


def test_a_mapped_optimizer_file_keeps_one_entry_resident_as_a_load_copies_it(tmp_path):
    """files.read_mapped: the file is mapped, not read, and a load that copies its entries into place in turn (as
    DeepSpeed's and CoatAdamW's do: states by items(), masters by iterating the list) leaves one entry's pages
    resident at a time, not the file's (96 MiB here); every value arrives as saved, and one read again after its pages
    were dropped is still the file's."""
    from coat_ds.deepspeed.checkpoint.files import read_mapped

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    saved = _optimizer_file(path)
    base = _rss_file()
    osd = read_mapped(str(path))["optimizer_state_dict"]
    assert _rss_file() - base < SLACK                      # mapped: nothing read yet
    state, flats = osd["base_optimizer_state"]["state"], osd["single_partition_of_fp32_groups"]
    into = {k: torch.empty(ENTRY) for k in ("exp_avg", "exp_avg_sq")}
    resident = []
    for i, st in state.items():                             # CoatAdamW's load_state_dict
        for key, dst in into.items():
            dst.copy_(st[key])
            resident.append(_rss_file() - base)
        assert all(torch.equal(into[k], saved[i][k]) for k in into), i
    master = torch.empty(ENTRY)
    for i, flat in zip(range(len(flats)), flats):             # DeepSpeed's copy of the saved masters
        master.copy_(flat)
        resident.append(_rss_file() - base)
    assert max(resident) <= 2 * 4 * ENTRY + SLACK, [r / 2**20 for r in resident]   # this tensor and the last
    assert _rss_file() - base <= 4 * ENTRY + SLACK
    assert torch.equal(state[0]["exp_avg"], saved[0]["exp_avg"])   # dropped, read again: the file's values


def test_release_leaves_anything_but_the_mapped_file_alone(tmp_path):
    """release() drops pages only inside the given file's mapping: a heap tensor, or one of another file, keeps its
    values (MADV_DONTNEED on anonymous memory would zero them)."""
    from coat_ds.deepspeed.checkpoint.files import mapped_ranges, release

    path = tmp_path / "a.pt"
    torch.save({"t": torch.randn(ENTRY)}, path)
    mapped = torch_load(str(path), mmap=True)["t"]
    ranges = mapped_ranges(str(path))
    assert ranges and any(lo <= mapped.data_ptr() < hi for lo, hi in ranges)
    heap = torch.randn(ENTRY)
    want = heap.clone()
    release([heap, {"x": heap}], ranges)
    assert torch.equal(heap, want)
    before = _rss_file()
    mapped.sum()                                             # read: resident
    assert _rss_file() - before >= 0.9 * 4 * ENTRY
    release(mapped, ranges)
    assert _rss_file() - before < 0.1 * 4 * ENTRY            # dropped again
    assert torch.equal(mapped, torch_load(str(path))["t"])
