"""A Llama causal LM on DeepSpeed, as examples/ and benchmarks/ build it: model shapes, the engine, the loss.

`build_model` makes a fresh Llama of a named size (no download) or loads an HF model, `from_shape` a fresh model
of any shape on any device; `initialize` is plain
deepspeed.initialize after `import coat_ds` (the engine applies the "coat" section and knows "CoatAdamW")
with weight decay on matrices only; `lm_loss` is next-token cross-entropy in fp32 (HF's loss)."""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

_ROUTER = dict(norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001)
MODEL_SIZES = {  # Llama shapes; parameter counts are for the default 8192-token vocabulary
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=192),                                                      # ~1.2M
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=704),                                                     # ~7.4M
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                 intermediate_size=3072),                                                     # ~126M
    "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                 intermediate_size=2816),                                                     # ~325M
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632),                                                       # ~1.0B
    # mixtures of experts (issue 60's accuracy runs): Qwen3-MoE, every layer sparse, top-k renormalized, trained with
    # HF's router load-balancing term (output_router_logits, coefficient 0.001 as Qwen3-30B-A3B's config)
    "moe-tiny": dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, **_ROUTER),                                      # ~1.2M, 1.1M active
    "moe-90m": dict(model_type="qwen3_moe", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, moe_intermediate_size=384, num_experts=16,
                    num_experts_per_tok=4, **_ROUTER),                                       # 90.3M, 33.6M active
}


ALLOCATOR_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")   # torch's name, and its older CUDA one


def default_allocator() -> None:
    """Expandable segments for PyTorch's CUDA allocator unless the user configured it: gradients allocated one
    parameter at a time as backward frees activations (coat.gradients "per_parameter") fit in the freed blocks
    instead of fragmenting fixed segments. Call before anything touches CUDA."""
    if not any(os.environ.get(v) for v in ALLOCATOR_VARS):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


# The main job's sizes in the other families: HF's defaults for each, but a head as wide as the Llama's (the
# defaults are 128 for Qwen3, 256 for Gemma 3) and, for Gemma 3, a local window a quarter of the main job's
# 512-token samples so that its local layers differ from its global ones.
FAMILIES = ("llama", "qwen3", "gemma3_text")


