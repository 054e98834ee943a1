"""An HF Trainer script as a user writes one, not ours: `import coat_ds`, a tiny Llama, TrainingArguments with a
ds_configs/hf/ config, two steps, then the end of the script: no torn_down, no accelerator.end_training(). Such a
script aborted at the interpreter's exit now and then ("terminate called without an active exception", exit 250
through a launcher: gloo's teardown in Python's finalization); `import coat_ds` now destroys the live process group
first (coat_ds.launch.teardown.at_exit). `--bare` takes that hook out (the control); `--deepspeed JSON` another
config. Used by tests/launched/test_teardown.py and test_hf_trainer.py:

    python tests/ds_scripts/ranks.py --num_gpus 2 --master_port P tests/ds_scripts/user_hf_trainer.py [--bare]
"""
import atexit
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import coat_ds  # noqa: F401  CoatAdamW and the "coat" section, as the config asks

if "--bare" in sys.argv:
    from coat_ds.launch.teardown import at_exit

    atexit.unregister(at_exit)

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
ids = torch.randint(0, 256, (16, 32))
data = [{"input_ids": row, "labels": row} for row in ids]
args = TrainingArguments(output_dir=sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "/tmp/user_hf",
                         deepspeed=sys.argv[sys.argv.index("--deepspeed") + 1] if "--deepspeed" in sys.argv else
                         "ds_configs/hf/zero2_coat.json", per_device_train_batch_size=2, max_steps=2,
                         use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=data).train()
print("trained", flush=True)
