"""Training on CPU: tokenizers trained locally, data sources, the loop, checkpoints."""
