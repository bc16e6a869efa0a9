"""The fine-tuning task kinds, one module each (registry.py finds them by file name)."""
