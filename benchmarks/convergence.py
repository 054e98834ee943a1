"""Convergence: a ~125M Llama pretrained from scratch with BF16 + AdamW, coat_ds optimizer-only and coat_ds full
(fp32 master; bf16 master by stochastic rounding or, an ablation, to nearest), a process per run, all from the same
weights on the same batches (docs/benchmarks.md: the commands, convergence.json's fields).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.accuracy import verdicts
from benchmarks.common import ROOT, parser, provenance, read_json, worker_cmd
from benchmarks.configs import CONFIGS, check_args, ds_config
from benchmarks.worker import Worker as EngineWorker, base_optimizer
from coat_ds.workloads import causal_lm as train_lib, data as data_lib
from coat_ds.workloads.causal_lm import FAMILIES

DEFAULT_CONFIGS = "bf16,coat_opt,coat_full,coat_full_bf16sr,coat_full_bf16rn"   # the runs of convergence.json
SMOKE_CONFIGS = "bf16,coat_full"   # a smoke's processes unless --configs names others (seed_spread's too)
RECIPE = ("model_size", "family", "data", "data_bytes", "vocab_size", "seq_len", "micro_batch", "steps", "lr",
          "warmup_steps", "log_every", "eval_every", "eval_batches", "seed")   # the options a worker trains by


def model_name(args: argparse.Namespace) -> str:
    """The model as results name it: llama-125m, qwen3-125m, gemma3_text-125m."""
    return f"{args.family}-{args.model_size}"


class Worker(EngineWorker):
    """One configuration's run: the engine, the fixed batches, the loss curves and the result file."""

    def setup_engine(self):
        args = self.args
        tokens = data_lib.load(args.data, args.seq_len, vocab_size=args.vocab_size, max_bytes=args.data_bytes)
        spec = argparse.Namespace(model=None, model_size=args.model_size, family=args.family, seed=args.seed)
        model = train_lib.build_model(spec, tokens.vocab_size, args.seq_len)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.cfg = ds_config(args.config, micro_batch=args.micro_batch, on_cpu=not self.on_cuda, lr=args.lr,
                             total_steps=args.steps, warmup_steps=args.warmup_steps)
        self.source = self.cfg.pop("_source")
        self.batches = data_lib.Batches(tokens, args.seq_len, args.micro_batch, 1, 0, 1, args.seed)
        self.val_data = list(self.batches.val_batches(args.eval_batches))
        self.train_log, self.val_log, self.status, self.t_train = [], [], "running", 0.0
        return train_lib.initialize(model, self.cfg)

    def fetch(self, step: int):
        batch = self.batches.train_batch(step, 0)
        return tuple(t.pin_memory().to(self.device, non_blocking=True) for t in batch) if self.on_cuda else batch

    def evaluate(self) -> float:
        self.engine.eval()
        total = torch.zeros((), device=self.device)
        with torch.no_grad():
            for x, y in self.val_data:
                total += train_lib.lm_loss(self.engine, x, y).float()
        self.engine.train()
        return total.item() / len(self.val_data)

    def save(self) -> None:
        """The result so far; rewritten at every evaluation so a run killed by the time budget keeps its curves."""
        args, train_log, val_log = self.args, self.train_log, self.val_log
        steps_done = train_log[-1][0] if train_log else 0
        res = {"config": args.config, "label": CONFIGS[args.config][0], "config_source": self.source,
               "ds_config": self.cfg, "params": self.n_params, "status": self.status, "steps_done": steps_done,
               "train": train_log, "val": val_log,
               "final_val_loss": val_log[-1][1] if val_log and val_log[-1][0] == steps_done else None,
               "tokens_per_s": steps_done * args.micro_batch * args.seq_len / self.t_train if self.t_train else None,
               "peak_mem_gb": torch.cuda.max_memory_allocated() / 2 ** 30 if self.on_cuda else None,
               "coat_warnings": self.wlog.messages}
        if args.dump_state and not self.status.startswith("diverged"):   # every evaluation: a stopped run still has one
            res["adam_state"] = dump_adam_state(self.engine, Path(args.dump_state), args.state_sample,
                                                f"{args.config} run, {model_name(args)}, step {steps_done}")
        tmp = Path(args.result + ".tmp")
        tmp.write_text(json.dumps(res))
        os.replace(tmp, args.result)

    def log_train(self, done: int, acc) -> bool:
        """The mean train loss since the last record read back; False when the run must stop (diverged, no time)."""
        n = done - (self.train_log[-1][0] if self.train_log else 0)
        mean = acc.item() / n
        acc.zero_()
        self.train_log.append([done, mean])
        if not math.isfinite(mean):
            self.status = f"diverged: train loss {mean} at step {done}"
            return False
        if self.args.deadline and time.time() > self.args.deadline and done < self.args.steps:
            self.status = f"stopped by the time budget at step {done}"
            return False
        return True

    def train(self) -> None:
        args, engine = self.args, self.engine
        acc = torch.zeros((), device=self.device, dtype=torch.float32)
        engine.train()
        t_mark = time.perf_counter()
        nxt = self.fetch(0)
        for done in range(1, args.steps + 1):   # the step's number, 1-based
            x, y = nxt
            if done < args.steps:
                nxt = self.fetch(done)       # the next batch's copy overlaps this step's compute
            acc += self.one_step(x, y).detach().float()
            if (done % args.log_every == 0 or done == args.steps) and not self.log_train(done, acc):
                break
            if done % args.eval_every == 0 or done == args.steps:
                self.t_train += time.perf_counter() - t_mark
                self.val_log.append([done, self.evaluate()])
                print(f"[{args.config}] step {done}: train {self.train_log[-1][1]:.4f} "
                      f"val {self.val_log[-1][1]:.4f}", flush=True)
                self.save()
                t_mark = time.perf_counter()
        self.t_train += time.perf_counter() - t_mark


