"""Issue 46's accuracy runs at scale, which benchmarks/accuracy_scale.py schedules and merges: recipe.py the recipe,
runs.py the main job under a deadline and its run directory, verdicts.py the targets' arithmetic, outliers.py how
outlier-heavy the trained model is."""
