"""Quantization groups that do not move when DeepSpeed partitions a parameter.

ZeRO hands CoatAdamW one flat fp32 tensor per rank holding pieces of many parameters, cut at
partition boundaries that fall anywhere. If groups ran along that flat tensor, results would depend
on the world size. Instead a group is always G consecutive values of one flattened *parameter*,
counted from the parameter's start: the groups of a stage-0 run on one rank. A rank keeps, per piece
of parameter it owns, FP8 codes for its elements and a (scale, exponent) per group the piece touches.

A group that a partition boundary cuts ("cut group") lives on two (or more) ranks. Before the step
the ranks swap their parts of it (fp32 master, gradient, codes: at most G-1 values each way), so
every rank owning a part runs the ordinary step on the whole group and keeps its own part. The
group's scale and exponent are then identical on every owner, and the arithmetic per group is the
one a single rank does: same groups, same inputs, same function.
"""
from __future__ import annotations

import bisect
import zlib
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from ... import kernels
from ...formats import Fp8Moment, get_format, join_remainder, split_remainder
from ...optim.coat_adamw import fp8_moments, fp8_zeros

Key = tuple  # (parameter name, group index)
SR_SEED = 0  # stochastic rounding's bits are keyed by (SR_SEED, step, parameter, position): see formats.rounding


