"""Export stage: diffusers modules (from a preset or a local folder) to validated ONNX graphs.

``convert/`` is the one place in sdnpu that builds torch modules.
"""

from sdnpu.components import COMPONENTS
from sdnpu.convert.driver import convert, parse_components
from sdnpu.convert.options import ComponentResult, ConvertOptions, ConvertResult
from sdnpu.convert.sources import Source, preset_names, resolve_source

__all__ = [
    "COMPONENTS",
    "ComponentResult",
    "ConvertOptions",
    "ConvertResult",
    "Source",
    "convert",
    "parse_components",
    "preset_names",
    "resolve_source",
]
