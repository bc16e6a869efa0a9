"""The training layer: the one loop (trainer), the run directory, the pretraining task."""