def stream_of(name: str) -> int:
    """The random stream of a parameter for stochastic rounding: a 31-bit hash of its name, the same on every rank."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


class FlatPieces:
    """A flat partition given as consecutive tensors, read where they lie: ZeRO's gradient partition is one
    view per parameter piece (and padding) in its reduction buffer, not one flat tensor."""

    def __init__(self, tensors) -> None:
        self.tensors = [t.reshape(-1) for t in tensors]
        self.starts, n = [], 0
        for t in self.tensors:
            self.starts.append(n)
            n += t.numel()
        self.numel = n

    def narrow(self, start: int, n: int) -> torch.Tensor:
        """Values start..start+n-1, which must lie in one piece (parameter pieces never straddle)."""
        k = bisect.bisect_right(self.starts, start) - 1
        off = start - self.starts[k]
        if off + n > self.tensors[k].numel():
            raise ValueError(f"FlatPieces: values {start}..{start + n - 1} straddle two pieces")
        return self.tensors[k].narrow(0, off, n)

    def nonfinite(self) -> torch.Tensor:
        """1.0 if some value is inf/NaN, else 0.0 (sums: no N-sized bool temporary, 40x faster than isfinite on CPUs)."""
        sums = torch.stack([t.sum().float() for t in self.tensors if t.numel()])
        return sums.sum().isfinite().logical_not().float()


@dataclass(frozen=True)
class Segment:
    """The piece of one parameter that lies in a rank's flat partition."""
    name: str  # parameter name, the same on every rank
    param_numel: int
    param_start: int  # offset of the piece in the flattened parameter
    flat_start: int  # offset of the piece in the rank's flat fp32 partition
    numel: int

    def groups(self, g: int) -> range:
        return range(self.param_start // g, (self.param_start + self.numel - 1) // g + 1)

    def covers(self, j: int, g: int) -> bool:
        """Whether this piece holds all of group j."""
        return j * g >= self.param_start and min((j + 1) * g, self.param_numel) <= self.param_start + self.numel

    def cut(self, g: int) -> list[int]:
        """The groups this piece holds only part of: at most its first and its last (the ones between are whole),
        found without walking the groups (a 70B partition holds 1e8 of them per rank)."""
        js = self.groups(g)
        ends = [js[0]] if len(js) == 1 else [js[0], js[-1]] if len(js) else []
        return [j for j in ends if not self.covers(j, g)]

    def piece(self, moment: Fp8Moment, meta: int) -> Fp8Moment:
        """This piece of the parameter in a partition's moment whose metadata holds the piece's groups from `meta`."""
        return moment.piece(self.flat_start, self.numel, meta, self.param_start % moment.group_size)


def meta_offsets(segments: list[Segment], g: int) -> list[int]:
    """Where each segment's groups start in its partition's metadata (segments in flat order)."""
    out, meta = [], 0
    for s in segments:
        out.append(meta)
        meta += len(s.groups(g))
    return out


def local_cut_keys(segments: list[Segment], g: int) -> list[Key]:
    return [(s.name, j) for s in segments for j in s.cut(g)]


class ShardLayout:
    """Where each group of a rank's flat partition lives, and the step that keeps groups whole.

    `cut_index` numbers the cut groups of *all* ranks the same way on every rank (see bind.py)."""

    def __init__(self, segments: list[Segment], flat_numel: int, group_size: int, process_group=None,
                 cut_index: dict[Key, int] | None = None, comm_device: str | torch.device = "cpu",
                 stochastic: bool = False, remainder: torch.Tensor | None = None) -> None:
        self.segments = sorted(segments, key=lambda s: s.flat_start)
        self.stochastic = stochastic  # a bf16 master is rounded stochastically (else to nearest)
        # int16, one per value of the flat partition: the low halves of an exact fp32 master whose high halves
        # are the bf16 flat partition itself (coat.master_weights 'fp32_remainder'), or None
        self.remainder = remainder
        self.flat_numel = flat_numel
        self.group_size = group_size
        self.process_group = process_group
        self.cut_index = cut_index or {}
        self.comm_device = torch.device(comm_device)
        g = group_size
        self.bodies: list[tuple[int, int, int]] = []  # (flat start, numel, first meta index)
        self.cuts: list[tuple[int, int, int, int, int]] = []  # (global cut id, meta index, flat start, pos, numel)
        body_keys, cut_keys = [], []  # (stream, offset in the parameter) of each tensor the step hands the kernel
        meta = 0
        for s in self.segments:
            js, cut = s.groups(g), s.cut(g)
            first, last = (js[0] + (js[0] in cut), js[-1] - (js[-1] in cut)) if len(js) else (0, -1)
            if first <= last:  # whole groups are consecutive: one contiguous run
                start = first * g
                end = min((last + 1) * g, s.param_numel)
                self.bodies.append((s.flat_start + start - s.param_start, end - start, meta + first - js[0]))
                body_keys.append((stream_of(s.name), start))
            for j in cut:
                lo = max(j * g, s.param_start)
                hi = min((j + 1) * g, s.param_numel, s.param_start + s.numel)
                self.cuts.append((self.cut_index[(s.name, j)], meta + j - js[0], s.flat_start + lo - s.param_start,
                                  lo - j * g, hi - lo))
                cut_keys.append((stream_of(s.name), j * g))
            meta += len(js)
        self.n_meta = meta
        self.sr_keys = body_keys + cut_keys
        self.home = None  # (HostStates, sub-group) where coat.states 'host' keeps this partition's moments (states.py)

    def record(self) -> list[tuple]:
        """Plain-data description saved with the optimizer state (checkpoints re-partition from it):
        each segment's fields as a tuple, `Segment(*t)` reads one back."""
        return [astuple(s) for s in self.segments]

    # ---------------------------------------------------------------- the master
    def master(self, flat: torch.Tensor) -> torch.Tensor:
        """The fp32 master of the flat partition: flat itself, or its high halves joined with the remainders."""
        return flat if self.remainder is None else join_remainder(flat.view(-1), self.remainder).view(flat.shape)

    def write_master(self, flat: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """Write fp32 master values into flat from `start` (split into high halves and remainders if kept so)."""
        n = values.numel()
        values = values.reshape(-1).to(flat.device)
        if self.remainder is None:
            flat.view(-1)[start:start + n] = values
            return
        hi, lo = split_remainder(values.float())
        flat.view(-1)[start:start + n] = hi
        self.remainder[start:start + n] = lo

    # ---------------------------------------------------------------- the step
    def master_at(self, flat: torch.Tensor, start: int, n: int) -> torch.Tensor:
        """fp32 master values start..start+n-1 of flat (joined with their remainders if kept so)."""
        hi = flat.view(-1).narrow(0, start, n)
        return hi if self.remainder is None else join_remainder(hi, self.remainder.narrow(0, start, n))

    def _exchange(self, p: torch.Tensor, grads: "FlatPieces", mq: torch.Tensor, vq: torch.Tensor,
                  check: bool) -> tuple:
        """Whole cut groups (master, grad, m codes, v codes) on every owner, and whether any rank saw inf/NaN
        (asked only when `check`, the one host read; with nothing to swap and nothing to check there is no
        collective)."""
        g = self.group_size
        n_cut = len(self.cut_index)
        if n_cut == 0 and not check:
            return None, False
        buf = torch.zeros(n_cut * 4 * g + 1, dtype=torch.float32, device=p.device)
        rows = buf[:-1].view(n_cut, 4, g)
        for cid, _, flat, pos, n in self.cuts:
            rows[cid, 0, pos:pos + n] = self.master_at(p, flat, n)
            rows[cid, 1, pos:pos + n] = grads.narrow(flat, n)
            rows[cid, 2, pos:pos + n] = mq.view(torch.uint8)[flat:flat + n].float()
            rows[cid, 3, pos:pos + n] = vq.view(torch.uint8)[flat:flat + n].float()
        if check:
            buf[-1] = grads.nonfinite()
        if self.process_group is not None and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            moved = buf.to(self.comm_device)
            dist.all_reduce(moved, group=self.process_group)  # parts are disjoint: the sum is exact,
            buf = moved.to(p.device)
            rows = buf[:-1].view(n_cut, 4, g)
            for cid, _, flat, pos, n in self.cuts:  # but for -0.0 + 0.0: this rank's own masters, bit for bit
                rows[cid, 0, pos:pos + n] = self.master_at(p, flat, n)
        return rows, check and bool(buf[-1] > 0)

    def _body_views(self, flat: torch.Tensor, m_all: Fp8Moment, v_all: Fp8Moment) -> tuple[list, list, list]:
        """Per-parameter views of the partition and its states, made once while their storage stays.

        A ZeRO partition holds hundreds of parameters: narrowing each of them afresh every step cost
        more than the fused kernel itself (2.2 ms of host time per step for 200 parameters)."""
        key = tuple(t.data_ptr() for t in (flat, *m_all.tensors, *v_all.tensors))
        if getattr(self, "_views_key", None) != key:
            params, m, v = [], [], []
            for start, n, meta in self.bodies:  # whole groups: pieces that start at a group's start
                params.append(flat.narrow(0, start, n))
                m.append(m_all.piece(start, n, meta, 0).tensors)
                v.append(v_all.piece(start, n, meta, 0).tensors)
            self._views_key, self._views = key, (params, m, v)
        params, m, v = self._views
        return list(params), list(m), list(v)

    @torch.no_grad()
    def step(self, opt, p: torch.Tensor, group: dict, step: int, grad, *, grad_scale=None,
             lp_out: torch.Tensor | None = None, finite: bool | None = None) -> bool:
        """One CoatAdamW step on the flat partition p; False (nothing changed) if any rank's gradient is not finite.

        grad: a flat tensor or FlatPieces (any dtype; the gradient is never copied whole); grad_scale
        multiplies it in fp32 inside the kernel (DeepSpeed's unscale and clip; a non-finite one: the kernel
        changes nothing and the copies below write back what is there, with no host read); lp_out: the model's copy
        of the partition, written by the kernel (bf16) or copied after; finite: True when the caller knows
        every rank's gradient is finite (the check and its collective are skipped)."""
        g = group["group_size"]
        if g != self.group_size:
            raise ValueError(f"CoatAdamW: group_size changed from {self.group_size} to {g} after DeepSpeed "
                             "partitioned the optimizer; allowed: the value the engine was built with")
        grads = grad if isinstance(grad, FlatPieces) else FlatPieces([grad])
        m_all, v_all = fp8_moments(opt.state[p] if self.home is None else self.home[0].window(self.home[1]), group)
        flat, mq, vq = p.view(-1), m_all.codes.view(-1), v_all.codes.view(-1)
        rows, bad = self._exchange(flat, grads, mq, vq, check=not finite)
        if bad:
            return False
        params, m, v = self._body_views(flat, m_all, v_all)
        # the gradient is a fresh tensor each step under ZeRO: views kept past the step would keep it alive
        grad_list = [grads.narrow(start, n) for start, n, _ in self.bodies]
        in_kernel = lp_out is not None and lp_out.dtype == torch.bfloat16 and flat.dtype == torch.float32
        outs = [lp_out.view(-1).narrow(0, start, n) for start, n, _ in self.bodies] if in_kernel else []
        rem = self.remainder
        rems = [] if rem is None else [rem.narrow(0, start, n) for start, n, _ in self.bodies]
        whole = []
        for cid, meta, start, pos, n in self.cuts:  # one tensor of exactly G values per cut group
            # (a remainder master's cut group steps as an fp32 master: the same arithmetic, split below)
            pc = rows[cid, 0].to(flat.dtype if rem is None else torch.float32, copy=True)
            gc = rows[cid, 1].clone()
            mc = rows[cid, 2].to(torch.uint8).view(mq.dtype)
            vc = rows[cid, 3].to(torch.uint8).view(vq.dtype)
            params.append(pc)
            grad_list.append(gc)
            m.append((mc, m_all.scale.narrow(0, meta, 1), m_all.expo.narrow(0, meta, 1)))
            v.append((vc, v_all.scale.narrow(0, meta, 1), v_all.expo.narrow(0, meta, 1)))
            if in_kernel:  # holding this rank's weights: a skipped kernel (non-finite grad_scale) copies them back
                outs.append(torch.zeros(g, dtype=torch.bfloat16, device=flat.device))
                outs[-1][pos:pos + n] = lp_out.view(-1)[start:start + n]
            whole.append((pc, mc, vc, outs[-1] if in_kernel else None))
            if rem is not None:
                rems.append(None)
        beta1, beta2 = group["betas"]
        sr = self.stochastic and flat.dtype == torch.bfloat16
        kernels.adamw_step(params, grad_list, m, v, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                           eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                           v_format=get_format(group["v_format"]), group_size=g, expansion=group["expansion"],
                           bf16_out=outs, grad_scale=grad_scale, sr_keys=self.sr_keys if sr else None,
                           sr_seed=SR_SEED, remainders=rems)
        for (_, _, start, pos, n), (pc, mc, vc, oc) in zip(self.cuts, whole):
            self.write_master(flat, start, pc[pos:pos + n])
            mq[start:start + n] = mc[pos:pos + n]
            vq[start:start + n] = vc[pos:pos + n]
            if in_kernel:  # the kernel's bf16 copy (its rounding, not a cast's)
                lp_out.view(-1)[start:start + n] = oc[pos:pos + n]
        if lp_out is not None and not in_kernel:
            lp_out.copy_(p)
        return True

    def init_state(self, p: torch.Tensor, group: dict) -> dict:
        """A fresh state of the flat partition p: codes per value, metadata per group each piece touches."""
        if self.home is not None:
            return self.home[0].fresh(self.home[1])
        return fp8_zeros(p.shape, group, p.device, self.n_meta)

    def place_state(self, p: torch.Tensor, saved: dict) -> dict:
        """A loaded state of p where this partition keeps it: beside p, or in its host block (codes bit for bit)."""
        if self.home is not None:
            return self.home[0].adopt(self.home[1], saved)
        return {k: v.clone() if k == "step" else v.to(device=p.device, copy=True) for k, v in saved.items()}

