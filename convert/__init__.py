"""Export stage: diffusers modules (from a preset or a local folder) to validated ONNX graphs.

``convert/`` is the one place in sdnpu that builds torch modules.
"""

from sdnpu.convert.driver import ComponentResult, ConvertOptions, ConvertResult, convert, parse_components
from sdnpu.components import COMPONENTS
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
