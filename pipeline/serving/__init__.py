"""Using a registered model: batch scoring of Delta tables (predict), ONNX/TorchScript export with its preprocessing contract."""
