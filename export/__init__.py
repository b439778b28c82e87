"""Export the encoder to an ONNX model repository, optimise it, and gate it on parity."""
