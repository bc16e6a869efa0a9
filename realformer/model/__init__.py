"""The encoder maths: the spec and its variant presets, attention (every variant's formula), the encoder and its heads. No I/O, no configs."""
