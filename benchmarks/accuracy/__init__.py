"""Issue 46's accuracy runs at scale: a ~350M Llama pretrained on the kernel corpus with BF16 and coat's presets,
then fine-tuned from BF16's model on perldoc. recipe.py holds the recipe (written once), runs.py launches the main
job under a deadline and reads its run directory, verdicts.py holds the targets' arithmetic, outliers.py measures
how outlier-heavy the trained model is; benchmarks/accuracy_scale.py is the command that schedules and merges them.
"""
