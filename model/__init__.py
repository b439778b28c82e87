"""A BERT-family Transformer encoder written in PyTorch, with checkpoint import and tokenization."""
