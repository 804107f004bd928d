"""The target: each dispatch op's contract and capability limits (``target``, ``amd_xdna2``), its reference body
(``bodies``) and AMD's block format (``bfp``). Only the target: the formats the stages share are
``sdnpu.formats``, running sessions is ``sdnpu.onnxrun``."""
