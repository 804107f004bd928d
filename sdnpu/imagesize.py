"""Image sizes: ``Size`` (written ``WxH``, or one number for a square) and the ``--res`` lists of them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from sdnpu.errors import SdnpuError


class Size(NamedTuple):
    """An image size in pixels. Written ``WxH`` (width first, as image tools and SDXL's bucket lists write
    it: ``1152x896`` is 1152 wide, 896 high), or one number for a square."""

    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def square(self) -> bool:
        return self.height == self.width

    def to_json(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width}

    @classmethod
    def of(cls, res: int | str | tuple[int, int] | Size) -> Size:
        """``res`` as a Size: a side (a square), ``"WxH"`` or ``"N"``, or (height, width)."""
        if isinstance(res, cls):
            return res
        if isinstance(res, str):
            return cls.parse(res)
        if isinstance(res, tuple):
            return cls(int(res[0]), int(res[1]))
        return cls(int(res), int(res))

    @classmethod
    def parse(cls, text: str) -> Size:
        text = text.strip().lower()
        if "," in text or text in SIZE_LISTS:
            raise SdnpuError(f"{text!r} is a list of sizes; one size is taken here",
                             hint="give one size, WxH (1152x896) or a side (1024); `sdnpu convert --res` takes lists")
        m = re.fullmatch(r"(\d+)(?:\s*[x\*]\s*(\d+))?", text)
        if not m:
            raise SdnpuError(f"cannot read the size {text!r}", hint="write WxH in pixels (1152x896) or one "
                             "number for a square (1024)")
        width = int(m[1])
        return cls(int(m[2]) if m[2] else width, width)


# SDXL's standard aspect-ratio buckets (WxH), the square first: the nine of the sizes issue, each about one
# megapixel, each side a multiple of 64.
SDXL_BUCKETS = ("1024x1024", "1152x896", "896x1152", "1216x832", "832x1216", "1344x768", "768x1344",
                "1536x640", "640x1536")
SIZE_LISTS = {"sdxl-buckets": SDXL_BUCKETS}


def parse_sizes(spec: int | str | Size | Sequence[int | str | Size]) -> list[Size]:
    """``--res`` -> the sizes, in the order given, each once: one size, a comma-separated list of them, or a
    named list (``sdxl-buckets``), which may be mixed (``sdxl-buckets,1024x576``)."""
    items: list[int | str | Size]
    if isinstance(spec, str):
        items = []
        for part in spec.split(","):
            part = part.strip().lower()
            if not part:
                continue
            items.extend(SIZE_LISTS.get(part, (part,)))
    elif isinstance(spec, (int, Size)) or (isinstance(spec, tuple) and len(spec) == 2
                                           and all(isinstance(x, int) for x in spec)):
        items = [spec]  # type: ignore[list-item]
    else:
        items = list(spec)  # type: ignore[arg-type]
    if not items:
        raise SdnpuError(f"--res {spec!r} names no size",
                         hint="WxH (1152x896), a side (1024), a comma-separated list, or " + ", ".join(SIZE_LISTS))
    sizes: list[Size] = []
    for item in items:
        size = Size.of(item)
        if size not in sizes:
            sizes.append(size)
    return sizes
