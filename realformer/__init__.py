"""BERT-style encoders (Post-LN, Pre-LN, RealFormer, Synthesizer) in JAX/Flax."""
