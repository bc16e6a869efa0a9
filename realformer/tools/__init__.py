"""What runs before or after training: the launch check and its HLO statistics, HF/TF1 interop, sweeps, the GLUE grid, attention analysis."""
