"""Fine-tuning on GLUE and SQuAD: the tasks the trainer runs (task.py), one per benchmark."""
