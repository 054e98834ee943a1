"""ZeRO under CoatAdamW: FP8 groups that do not move when DeepSpeed partitions (layout.py), bound to ZeRO's flat
partitions at set-up (bind.py), its step reading gradients where they lie (step.py, release.py), the master
weights (master.py) and where reduced gradients live (gradients.py); kind.py tells which wrapper an engine runs."""