def worker(args: argparse.Namespace) -> int:
    w = Worker(args)
    w.train()
    if w.status.startswith("stopped") and (not w.val_log or w.val_log[-1][0] != w.train_log[-1][0]):
        w.val_log.append([w.train_log[-1][0], w.evaluate()])
    if w.status == "running":
        w.status = "ok"
    w.save()
    return 0 if w.status == "ok" else 3


def dump_adam_state(engine, path: Path, sample: int, what: str) -> dict:
    """`sample` values of the final exp_avg / exp_avg_sq (fp32), 64 128-aligned windows, saved for quant_error."""
    base = base_optimizer(engine)
    states = [base.state.get(p, {}) for g in base.param_groups for p in g["params"]]
    states = [st for st in states if "exp_avg" in st and "exp_avg_sq" in st]
    if not states:
        raise RuntimeError(f"{type(base).__name__} holds no exp_avg/exp_avg_sq state to dump")
    m, v = (torch.cat([st[k].detach().reshape(-1).float() for st in states]) for k in ("exp_avg", "exp_avg_sq"))
    n = m.numel()
    if sample >= n:
        idx = torch.arange(n, device=m.device)
        layout = f"all {n} values"
    else:
        win = max(128, sample // 64 // 128 * 128)
        starts = torch.linspace(0, max(n - win, 0), 64).long() // 128 * 128
        idx = (starts[:, None] + torch.arange(win)[None, :]).reshape(-1).clamp_(max=n - 1).to(m.device)
        layout = f"64 windows of {win} contiguous values out of {n}"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"exp_avg": m[idx].cpu(), "exp_avg_sq": v[idx].cpu(), "source": f"{what}: {layout}",
                "optimizer": type(base).__name__}, path)
    return {"path": str(path), "numel": int(idx.numel()), "of": n, "layout": layout, "optimizer": type(base).__name__}


