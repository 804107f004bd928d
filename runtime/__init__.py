"""Running converted folders on onnxruntime, up to the full text-to-image pipeline."""
