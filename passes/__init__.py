"""The offload compiler's passes. The pass list, with its order constraints, is declared once: ``pipeline`` in
``sdnpu.passes.pipeline``."""
