"""One launched DeepSpeed job for coat.states "host" at node scale (issue 57); results go to a JSON file.

    deepspeed --num_gpus N tests/ds_scripts/host_states_job.py --out r.json --ckpt DIR TASK [TASK ...]

The engines are ds_configs/zero3_offload_largest_model.json's settings (ZeRO-3, bf16, release, bf16_sr master,
states on the host, clipping 1.0) on tiny models, sub-groups of ~600 values, reduce buckets of 1,000.

TASK:
  node:3             this node's ranks counted by the ranks (node.local_ranks, with every launcher variable
                     removed from the environment) and by the launcher's environment
  refuse:3           COAT_DS_HOST_ROOT (set by the test: an empty folder) is this host's root for the memory reads
                     (node.py); emptied again after the task. An engine is
                     built with no memory file there (unknown: not refused), then with MemAvailable holding 2.3
                     ranks' states ("fits"), then 1.5 ranks' ("short"), then MemAvailable plenty and the cgroup's
                     room 1.5 ranks' ("cgroup"): each rank's outcome, and the host buffers it allocated (0: refused
                     before any)
  order:3[:moe]      "device" against "host" states, 12 steps in which the sub-groups' order changes: a branch unused
                     every third step (moe: four experts as modules and one 3D expert bank, experts with no tokens
                     on most steps): losses, every rank's masters and FP8 states equal; the orders seen. On CUDA the
                     copy-in stream is slowed by a spin kernel before each fetch, so that a copy back that does not
                     wait for its block's arrival reads the window before the block lands
  drop:3             (CUDA) three engines with ~1.1 GiB of host states each, each trained 2 steps then destroyed
                     (engine.destroy()) and dropped: the process's RSS after each, and whether each engine's host
                     buffers are still registered with CUDA after it
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import common  # noqa: E402
import job  # noqa: E402
from coat_ds import node  # noqa: E402
from coat_ds.launch.teardown import torn_down  # noqa: E402
from coat_ds.deepspeed.zero import states as coat_states  # noqa: E402
from release_job import states  # noqa: E402
from zero_state_job import _all, _joined  # noqa: E402

if torch.cuda.is_available():   # two GPU runs agree bit for bit only with deterministic algorithms
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
PRESET = Path(__file__).resolve().parents[2] / "ds_configs" / "zero3_offload_largest_model.json"
ORDER_STEPS, EXPERTS = 12, 4
IN, HID, OUT = common.IN, common.HID, common.OUT


def preset_config(world: int, states_where: str = "host") -> dict:
    """The host-states preset on a tiny model: its ZeRO-3 and "coat" settings, small sub-groups and buckets."""
    cfg = json.loads(PRESET.read_text())
    cfg.pop("scheduler")
    cfg["coat"].pop("activation")   # a plain torch model: no decoder layers to swap
    cfg["coat"]["states"] = states_where
    cfg["optimizer"]["params"].update(lr=3e-3, group_size=32)
    cfg["train_micro_batch_size_per_gpu"] = common.GLOBAL_BATCH // world
    cfg["zero_optimization"].update(sub_group_size=600, reduce_bucket_size=1000, allgather_bucket_size=1000,
                                    stage3_prefetch_bucket_size=1000, stage3_param_persistence_threshold=100)
    return cfg


class Branchy(nn.Module):
    """A branch after the third of six layers, unused every third step: backward reaches the sub-groups in another
    order (the branch's last, at engine.step(), after the layers below it, whose windows others have used since)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(IN, HID, bias=False)   # no biases: each weight a sub-group of its own
        self.layers = nn.ModuleList(nn.Linear(HID, HID, bias=False) for _ in range(5))
        self.branch, self.head = nn.Linear(HID, HID, bias=False), nn.Linear(HID, OUT, bias=False)
        self.step = 0

    def forward(self, x):
        h = nn.functional.gelu(self.first(x))
        for k, layer in enumerate(self.layers):
            if k == 2 and self.step % 3 != 1:
                h = h + nn.functional.gelu(self.branch(h))
            h = nn.functional.gelu(layer(h))
        return self.head(h)


class Experts(nn.Module):
    """Mixture-of-experts: each token to one of EXPERTS experts, only the first 1 + step % EXPERTS of them used on
    a step (the others get no tokens); an expert is a module of its own plus its slice of a 3D parameter bank
    (experts as one (E, in, out) tensor, as fused MoE layers keep them)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.head = nn.Linear(IN, HID, bias=False), nn.Linear(HID, OUT, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HID, HID, bias=False) for _ in range(EXPERTS))
        self.bank = nn.Parameter(torch.randn(EXPERTS, HID, HID) * HID ** -0.5)
        self.step = 0

    def forward(self, x):
        h = nn.functional.gelu(self.l0(x))
        used = 1 + self.step % EXPERTS
        route = (torch.arange(h.shape[0], device=h.device) + self.step) % used
        out = torch.zeros_like(h)
        for e in range(used):
            idx = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, nn.functional.gelu(self.experts[e](h[idx]) + h[idx] @ self.bank[e]))
        return self.head(h + out)


def build(cfg: dict, model: nn.Module):
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
    return engine


def train(engine, steps: range) -> list[float]:
    """Mean loss of each step's global batch; the model told its step (which branch or experts it uses)."""
    rank, world, micro = engine.global_rank, engine.world_size, engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in steps:
        engine.module.step = step
        x, y = common.batch(step)
        mine = slice(rank * micro, (rank + 1) * micro)
        loss = nn.functional.cross_entropy(engine(x[mine].to(engine.device, torch.bfloat16)).float(),
                                           y[mine].to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(common.mean_over_ranks(loss, world))
    return losses


def _gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def task_node(args, world, stage, dtype, rest):
    env = {k: os.environ.pop(k) for k in node.LOCAL_SIZE_VARIABLES + ("SLURM_TASKS_PER_NODE",) if k in os.environ}
    try:
        gathered = node.local_ranks(device=torch.device(deepspeed.get_accelerator().current_device_name()))
        without_env = node.launcher_local_ranks()
    finally:
        os.environ.update(env)
    return {"gathered": _gathered(gathered), "env": env, "launcher": node.launcher_local_ranks(),
            "without_env": without_env}


def _write_memory(root: Path, available: int, cgroup_room: int | None = None) -> None:
    """This host's memory as the node module reads it under `root`: MemAvailable, and a v2 cgroup with that room."""
    if dist.get_rank() == 0:
        files = {"proc/meminfo": f"MemTotal: 999999999 kB\nMemAvailable: {available // 1024} kB\n"}
        if cgroup_room is not None:
            files.update({"proc/self/cgroup": "0::/job\n",
                          "proc/self/mountinfo": "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                          "sys/fs/cgroup/job/memory.max": f"{cgroup_room + 2**30}\n",
                          "sys/fs/cgroup/job/memory.current": f"{2**30}\n"})
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)
    dist.barrier()


def _outcome(cfg: dict, allocated: list) -> dict:
    """Build an engine of cfg: "built" or the one-line refusal, and how many host buffer sets it allocated."""
    before = len(allocated)
    try:
        engine = build(cfg, common.model())
        need = sum(t.numel() * t.element_size() for t in engine.optimizer._coat_home.host)
        engine.destroy()
        result = "built"
    except ValueError as exc:
        need, result = None, str(exc)
    return {"result": result, "allocated": len(allocated) - before, "need": need}


def task_refuse(args, world, stage, dtype, rest):
    root = Path(os.environ[node.ROOT_VARIABLE])
    allocated, pin = [], coat_states.HostStates._pin

    def counted(self, *a, **kw):
        allocated.append(1)
        return pin(self, *a, **kw)

    coat_states.HostStates._pin = counted
    cfg = preset_config(world)
    out = {"unknown": _outcome(cfg, allocated)}
    need = max(_gathered(out["unknown"]["need"]))
    kib = 1024
    fits, short = (-(-int(need * n / coat_states.HEADROOM) // kib) * kib for n in (2.3, 1.5))
    _write_memory(root, fits)
    out["fits"] = _outcome(cfg, allocated)
    _write_memory(root, short)
    out["short"] = _outcome(cfg, allocated)
    _write_memory(root, 1024 * 2**30, cgroup_room=short)
    out["cgroup"] = _outcome(cfg, allocated)
    out["available"] = {"fits": fits, "short": short}
    if dist.get_rank() == 0:   # the host's own memory again for what runs after
        shutil.rmtree(root)
        root.mkdir()
    dist.barrier()
    return {"ranks": _gathered(out), "need": need}


def _delay_fetches(home, cycles: int = 20_000_000) -> None:
    """A slow copy-in link: a spin kernel (~10 ms) on the copy-in stream before each fetch."""
    fetch = home._fetch

    def slowed(i, evict):
        with torch.cuda.stream(home.h2d):
            torch.cuda._sleep(cycles)
        fetch(i, evict)

    home._fetch = slowed


def task_order(args, world, stage, dtype, rest):
    make = Experts if "moe" in rest else Branchy
    out, final = {}, {}
    for where in ("device", "host"):
        engine = build(preset_config(world, where), make())
        home, orders = engine.optimizer._coat_home, []
        if home is not None and home.cuda:
            _delay_fetches(home)
        losses = []
        for step in range(ORDER_STEPS):
            losses += train(engine, range(step, step + 1))
            if home is not None:
                orders.append(list(home.last_order))
        final[where] = (_joined(engine), states(engine))
        out[where] = {"losses": losses, "orders": orders,
                      "subgroups": len(engine.optimizer.fp32_partitioned_groups_flat)}
        engine.destroy()
    out["masters_equal"] = _all(torch.equal(final["host"][0], final["device"][0]))
    out["states_equal"] = _all(torch.equal(final["host"][1], final["device"][1]))
    return out


def _registered(ptr: int) -> bool:
    """Whether CUDA has host memory at `ptr` registered (cudaPointerGetAttributes: cudaMemoryTypeHost, 1), asked of
    the CUDA runtime torch loaded (another release's, loaded by name, crashed in ctypes on an H200); the struct
    gets room to spare, as releases add fields to it."""
    path = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudart" in line),
                "libcudart.so.13")
    rt = ctypes.CDLL(path)
    attrs = ctypes.create_string_buffer(512)
    rc = rt.cudaPointerGetAttributes(attrs, ctypes.c_void_p(ptr))
    rt.cudaGetLastError()
    return rc == 0 and ctypes.c_int.from_buffer(attrs).value == 1


def _rss() -> int:
    fields = Path("/proc/self/status").read_text().split("VmRSS:")[1].split()
    return int(fields[0]) * 1024


def task_drop(args, world, stage, dtype, rest):
    cfg = preset_config(world)
    cfg["zero_optimization"].update(sub_group_size=100_000_000, reduce_bucket_size=50_000_000,
                                    stage3_prefetch_bucket_size=50_000_000, stage3_param_persistence_threshold=100_000)
    out = {"rss": [], "still_registered": [], "host_bytes": []}
    for _ in range(3):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8192, 8192, bias=False) for _ in range(8)))   # 537M parameters
        engine = build(cfg, model)
        del model
        micro = engine.train_micro_batch_size_per_gpu()
        for _ in range(2):
            x = torch.randn(micro, 8192, device=engine.device, dtype=torch.bfloat16)
            engine.backward(engine(x).float().square().mean())
            engine.step()
        host = engine.optimizer._coat_home.host
        ptrs = [t.data_ptr() for t in host]
        out["host_bytes"].append(sum(t.numel() * t.element_size() for t in host))
        del host
        engine.destroy()
        del engine
        gc.collect()
        torch.cuda.synchronize()
        out["still_registered"].append([_registered(p) for p in ptrs])
        out["rss"].append(_rss())
    return out


TASKS = {"node": task_node, "refuse": task_refuse, "order": task_order, "drop": task_drop}

if __name__ == "__main__":
    with torn_down():   # the exit code is the job's own, not an abort at finalization
        job.main(TASKS)
