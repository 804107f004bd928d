"""The offload report: dd/onnx_report.txt and report.json."""