def _family_extra(family: str, size: dict, seq_len: int) -> dict:
    head = size["hidden_size"] // size["num_attention_heads"]
    if family == "gemma3_text":
        return dict(head_dim=head, query_pre_attn_scalar=head, sliding_window=max(seq_len // 4, 16))
    return dict(head_dim=head)


def build_model(spec: Any, vocab_size: int, seq_len: int, ds_config: dict | None = None):
    """An HF model to fine-tune (`spec.model`: name or path), or a freshly initialised model of `spec.model_size`
    (the main job's sizes, or a public shape by name: coat_ds.workloads.shapes, its vocabulary kept where larger than
    the data's; no download) in `spec.family` (FAMILIES; a Llama where unset); `spec.seed` seeds the initialisation.
    Under a ZeRO-3 `ds_config` it is built partitioned over the ranks (built_partitioned; an HF checkpoint is then
    loaded file by file, load_partitioned), in bf16 where the config trains in bf16. `spec`: the parsed flags of
    examples/train.py or any object with those attributes."""
    import torch

    zero3 = ((ds_config or {}).get("zero_optimization") or {}).get("stage") == 3
    dtype = torch.bfloat16 if zero3 and ((ds_config or {}).get("bf16") or {}).get("enabled") is True else None
    if spec.model:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(spec.seed)
        if zero3:
            return load_partitioned(spec.model, ds_config, dtype or torch.float32)
        return AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype or torch.float32)
    size = _size(spec.model_size)
    own = size.pop("model_type", None)    # a public shape of its own family (qwen3-30b-a3b: qwen3_moe), kept as is
    family = own or getattr(spec, "family", "llama")
    if own is None and family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; allowed: {list(FAMILIES)}")
    extra = _family_extra(family, size, seq_len) if family != "llama" and own is None else {}
    vocab = max((vocab_size + 63) // 64 * 64, size.pop("vocab_size", 0))   # tensor-core width
    with built_partitioned(ds_config):
        return from_shape(dict(size, model_type=family, vocab_size=vocab,
                               max_position_embeddings=max(seq_len, 2048), **extra), spec.seed, dtype=dtype)


def model_size_names() -> list[str]:
    """What --model-size accepts: the main job's sizes, then the public shapes (coat_ds.workloads.shapes)."""
    from .shapes import SHAPES

    return list(MODEL_SIZES) + list(SHAPES)


def _size(name: str) -> dict:
    from .shapes import SHAPES

    return dict(MODEL_SIZES[name] if name in MODEL_SIZES else SHAPES[name])


def from_shape(shape: dict, seed: int, device: Any = "cpu", dtype: Any = None):
    """A freshly initialised causal LM of `shape` (HF config fields; `model_type` names the family, a Llama where
    unset: untied embeddings, eps 1e-5, HF's defaults otherwise), built directly on `device` in `dtype` (torch's
    default where None; a 7B model built in fp32 on the host would take a minute)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(shape)
    family = shape.pop("model_type", "llama")
    llama = dict(tie_word_embeddings=False, rms_norm_eps=1e-5) if family == "llama" else {}
    cfg = AutoConfig.for_model(family, **{**llama, **shape})
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype or prev)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(prev)


@contextlib.contextmanager
def built_partitioned(ds_config: dict | None):
    """Under ZeRO-3, models built inside are partitioned over the ranks as each module is made (DeepSpeed's
    zero.Init): no rank ever holds the whole model, on the host or a device (70B: 141 GB in bf16); load_partitioned
    fills them from a checkpoint file by file. Elsewhere a no-op. Starts the process group where none is; the model
    keeps the config (HF's HfDeepSpeedConfig, which its zero.Init and weight initialisation follow) alive."""
    stage = ((ds_config or {}).get("zero_optimization") or {}).get("stage", 0)
    if stage != 3:
        yield
        return
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    set_single_process_env()
    deepspeed.init_distributed()   # zero.Init partitions over the ranks (a no-op where initialised)

    hf_config = HfDeepSpeedConfig(ds_config)   # HF reads it through a weak reference: kept alive below
    yield hf_config
    _PARTITIONED_CONFIGS.append(hf_config)


_PARTITIONED_CONFIGS: list = []   # HfDeepSpeedConfig objects of models built partitioned (see built_partitioned)


CHECKPOINT_FILES = (("model.safetensors.index.json", "model.safetensors"),   # (sharded index, single file), in
                    ("pytorch_model.bin.index.json", "pytorch_model.bin"))   # the order from_pretrained prefers


def checkpoint_files(name_or_path: str) -> list[str]:
    """The weight files of an HF checkpoint (a folder, or a Hub name resolved through HF's cache): its shards, or
    its one file; safetensors where present."""
    from transformers.utils import cached_file
    from transformers.utils.hub import get_checkpoint_shard_files

    for index, single in CHECKPOINT_FILES:
        if found := cached_file(name_or_path, index, _raise_exceptions_for_missing_entries=False):
            return get_checkpoint_shard_files(name_or_path, found)[0]
        if found := cached_file(name_or_path, single, _raise_exceptions_for_missing_entries=False):
            return [found]
    raise OSError(f"{name_or_path}: no weights ({', '.join(f for pair in CHECKPOINT_FILES for f in pair)})")


@contextlib.contextmanager
def _weight_file(path: str):
    """One checkpoint file as ({name: shape}, read(name) -> tensor): safetensors reads a tensor only when asked,
    a .bin is memory-mapped."""
    import torch

    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            yield {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, f.get_tensor
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        yield {k: tuple(v.shape) for k, v in state.items()}, state.__getitem__


def load_partitioned(name_or_path: str, ds_config: dict, dtype: Any):
    """An HF checkpoint in a model built partitioned over the ranks (ZeRO-3), one checkpoint file at a time: each
    file's parameters are gathered, rank 0 copies the file's tensors in (one tensor read at a time) and they are
    partitioned again. A rank's host memory peaks at its partition (on the host only where the partitions are:
    the CPU accelerator, or offload_param) plus about one file, whatever the model's size. transformers 5.x's own
    ZeRO-3 from_pretrained reads every file into one state dict on rank 0 first: the whole model on one host (141 GB
    for 70B in bf16). Every parameter must come from the checkpoint (a partly loaded model is refused); tied ones
    are one parameter."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    files = checkpoint_files(name_or_path)
    with built_partitioned(ds_config):   # HF's random initialisation, gathered module by module: overwritten below
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name_or_path), dtype=dtype)
    rank = deepspeed.comm.get_rank()
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    loaded, ignored = set(), []
    for path in files:
        with _weight_file(path) as (shapes, read):
            names = {id(params[k]): k for k in shapes if k in params}   # a tied parameter once
            wrong = [f"{k} {shapes[k]} (model {tuple(params[k].ds_shape)})" for k in names.values()
                     if shapes[k] != tuple(params[k].ds_shape)]
            if wrong:   # on every rank, before any collective
                raise ValueError(f"--model {name_or_path}: {path} holds tensors of other shapes: {', '.join(wrong)}")
            with deepspeed.zero.GatheredParameters([params[k] for k in names.values()], modifier_rank=0):
                if rank == 0:
                    for k in names.values():
                        params[k].data.copy_(read(k))
            for k in (k for k in shapes if k in buffers):   # buffers are not partitioned: every rank reads them
                buffers[k].copy_(read(k))
            loaded.update(names)
            ignored += [k for k in shapes if k not in params and k not in buffers]
    missing = [k for k, p in params.items() if id(p) not in loaded]
    if missing:
        raise ValueError(f"--model {name_or_path}: the checkpoint lacks {len(missing)} of the model's parameters "
                         f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})")
    if ignored and rank == 0:
        print(f"note: --model {name_or_path}: {len(ignored)} checkpoint tensors are not in the model and were "
              f"ignored ({', '.join(ignored[:4])}{', ...' if len(ignored) > 4 else ''})", flush=True)
    return model


def param_groups(model) -> list[dict]:
    """Weight decay on matrices only (norm weights and biases are not decayed), the usual LM recipe. A parameter's
    shape is its whole one (`ds_shape`) where ZeRO-3 has partitioned it: its data is then a 1-D slice or empty."""
    def matrix(p) -> bool:
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    decay = [p for n, p in model.named_parameters() if p.requires_grad and matrix(p)]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and not matrix(p)]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def initialize(model, ds_config: dict):
    """Plain deepspeed.initialize: after `import coat_ds` the engine applies the "coat" section (FP8 layers) and
    knows "CoatAdamW"."""
    import coat_ds  # noqa: F401
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config)
    return engine


def lm_loss(engine, x, y):
    """Next-token cross-entropy (mean, fp32) of inputs `x` against targets `y` (x shifted by one): HF's own loss,
    given `y` as already-shifted labels. A "coat" section computes it without the full logits (coat.loss)."""
    y = y.to(engine.device).contiguous()   # HF's stock loss views shift_labels flat (evaluation takes that path)
    return engine(input_ids=x.to(engine.device), labels=y, shift_labels=y).loss


def moe_eval(engine, x, y) -> tuple[Any, Any, Any]:
    """(next-token loss, router aux loss, tokens routed to each expert [layers, experts]) of a mixture of experts'
    forward: HF adds router_aux_loss_coef x aux_loss to the loss it returns; the language-model loss is without it."""
    import torch

    y = y.to(engine.device).contiguous()
    out = engine(input_ids=x.to(engine.device), labels=y, shift_labels=y, output_router_logits=True)
    cfg = getattr(engine, "module", engine).config   # a DeepSpeed engine, or the model itself
    counts = torch.stack([torch.bincount(logits.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten(),
                                         minlength=cfg.num_experts) for logits in out.router_logits])
    return out.loss - cfg.router_aux_loss_coef * out.aux_loss, out.aux_loss, counts


def set_single_process_env() -> None:
    """A script started without a launcher (`python examples/train.py`): a world of one on this host."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
