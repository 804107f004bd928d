"""HTP's forms: rewrites that bring a float32 graph of standard ops to what Qualcomm's HTP takes and computes
right (target ``qnn-htp``). Each is exact in float32 or says what it changes; none touches the graph's inputs
and outputs, so a runtime can swap the QNN model for the fp32 graph.

- **float32 tables.** QNN maps no float64 tensor ("Type not supported", then ``Failed to compose Qnn graph``,
  error 7004, on diffusers' Flux.1 transformer, whose rotary tables are computed in float64 from the position
  ids). Every float64 value inside the graph becomes float32: Casts to float64 cast to float32, float64
  constants are stored float32, and so are the value attributes of ``Constant`` / ``ConstantOfShape``. The
  difference is float32's rounding of what float64 computed (the rotary angles: |a| < 2^10 rad, so < 1e-4
  rad). A graph input or output in float64 is the graph's interface and keeps its type: a Cast at the edge
  turns it to or from float32, and the partition names that Cast.
- **A broadcast into LayerNormalization.** QNN 2.51's HTP compiles an ``Add`` or ``Mul`` whose operand is
  broadcast along an axis other than the last, feeding a ``LayerNormalization`` directly, into something that
  drops the operand for every batch row but the first (SD3's patch embedding: ``h[B, N, D] + pos[1, N, D]``
  then the first block's norm; cosine 0.75-0.93 on the five-node repro, 0.866 on tiny-sd3's transformer, with
  no error). The values themselves are right (the Add's output, read elsewhere, is exact); only the pair is
  wrong, and a ``Sub`` of the same broadcast is exact. So ``Add(x, k)`` becomes ``Sub(x, -k)`` (the constant
  negated offline, a computed one through ``Neg``: exact), and under a ``Mul`` the norm is written out
  (ReduceMean, Sub, Mul, ReduceMean, Add, Sqrt, Div, then its scale and bias): the same to fp16's rounding.
  Measured on the HTP emulator (``tests/test_htp_norms.py`` keeps the repro): broadcast sizes 2-7 fail, 8 and more
  pass; the rule takes every operand that varies along one leading axis and is broadcast along another, as the
  fault's bounds are this compiler's and not documented.
- **A product with a reciprocal** (``divide_reciprocal_products``): the RMS norm as exported, which QNN fuses into an
  RmsNorm that fails to compile or computes wrong, is written with a division.
- **Rank-6 pixel shuffles** (``lower_pixel_shuffles``): DiT's unpatchify, in rank 4.
- **Ranks and types the HTP refuses** (``passes/htp/ranks.py``): a rank-5 reduction over a lower-rank view, a Gather
  of rank-6 data over a rank-3 view, a bool GatherND on int32 (and, from the canonical movements, a nearest
  upsampling in rank-8 movements as a Resize): Wan 2.2's and Qwen-Image's VAEs, HiDream, Qwen2 / Qwen3.
- **fp16's range** (``guard_fp16_range``): masks' minus infinity, and values near 65504 scaled into their norms.
- **An attention's tokens padded** (``pad_attention_tokens``): a token count that is not a multiple of 64 (SD 3.5's
  4429 at 1024 px) padded to one, the padded keys masked and the padded queries dropped: QNN compiles it in seconds
  rather than many minutes and gigabytes.
- **An attention's scores in head groups** (``group_attention_heads``): scores past 1 GiB (SD 3.5's at 1024 px,
  3.5 GB) computed over groups of heads, concatenated: QNN's compile of such a piece did not fit this machine.
"""

from sdnpu.passes.htp.angles import reduce_angles_exactly
from sdnpu.passes.htp.dtypes import demote_float64
from sdnpu.passes.htp.heads import group_attention_heads
from sdnpu.passes.htp.headroom import MASK_FLOOR, clamp_masks, guard_fp16_range, guards_of, scale_into_norms
from sdnpu.passes.htp.movement import lower_pixel_shuffles, lower_rank6_movements
from sdnpu.passes.htp.norms import divide_reciprocal_products, rewrite_broadcast_into_layernorm
from sdnpu.passes.htp.tokens import pad_attention_tokens

__all__ = ["MASK_FLOOR", "clamp_masks", "demote_float64", "divide_reciprocal_products", "group_attention_heads",
           "guard_fp16_range", "guards_of", "lower_pixel_shuffles", "lower_rank6_movements", "pad_attention_tokens",
           "reduce_angles_exactly", "rewrite_broadcast_into_layernorm", "scale_into_norms"]
