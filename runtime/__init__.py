"""Running converted folders on onnxruntime, up to the full text-to-image pipeline."""

from sdnpu.runtime.controlnet import ControlSpec
from sdnpu.runtime.sd3 import SD3Pipeline
from sdnpu.runtime.session import Component, RuntimeOptions, open_component
from sdnpu.runtime.text2image import GenerateOptions, Pipeline, save_png
from sdnpu.runtime.verify import verify

__all__ = ["Component", "ControlSpec", "GenerateOptions", "Pipeline", "RuntimeOptions", "SD3Pipeline", "open_component",
           "save_png", "verify"]
