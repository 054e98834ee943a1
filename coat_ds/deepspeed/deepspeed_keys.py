"""DeepSpeed's own keys of a config, checked by DeepSpeed's own parser before anything is built (one line each).

Why: DeepSpeed ignores a top-level key it does not know (`"zero_optimzation"`: the job trains at ZeRO-0, without a
word), and refuses a bad value only inside deepspeed.initialize, after the model and the data have loaded, as a
traceback (two pydantic ones for `"bf16": {"enable": true}`, an AssertionError for a micro-batch of 0).

How, with DeepSpeed as the source of every rule: check() runs DeepSpeed's parser, `DeepSpeedConfig`, on the config
and says in one line what it refuses; its pydantic section models (zero_optimization, bf16, fp16, the monitors, ...)
name unknown and ill-typed keys. A top-level key is known when that parser reads it (recorded as it reads), so a key
is refused exactly when DeepSpeed would ignore it. `optimizer` and `scheduler`, which it hands on whole, are checked
against its constants (their keys, its optimizer names) and its scheduler class's signature. DeepSpeed is imported
inside the functions (check.py, config.py import this module without it).
"""
from __future__ import annotations

import collections.abc
import difflib
import functools
import inspect
import logging
import os
import typing
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

from ..keys import unknown_key

AUTO = "auto"   # HF Trainer / accelerate fill "auto" values themselves
_PARSING: ContextVar[bool] = ContextVar("coat_parsing_keys", default=False)
# read by deepspeed.initialize itself, before its parser (a mesh of data x sequence parallelism)
INITIALIZE_KEYS = ("sequence_parallel_size", "data_parallel_size")


class _Reads(dict):
    """A config that records every top-level key read from it: `x in d`, `d[x]`, `d.get(x)`, `x in d.keys()`."""

    def __init__(self, d: Mapping) -> None:
        super().__init__(d)
        self.read: list = []

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.read.append(key)
        return super().__contains__(key)

    def keys(self):
        return collections.abc.KeysView(self)

    def pop(self, key, *default):
        self.read.append(key)
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self.read.append(key)
        return super().setdefault(key, default)

    def __copy__(self) -> "_Reads":   # DeepSpeedConfig parses a copy.copy of the dict: keep recording
        return self


@contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed's logger above its info and warning lines: the engine's own parse says them again."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _parse(cfg: Mapping, world_size: int) -> tuple[list, Exception | None]:
    """DeepSpeedConfig(cfg) at `world_size`: (the top-level keys it read, what it raised or None)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class _AtWorldSize(DeepSpeedConfig):
        """Before torch.distributed is up DeepSpeed takes a world of 1; its batch rule (train_batch_size = micro-batch
        x accumulation x world size) is checked at the launcher's."""

        def _initialize_params(self, param_dict):
            self.world_size = world_size
            super()._initialize_params(param_dict)

    reads = _Reads(cfg)
    token = _PARSING.set(True)
    try:
        with _quiet():
            _AtWorldSize(reads)
        return reads.read, None
    except Exception as exc:  # noqa: BLE001 - whatever DeepSpeed's parser raises is its refusal, said in one line
        return reads.read, exc
    finally:
        _PARSING.reset(token)


def parsing() -> bool:
    """Whether DeepSpeed's parser now runs for this module's check (the check of a config it parses is this one)."""
    return _PARSING.get()


@functools.cache
def _always_read() -> frozenset:
    """The top-level keys DeepSpeed's parser reads of any config (a minimal one); a config's own parse adds those it
    reads only there (its deprecated forms)."""
    from deepspeed.runtime.constants import TRAIN_BATCH_SIZE

    return frozenset(_parse({TRAIN_BATCH_SIZE: 1}, 1)[0])


def nearest(key: object, allowed: typing.Iterable[str]) -> str | None:
    found = difflib.get_close_matches(str(key), list(allowed), n=1)
    return found[0] if found else None


def unknown(path: str, key: object, allowed: typing.Iterable[str]) -> str:
    """keys.unknown_key's line, then the nearest allowed key where one is close (difflib)."""
    allowed = sorted(allowed)
    near = nearest(key, allowed)
    return unknown_key(path, key, allowed) + (f"; nearest allowed: {near!r}" if near else "")


