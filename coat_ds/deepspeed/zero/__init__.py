"""CoatAdamW under DeepSpeed's ZeRO: FP8 groups that do not move when ZeRO partitions (layout.py), found in its flat
partitions (kind.py, partitions.py) and bound to them at set-up (bind.py); the step on gradients where they lie
(step.py, release.py), the master weights (master.py), where reduced gradients live (gradients.py), when a leaf
module's are reduced (leaf_hooks.py). Nothing here imports the rest of coat_ds.deepspeed: engine.py hands bind() the
"coat" section's values."""
