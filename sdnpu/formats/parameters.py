"""``<component>/parameters.json``: which module parameter each constant of an exported graph holds.

Written right after the export (``sdnpu.convert.parameters.map_parameters`` matches them while the module is
loaded); read by the LoRA overlay, which finds every weight a LoRA changes through it. The file::

    {"format": "sdnpu-parameters", "version": 1, "module": <the wrapper's child the names are relative to>,
     "ambiguous": N, "initializers": {<graph constant>: {"param": NAME, "transform": "identity" | "transpose"}
                                      | {"param": null, "candidates": [NAME, ...]}}}

A constant two parameters could explain is recorded with its candidates; one no parameter explains is left
out. Together with ``dd/weights.json`` (``sdnpu.formats.weights``) this takes every weight of a dispatch op
back to a module parameter and the steps that made it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdnpu.errors import SdnpuError

FORMAT, VERSION = "sdnpu-parameters", 1
FILE = "parameters.json"


def make_record(module: str, ambiguous: int, initializers: dict[str, Any]) -> dict[str, Any]:
    """The record for a graph whose constants ``initializers`` names (see the module's doc)."""
    return {"format": FORMAT, "version": VERSION, "module": module, "ambiguous": ambiguous,
            "initializers": initializers}


def read_record(comp_dir: Path) -> dict[str, Any]:
    """``comp_dir``'s ``parameters.json``, checked, or one line saying what is wrong."""
    path = comp_dir / FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SdnpuError(f"{path} is missing", hint="convert the component again with this version of sdnpu "
                         "(it maps the graph's constants to the module's parameters)") from None
    except ValueError as e:
        raise SdnpuError(f"{path} is not readable JSON: {e}", hint="convert the component again") from e
    if data.get("format") != FORMAT:
        raise SdnpuError(f"{path} is not an sdnpu parameter map", hint="convert the component again")
    return data  # type: ignore[no-any-return]


def constants_by_parameter(record: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """module parameter -> (the graph constant holding it, "identity" | "transpose"), for the unambiguous ones."""
    return {v["param"]: (name, v["transform"]) for name, v in record["initializers"].items() if v.get("param")}