def _autos(obj: Any, path: str) -> Iterator[str]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _autos(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _autos(v, f"{path}[{i}]")
    elif obj == AUTO:
        yield path


def _check_batch(cfg: Mapping, hf_auto: bool) -> None:
    """DeepSpeed's batch rule (each > 0), said with the key: its own assert names the train batch for a micro-batch."""
    from deepspeed.runtime import constants as c

    for key in (c.TRAIN_BATCH_SIZE, c.TRAIN_MICRO_BATCH_SIZE_PER_GPU, c.GRADIENT_ACCUMULATION_STEPS):
        v = cfg.get(key)
        if v is None or (hf_auto and v == AUTO):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key}={v!r} is invalid; allowed: an integer >= 1" +
                             (" or \"auto\" (HF Trainer fills it)" if hf_auto else ""))


def _parsed_form(cfg: Mapping, hf_auto: bool) -> dict:
    """What DeepSpeed's parser is given: the config after HF Trainer has filled its top-level "auto" values, and with
    a micro-batch where the config has no batch size (the main job and HF Trainer set one; any integer will do: the
    values present are checked). DeepSpeed's section models drop the nested "auto" values themselves."""
    from deepspeed.runtime.constants import TRAIN_BATCH_SIZE, TRAIN_MICRO_BATCH_SIZE_PER_GPU

    out = {k: v for k, v in cfg.items() if not (hf_auto and v == AUTO)}
    if TRAIN_BATCH_SIZE not in out and TRAIN_MICRO_BATCH_SIZE_PER_GPU not in out:
        out[TRAIN_MICRO_BATCH_SIZE_PER_GPU] = 1
    return out


def _section_of(cfg: Mapping, reads: list, loc: tuple) -> str:
    """The top-level key whose value a pydantic error's `loc` lies in: the last present one the parser read, or none
    for a model that takes several top-level keys at once (the monitors: loc starts with the key)."""
    present = [k for k in reads if k in cfg]
    last = present[-1] if present else ""
    section = cfg.get(last)
    if loc and str(loc[0]) in cfg and not (isinstance(section, Mapping) and loc[0] in section):
        return ""
    return last


def _model_named(title: str) -> type | None:
    """The DeepSpeedConfigModel subclass a pydantic ValidationError names."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    todo = [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        if cls.__name__ == title:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def pydantic_line(prefix: str, model: type | None, err: dict) -> str:
    """One pydantic error as `key=value is invalid; allowed: ...` (an unknown key: unknown())."""
    parts = tuple(str(p) for p in (prefix, *err["loc"]) if p != "")
    key = ".".join(parts)
    if err["type"] == "extra_forbidden" and model is not None:
        return unknown(".".join(parts[:-1]), parts[-1], fields(model, tuple(err["loc"][:-1])))
    cause = (err.get("ctx") or {}).get("error")
    msg = (str(cause) if cause is not None else err["msg"]).replace("Input should be ", "allowed: ")
    return f"{key}={err['input']!r} is invalid; {msg}" if err["loc"] else f"{key}: {msg}"


def fields(model: type, path: tuple) -> list[str]:
    """The current (not deprecated) keys of the pydantic model reached from `model` along `path`."""
    for name in path:
        ann = next(f for n, f in model.model_fields.items() if name in (n, f.alias)).annotation
        model = next(a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and hasattr(a, "model_fields"))
    return sorted(f.alias or n for n, f in model.model_fields.items()
                  if not (f.json_schema_extra or {}).get("deprecated"))


def _refusal(cfg: Mapping, reads: list, exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return pydantic_line(_section_of(cfg, reads, err["loc"]), _model_named(exc.title), err)
    msg = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"DeepSpeed refuses this config: {msg}"


def _section(cfg: Mapping, key: str, params_key: str, allowed: tuple) -> Mapping | None:
    """cfg[key] where it is an object of `allowed` keys (None where absent); a one-line refusal otherwise."""
    section = cfg.get(key)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f"{key}={section!r} is invalid; allowed: an object with \"{allowed[0]}\" and \"{params_key}\"")
    for k in section:
        if k not in allowed:
            raise ValueError(unknown(key, k, allowed))
    return section


def _check_optimizer_section(cfg: Mapping) -> None:
    """optimizer: DeepSpeed's keys, and a name that its engine finds (its own optimizers, or torch.optim's)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.constants import LEGACY_FUSION, OPTIMIZER, OPTIMIZER_PARAMS, TYPE

    opt = _section(cfg, OPTIMIZER, OPTIMIZER_PARAMS, (TYPE, OPTIMIZER_PARAMS, LEGACY_FUSION))
    if opt is None:
        return
    name = opt.get(TYPE)
    if not isinstance(name, str) or not (name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name)):
        choices = sorted(DEEPSPEED_OPTIMIZERS) + ["CoatAdamW"]
        near = nearest(name, choices + [n for n in dir(torch.optim) if n[:1].isupper()])
        raise ValueError(f"{OPTIMIZER}.{TYPE}={name!r} is invalid" + (f"; nearest allowed: {near!r}" if near else "") +
                         f"; allowed: one of DeepSpeed's {choices} or a torch.optim class name")
    params = opt.get(OPTIMIZER_PARAMS, {})
    if not isinstance(params, Mapping):
        raise ValueError(f"{OPTIMIZER}.{OPTIMIZER_PARAMS}={params!r} is invalid; allowed: an object of the "
                         "optimizer's arguments")


