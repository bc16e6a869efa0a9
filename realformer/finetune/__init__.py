"""Fine-tuning: the task the trainer runs (task.py), its kinds (tasks/, found by registry.py),
and their metrics."""
