"""HF Trainer with coat's FP8 layers under Ulysses SP (accelerate's ParallelismConfig, sp_backend="deepspeed"), or
without SP on one rank: the same tiny Llama, ds_configs/hf/zero2_coat.json, one sample repeated (so that the sample
order of Ulysses' data loader adapter, which hands the SP group one rank's sample at a time, cannot matter). Writes
the Trainer's loss per step, the FP8 layer count and the attention function to --out (rank 0).

    python tests/ds_scripts/ulysses_hf_job.py --out one.json                         # one rank, no SP
    python tests/ds_scripts/ranks.py --num_gpus 2 --master_port P tests/ds_scripts/ulysses_hf_job.py --out sp.json \
        --sp 2
"""
import argparse
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import coat_ds  # noqa: F401  CoatAdamW and the "coat" section, as the config asks
from coat_ds.hf import CoatDecoderLayer
from coat_ds.launch.teardown import torn_down

SEQ, STEPS = 32, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sp", type=int, default=1)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    row = torch.randint(0, 256, (SEQ,), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row, "position_ids": torch.arange(SEQ)}] * 8
    extra = {}
    if args.sp > 1:
        import deepspeed
        from accelerate.utils import ParallelismConfig

        # on the CPU, accelerate starts torch.distributed itself, not deepspeed.comm, whose group Ulysses' registration
        # needs (on GPUs its DeepSpeed path starts deepspeed.comm)
        deepspeed.init_distributed()
        from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=args.sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    targs = TrainingArguments(output_dir=os.path.dirname(os.path.abspath(args.out)),
                              deepspeed="ds_configs/hf/zero2_coat.json",
                              per_device_train_batch_size=1, max_steps=STEPS, learning_rate=1e-2, use_cpu=True,
                              bf16=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                              **extra)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "norms": norms, "attention": ALL_ATTENTION_FUNCTIONS["sdpa"].__name__,
                       "fp8": sum(isinstance(m, CoatDecoderLayer) for m in trainer.model.modules())}, f)


if __name__ == "__main__":
    with torn_down():
        main()