def launch(args: argparse.Namespace, name: str, out: Path, tag: str, timeout: float) -> dict:
    """One configuration's worker, its progress lines echoed, killed after `timeout` s -> its result."""
    result = out / f"convergence_{tag}.json"
    result.unlink(missing_ok=True)
    cmd = worker_cmd("benchmarks.convergence", args, RECIPE + ("deadline",), config=name, result=result)
    if name == "bf16" and args.state_sample:
        cmd += ["--dump-state", str(out / "adam_state_bf16.pt"), "--state-sample", str(args.state_sample)]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    rc, tail = harness.run_worker(cmd, timeout, echo=lambda line: line.startswith("[") or "rror" in line)
    # what the worker last saved, with its exit code and, when that is not 0, the end of its output
    run = read_json(result) or no_run(name, f"failed (exit {rc})")
    if rc != 0 and run["status"] in ("running", "ok"):
        run["status"] = f"stopped at step {run['steps_done']} (exit {rc})"
    run.update(exit_code=rc, log_tail=tail[-2000:] if rc != 0 else "")
    print(f"{result.stem}: {run['status']}, final val loss {run['final_val_loss']}", flush=True)
    return run


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = parser(__doc__, "out", "seed", seq_len=512, steps=(2000, "training steps"), worker=True,
               time_budget=(3600.0, "seconds before the runs are killed"),
               smoke="tiny model, few steps, small corpus, bf16 and coat_full unless --configs (CPU is fine)")
    p.add_argument("--configs", help=f"comma-separated, from {list(CONFIGS)} (default {DEFAULT_CONFIGS})")
    p.add_argument("--model-size", default="125m", help="a size from coat_ds.workloads.causal_lm's MODEL_SIZES")
    p.add_argument("--family", default="llama", choices=FAMILIES, help="the model family of that size")
    p.add_argument("--data", help="as examples/train.py --data (default: the standard-library corpus)")
    p.add_argument("--data-bytes", type=int, help="a --data text folder: use files up to this many bytes in all")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10, help="read the train loss back every N steps")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--state-sample", type=int, default=2_000_000,
                   help="Adam-state values saved from the BF16 run (0: none)")
    p.add_argument("--parallel", action="store_true", help="run the configurations at the same time")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--dump-state", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return p, p.parse_args(argv)


def run_workers(rec: argparse.Namespace, jobs: list[tuple[str, int]], out: Path, max_parallel: int,
                deadline: harness.Deadline, tag=lambda name, seed: name, log: dict | None = None) -> dict:
    """Each (config, seed) job's worker, in waves of max_parallel on the one device (harness.run_waves) -> its result.
    Workers stop themselves at the deadline's stop (evaluate, save), are killed at its kill; a wave starts only
    where a minute is left."""
    rec.deadline, done = deadline.stop_at, {}

    def run(_, job: tuple[str, int]) -> None:
        done[job] = launch(argparse.Namespace(**{**vars(rec), "seed": job[1]}), job[0], out, tag(*job),
                           deadline.kill_at - time.time())

    harness.run_waves(harness.pack(jobs, max_parallel, lambda job: 1, lambda wave, job: True), deadline, run,
                      lambda *_: None, lambda job: tag(*job), est=lambda job: 60.0, log=log)
    return done


def no_run(name: str, status: str) -> dict:
    """What stands for a run that saved no result."""
    return {"config": name, "label": CONFIGS[name][0], "status": status, "train": [], "val": [], "final_val_loss": None}


# --- Comparing runs (seed_spread's too) -------------------------------------------------------------------------------
def last_common_step(curves) -> int | None:
    """The last step every one of these validation curves evaluated: where the runs are compared."""
    steps = [{s for s, _ in curve} for curve in curves]
    return max(set.intersection(*steps), default=None) if steps else None


def fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def headline(args: argparse.Namespace, runs: dict[str, dict], tokens, t0: float) -> dict:
    """convergence.json: the validation losses compared at the last step every run evaluated, and the runs."""
    common = last_common_step(r.get("val", []) for r in runs.values())
    loss = {n: dict(r.get("val", [])).get(common) for n, r in runs.items()}
    bf16, full, opt, sr, rn = map(loss.get, ("bf16", "coat_full", "coat_opt", "coat_full_bf16sr", "coat_full_bf16rn"))

    def tail(n: str) -> float | None:   # the mean train loss of the last 5 records (50 steps)
        last = [v for _, v in (runs.get(n) or {}).get("train", [])[-5:]]
        return sum(last) / len(last) if last else None

    return {
        **provenance(), **recipe_facts(args, tokens),
        "params": next((r.get("params") for r in runs.values() if r.get("params")), None),
        "seed": args.seed, "parallel": args.parallel, "steps": common or 0, "steps_requested": args.steps,
        "bf16_val_loss": bf16, "coat_val_loss": full, "coat_opt_val_loss": opt,
        "val_loss_gap_rel": verdicts.gap(full, bf16), "val_loss_gap_rel_optimizer_only": verdicts.gap(opt, bf16),
        "coat_bf16sr_val_loss": sr, "val_loss_gap_rel_bf16sr": verdicts.gap(sr, bf16),
        "coat_bf16rn_val_loss": rn, "val_loss_gap_rel_bf16rn": verdicts.gap(rn, bf16),
        "within_target_bf16sr": verdicts.close(sr, bf16),
        "bf16_train_loss_last50": tail("bf16"), "coat_train_loss_last50": tail("coat_full"),
        "target_gap_rel": verdicts.GAP_REL, "within_target": verdicts.close(full, bf16),
        "adam_state": (runs.get("bf16") or {}).get("adam_state"),
        "runs": runs, "wall_s": time.time() - t0, "smoke": args.smoke,
    }


def recipe_facts(args: argparse.Namespace, tokens) -> dict:
    """The model, corpus and schedule of a run, as convergence.json and seed_spread.json record them."""
    return {"model": model_name(args), "data": tokens.source.split(" (cache")[0], "train_tokens": len(tokens.train),
            "val_tokens": len(tokens.val), "vocab_size": tokens.vocab_size, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "tokens_per_step": args.seq_len * args.micro_batch,
            "epochs": args.steps * args.seq_len * args.micro_batch / len(tokens.train), "lr": args.lr,
            "warmup_steps": args.warmup_steps}


def load_tokens(args: argparse.Namespace, t0: float):
    """The recipe's corpus, tokenized once here before any worker starts (each then reads the cache)."""
    tokens = data_lib.load(args.data, args.seq_len, vocab_size=args.vocab_size, max_bytes=args.data_bytes)
    print(f"data: {tokens.source}: {len(tokens.train):,} train / {len(tokens.val):,} val tokens "
          f"({time.time() - t0:.0f} s)", flush=True)
    return tokens


def smoke_recipe(args: argparse.Namespace) -> None:
    """The --smoke recipe: tiny model, few steps, a small text folder (the BPE trains in seconds); CPU is fine."""
    args.model_size, args.seq_len, args.micro_batch, args.steps = "tiny", 64, 4, 3
    args.warmup_steps, args.log_every, args.eval_every, args.eval_batches = 1, 1, 3, 1
    args.vocab_size, args.state_sample = 512, 4096
    args.data = args.data or str(ROOT / "coat_ds")


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    if args.worker:
        return harness.worker_exit(lambda: worker(args))
    if args.smoke:
        smoke_recipe(args)
    args.configs = args.configs or (SMOKE_CONFIGS if args.smoke else DEFAULT_CONFIGS)
    names = check_args(p, args, ("seq_len", "micro_batch", "steps", "log_every", "eval_every", "eval_batches"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    tokens = load_tokens(args, t0)
    done = run_workers(args, [(n, args.seed) for n in names], out, len(names) if args.parallel else 1,
                       harness.Deadline(args.time_budget, stop_s=20, kill_s=-40, start=t0))
    runs = {n: done.get((n, args.seed)) or no_run(n, "not started: time budget") for n in names}
    res = headline(args, runs, tokens, t0)
    path = harness.write_results(res, out, "convergence")
    print(f"final val loss: bf16 {fmt(res['bf16_val_loss'])}, coat optimizer-only {fmt(res['coat_opt_val_loss'])}, "
          f"coat full {fmt(res['coat_val_loss'])} (bf16 master: SR {fmt(res['coat_bf16sr_val_loss'])}, "
          f"RN {fmt(res['coat_bf16rn_val_loss'])}); gap {fmt(res['val_loss_gap_rel'], '+.3%')}, bf16 SR "
          f"{fmt(res['val_loss_gap_rel_bf16sr'], '+.3%')} (target within {verdicts.GAP_REL:.1%})  ->  {path}",
          flush=True)
    return 0 if all(r.get("status") == "ok" for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
