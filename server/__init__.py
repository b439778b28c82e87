"""The batched gRPC embedding server on ONNX Runtime."""

__version__ = "0.1.0"
