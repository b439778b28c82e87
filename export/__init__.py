"""Export the encoder to an ONNX model repository, optimise it, and gate it on parity."""

import os

# Before onnxruntime is imported (by this package's modules, which the export and its gates use):
# onnxruntime 1.31 on Linux otherwise keeps a device id under ~/.cache and uploads telemetry to
# Microsoft. A setting of the caller's own stands.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
