"""The pretraining and fine-tuning inputs: tokenizers, document sources, BERT instances."""
