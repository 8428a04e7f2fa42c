"""specdec: export draft and target causal LMs to ONNX and run exact speculative decoding on onnxruntime."""