def _check_scheduler_section(cfg: Mapping) -> None:
    """scheduler: DeepSpeed's keys, a scheduler its engine finds, and params its class takes (its signature)."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.constants import SCHEDULER, SCHEDULER_PARAMS, TYPE

    sched = _section(cfg, SCHEDULER, SCHEDULER_PARAMS, (TYPE, SCHEDULER_PARAMS))
    if sched is None:
        return
    name = sched.get(TYPE)
    cls = None
    if isinstance(name, str):
        cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
    if not inspect.isclass(cls):
        near = nearest(name, lr_schedules.VALID_LR_SCHEDULES)
        raise ValueError(f"{SCHEDULER}.{TYPE}={name!r} is invalid" + (f"; nearest allowed: {near!r}" if near else "") +
                         f"; allowed: one of DeepSpeed's {lr_schedules.VALID_LR_SCHEDULES} or a "
                         "torch.optim.lr_scheduler class name")
    params = sched.get(SCHEDULER_PARAMS, {})
    if not isinstance(params, Mapping):
        raise ValueError(f"{SCHEDULER}.{SCHEDULER_PARAMS}={params!r} is invalid; allowed: an object of {name}'s "
                         "arguments")
    sig = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in sig.values()):
        return
    allowed = [n for n, p in sig.items() if n != "optimizer" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in params:
        if key not in allowed:
            raise ValueError(unknown(f"{SCHEDULER}.{SCHEDULER_PARAMS}", key, allowed) + f" (the arguments of {name})")


def check(cfg: Mapping, *, hf_auto: bool = False, world_size: int | None = None, ours: tuple = ()) -> None:
    """Raise ValueError, one line naming the key and what is allowed, where DeepSpeed would refuse `cfg` or ignore one
    of its keys. `hf_auto`: "auto" values are HF Trainer's to fill (elsewhere DeepSpeed drops them silently or fails
    on them, so they are refused); `world_size`: the job's (default: the launcher's WORLD_SIZE); `ours`: top-level
    keys that are not DeepSpeed's but read by coat_ds."""
    if not hf_auto:
        for path in _autos({k: v for k, v in cfg.items() if k not in ours}, ""):
            raise ValueError(f"{path}='auto' is invalid here; allowed: a value (\"auto\" is HF Trainer's to fill; "
                             "DeepSpeed drops it or fails on it)")
    _check_batch(cfg, hf_auto)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    reads, exc = _parse(_parsed_form({k: v for k, v in cfg.items() if k not in ours}, hf_auto), world)
    known = _always_read() | set(reads) | set(INITIALIZE_KEYS)
    for key in cfg:
        if key not in known and key not in ours:
            near = nearest(key, sorted(known | set(ours)))
            allowed = "the keys DeepSpeed's config parser reads" + "".join(f", and {k!r}" for k in ours)
            raise ValueError(f"{key}: unknown top-level key, which DeepSpeed would ignore; " +
                             (f"nearest allowed: {near!r} (allowed: {allowed})" if near else
                              f"allowed: {allowed}: {sorted(known | set(ours))}"))
    if exc is not None:
        raise ValueError(_refusal(cfg, reads, exc)) from None
    _check_optimizer_section(cfg)
    _check_scheduler_section(cfg)
