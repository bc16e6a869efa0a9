"""Synthesizer attention (Tay et al. 2020): attention logits synthesized without q.k."""
