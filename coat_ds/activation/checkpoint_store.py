"""coat.activation.checkpoint_store: where the input of a recomputed decoder layer waits for its backward.

torch's non-reentrant checkpoint keeps the layer's tensor inputs through the saved-tensor hooks active when the
checkpoint starts (torch 2.13: `_CheckpointFrame.save_inputs`; 2.5-2.12: `_NoopSaveInputs.save_for_backward`),
and everything the layer saves inside through its own inner hooks. So hooks around the call see the inputs alone:
here the hidden states (HF passes the mask and the rotary cos/sin, shared by every layer, as keyword arguments,
which the checkpoint keeps by reference). "gpu" keeps the bf16 tensor (2 B/token/hidden: 256 KB a token over
Llama-8B's 32 x 4096); "gpu_fp8" keeps it in the FP8 flow's per-group format (attention_fp8's quantizer,
attention.quant_heads: E4M3, one power-of-two exponent per 1 x group_size, 1 + 1/G B); "host_fp8" copies those to
pinned host memory on a copy stream as the forward goes (nothing stays on the GPU) and back on another one layer
ahead of backward: the input before a layer's starts its copy back once that layer's recompute has ended (its codes
then wait beside the layer's backward, not beside its recompute, the step's peak at a long sequence). The
recompute runs on the dequantized input: gradients move by what E4M3 rounding of the input moves.

Without CUDA the host path is the same with plain buffers and synchronous copies."""
from __future__ import annotations

import bisect
import contextlib
import functools
import mmap
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..formats import FP8Format, get_format
from .attention import dequant_heads, quant_heads
from .config import CHECKPOINT_STORES, ActivationConfig

_REPLAY = threading.local()


def recomputing() -> bool:
    """Whether this thread is running a checkpointed layer again in backward (`CHECKPOINT`'s recompute), whose
    output is thrown away: only what the layer saves is used."""
    return getattr(_REPLAY, "on", False)


@contextlib.contextmanager
def _replaying() -> Iterator[None]:
    was, _REPLAY.on = recomputing(), True
    try:
        yield
    finally:
        _REPLAY.on = was


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch's context_fn: (around the forward, around the recompute)."""
    return contextlib.nullcontext(), _replaying()


# Non-reentrant, so ZeRO-3 re-gathers the layer's parameters in backward and the RNG state is restored for the
# replay (torch's preserve_rng_state: dropout draws the same mask); its recompute marked (`recomputing`). The
# "gpu" store is this function itself.
CHECKPOINT = functools.partial(checkpoint, use_reentrant=False, context_fn=_contexts)
GPU, GPU_FP8, HOST_FP8 = CHECKPOINT_STORES
# Smaller tensors stay as they are: their exponents and a copy's launch would cost more than they save (and
# torch 2.5-2.12 saves an empty dummy beside the inputs).
MIN_NUMEL = 1024


def function(cfg: ActivationConfig) -> Callable[..., Any]:
    """The checkpoint function of a layer with config `cfg`: torch's own for "gpu", else the store's (one store
    per format and group size, shared by every layer, so each prefetches the one packed before it)."""
    if cfg.checkpoint_store == GPU:
        return CHECKPOINT
    return _store(cfg.checkpoint_store == HOST_FP8, cfg.fwd_format, cfg.group_size)


def owned(fn: Any) -> bool:
    """Whether `fn` is one of the checkpoint functions `function` gives: coat's, which a stock layer given back by
    revert must not inherit (HF's own gradient_checkpointing_enable() function is not)."""
    return fn is CHECKPOINT or isinstance(fn, Fp8Store)


@functools.lru_cache(maxsize=None)
def _store(host: bool, fmt: str, group_size: int) -> "Fp8Store":
    return Fp8Store(host, fmt, group_size)


class Packed:
    """A layer input in FP8: codes and exponents on the device (`codes`, `sexp`: quant_heads' 2-D views, `layout`
    what dequant_heads needs), and for the host store both in one pool buffer (`lease`: the buffer, codes first,
    and the event of its last copy), given back to the pool when this dies. `prev`: the input packed before this
    one (weak)."""

    def __init__(self, t: Tensor, fmt: FP8Format, group_size: int, prev: Callable[[], "Packed | None"]) -> None:
        self.shape, self.device, self.prev = t.shape, t.device, prev
        with torch.no_grad():
            self.codes, self.sexp, self.layout = quant_heads(t.detach(), fmt, group_size)
        self.shapes = self.codes.shape, self.sexp.shape
        self.lease: list | None = None  # [host buffer, event of the last copy from or to it]
        self.ready: Any = None  # the H2D's event: the codes are on the device


