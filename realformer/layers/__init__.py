"""Building blocks with no knowledge of the variants: dense layers, dropout, row selection."""
