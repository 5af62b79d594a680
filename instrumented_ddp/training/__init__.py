"""The built-in workload: the training script, its models and its data."""