class HostPool:
    """Host buffers reused across steps, each with the event of the last copy that touched it. CUDA's are pinned at
    their own size (cudaHostRegister: the caching host allocator rounds to powers of two), rounded up to a
    sixteenth of their power of two so that other sequence lengths reuse them; a request that no free buffer fits
    drops one free buffer, so the pool holds no more buffers than a step keeps at once."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: list[tuple[int, int, Tensor, Any]] = []  # (bytes, id, buffer, event), by size
        self.nbytes = 0  # every buffer's, free or leased

    def take(self, nbytes: int) -> list:
        """A lease [buffer of >= nbytes, event of its last copy or None]."""
        k = bisect.bisect_left(self.free, nbytes, key=lambda e: e[0])
        if k < len(self.free):
            return list(self.free.pop(k)[2:])
        if self.free:
            self._drop(self.free.pop(0))
        size = _rounded(nbytes)
        buf = _page_aligned(size)
        if self.pin:
            rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"coat.activation.checkpoint_store={HOST_FP8!r}: cudaHostRegister of {size} bytes "
                                   f"failed ({rc}); check `ulimit -l` (locked memory)")
        self.nbytes += size
        return [buf, None]

    def give(self, lease: list) -> None:
        buf, event = lease
        bisect.insort(self.free, (buf.numel(), id(buf), buf, event), key=lambda e: e[0])

    def _drop(self, entry: tuple[int, int, Tensor, Any]) -> None:
        size, _, buf, event = entry
        if self.pin:
            if event is not None:
                event.synchronize()
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self.nbytes -= size


def _rounded(n: int) -> int:
    """n rounded up to a sixteenth of its power of two, and to whole pages."""
    step = max(1 << max(n.bit_length() - 5, 0), mmap.PAGESIZE)
    return -(-n // step) * step


def _page_aligned(size: int) -> Tensor:
    """A host buffer of `size` bytes (whole pages) on pages of its own: two registered buffers never share one
    (a small allocation may come from the heap, beside another)."""
    raw = torch.empty(size + mmap.PAGESIZE, dtype=torch.uint8)
    start = -raw.data_ptr() % mmap.PAGESIZE
    return raw[start:start + size]


class Fp8Store:
    """The "gpu_fp8" (host False) or "host_fp8" store: a checkpoint function whose saved-tensor hooks keep a
    layer's hidden-state input in FP8 (module docstring)."""

    def __init__(self, host: bool, fmt: str, group_size: int) -> None:
        self.host, self.fmt, self.group_size = host, get_format(fmt), group_size
        self.name = HOST_FP8 if host else GPU_FP8
        self.last: Callable[[], Packed | None] = lambda: None  # the latest packed input (weak)
        self.packed = 0  # inputs packed so far (the check that torch's checkpoint saved through the hooks)
        self.pools: dict[bool, HostPool] = {}
        self.streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}  # (D2H, H2D)
        self.ahead: Callable[[], Packed | None] = lambda: None  # fetched once the running recompute ends (weak)

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """torch's checkpoint of fn(*args, **kwargs), its inputs saved through this store."""
        before = self.packed
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            out = CHECKPOINT(fn, *args, context_fn=self._contexts, **kwargs)
        if self.packed == before and torch.is_grad_enabled() and any(self.takes(a) for a in args):
            raise RuntimeError(f"coat.activation.checkpoint_store={self.name!r}: torch {torch.__version__}'s "
                               f"checkpoint saved the layer input past saved-tensor hooks; allowed here: {GPU!r}")
        return out

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """torch's context_fn: around the recompute, `recomputing` and then the fetch of the input packed before."""
        return contextlib.nullcontext(), self._recompute()

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        """torch's checkpoint ends a recompute early, by raising through this context, once the layer's last saved
        tensor is made (torch.utils.checkpoint's early stop): the fetch follows either end."""
        try:
            with _replaying():
                yield
        finally:
            ahead, self.ahead = self.ahead(), lambda: None
            if ahead is not None:
                self._fetch(ahead)  # its H2D overlaps this layer's backward

    def takes(self, t: Any) -> bool:
        """Whether the store keeps `t` in FP8: a floating tensor that backward differentiates through (the hidden
        states; a mask or the rotary cos/sin handed over positionally never is), of at least MIN_NUMEL, whose last
        dimension (the hidden one) divides into groups; anything else is kept as it is."""
        return (isinstance(t, Tensor) and t.is_floating_point() and t.requires_grad and t.dim() >= 2
                and t.numel() >= MIN_NUMEL and t.shape[-1] % self.group_size == 0)

    def host_bytes(self) -> int:
        """Host memory the store holds: every pool buffer, leased or free."""
        return sum(pool.nbytes for pool in self.pools.values())

    # ------------------------------------------------------------------ the hooks
    def pack(self, t: Tensor) -> Packed | Tensor:
        if not self.takes(t):
            return t
        p = Packed(t, self.fmt, self.group_size, self.last)
        if self.host:
            self._to_host(p)
        self.last = weakref.ref(p)
        self.packed += 1
        return p

    def unpack(self, p: Packed | Tensor) -> Tensor:
        if isinstance(p, Tensor):
            return p
        self._fetch(p)
        self.ahead = p.prev  # fetched when the recompute this unpack starts has ended (_recompute)
        if p.ready is not None:
            compute = torch.cuda.current_stream(p.device)
            compute.wait_event(p.ready)
            for t in (p.codes, p.sexp):
                t.record_stream(compute)  # allocated on the copy stream
            p.ready = None
        with torch.no_grad():
            out = dequant_heads(p.codes, p.sexp, p.layout)
        if self.host:  # the host copy stays until p dies (a second backward fetches it again)
            p.codes = p.sexp = None
        return out

    # ------------------------------------------------------------------ the copies
    def _to_host(self, p: Packed) -> None:
        """Codes and exponents into a pool buffer; their device memory reused only after the D2H has read it."""
        cuda = p.device.type == "cuda"
        pool = self.pools.setdefault(cuda, HostPool(pin=cuda))
        codes, sexp = p.codes.view(torch.uint8).view(-1), p.sexp.view(-1)
        p.lease = pool.take(codes.numel() + sexp.numel())
        weakref.finalize(p, pool.give, p.lease)
        p.codes = p.sexp = None
        pairs = zip((codes, sexp), _split(p.lease[0], codes.numel(), sexp.numel()))
        p.lease[1] = self._copy(list(pairs), p.device, h2d=False, after=p.lease[1])  # after the last H2D reading it

    def _fetch(self, p: Packed) -> None:
        """p's codes and exponents back on its device from its host buffer (nothing if they are there)."""
        if p.codes is not None or p.lease is None:
            return
        with self._stream(p.device, h2d=True):  # allocated on the copy stream: no wait for the compute stream's
            p.codes, p.sexp = _empty(p, self.fmt.dtype)
        dsts = (p.codes.view(torch.uint8).view(-1), p.sexp.view(-1))
        pairs = zip(_split(p.lease[0], dsts[0].numel(), dsts[1].numel()), dsts)
        p.ready = p.lease[1] = self._copy(list(pairs), p.device, h2d=True, after=p.lease[1])  # after the D2H

    def _copy(self, pairs: list[tuple[Tensor, Tensor]], device: torch.device, h2d: bool, after: Any) -> Any:
        """dst.copy_(src) for each pair; the event of their end. On CUDA on the direction's copy stream after event
        `after` (D2H also after the compute stream's work so far: the quantizer), each D2H source's memory reused
        only after its copy; elsewhere at once (no event)."""
        if device.type != "cuda":
            for src, dst in pairs:
                dst.copy_(src)
            return None
        stream = self._copy_stream(device, h2d)
        if not h2d:
            stream.wait_stream(torch.cuda.current_stream(device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
                if not h2d:
                    src.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _copy_stream(self, device: torch.device, h2d: bool) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self.streams[device][h2d]

    def _stream(self, device: torch.device, h2d: bool) -> Any:
        """The copy stream's context on CUDA, else nothing."""
        return torch.cuda.stream(self._copy_stream(device, h2d)) if device.type == "cuda" else contextlib.nullcontext()


def _empty(p: Packed, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Device tensors for p's codes and exponents (the current stream's)."""
    codes, sexp = p.shapes
    return torch.empty(codes, dtype=dtype, device=p.device), torch.empty(sexp, dtype=torch.uint8, device=p.device)


def _split(buf: Tensor, n_codes: int, n_sexp: int) -> tuple[Tensor, Tensor]:
    """The codes' and the exponents' parts of a host buffer."""
    return buf[:n_codes], buf[n_codes:n_codes + n_sexp]
