"""What the NPU accepts: one table that the fusion checks, the partitioner, the report and the tests read.

The limits are those of the NPU we model (AMD XDNA-class, as its SDXL flow shows): bf16 activations, static
shapes, rank <= 4, kernels and tile-able sizes as below. SDXL at 1024 px fits every limit; a limit that a
model crosses keeps that node on the CPU with the limit named as the reason.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_rank: int = 4
    max_conv_kernel: int = 7          # SD uses 1x1 and 3x3
    max_conv_stride: int = 4
    max_channels: int = 8192
    max_gemm_k: int = 16384
    max_gemm_n: int = 32768           # SDXL's GEGLU projection: 2 x 5120 = 10240
    max_head_dim_mha: int = 256       # SDXL: 64
    max_head_dim_vae: int = 512       # the VAE's single head spans all 512 channels
    max_sequence: int = 16384         # VAE attention at 1024 px: 128 x 128 latent pixels
    float_only: bool = True           # integer tensors (token ids, indices) stay on the CPU


LIMITS = Limits()


def check_conv(weight_shape: tuple[int, ...], strides: list[int], dilations: list[int]) -> str | None:
    oc, icg, kh, kw = weight_shape
    if max(kh, kw) > LIMITS.max_conv_kernel:
        return f"kernel {kh}x{kw} is larger than the NPU's {LIMITS.max_conv_kernel}x{LIMITS.max_conv_kernel}"
    if max(strides) > LIMITS.max_conv_stride:
        return f"stride {max(strides)} is above the NPU's {LIMITS.max_conv_stride}"
    if max(oc, icg) > LIMITS.max_channels:
        return f"{max(oc, icg)} channels are above the NPU's {LIMITS.max_channels}"
    return None


def check_gemm(k: int, n: int) -> str | None:
    if k > LIMITS.max_gemm_k:
        return f"K={k} is above the NPU's {LIMITS.max_gemm_k}"
    if n > LIMITS.max_gemm_n:
        return f"N={n} is above the NPU's {LIMITS.max_gemm_n}"
    return None


def check_attention(q_shape: tuple[int, int, int], k_shape: tuple[int, int, int], heads: int) -> str | None:
    head_dim = q_shape[2] // heads
    limit = LIMITS.max_head_dim_vae if heads == 1 else LIMITS.max_head_dim_mha
    if head_dim > limit:
        return f"head dim {head_dim} is above the NPU's {limit}"
    longest = max(q_shape[1], k_shape[1])
    if longest > LIMITS.max_sequence:
        return f"sequence length {longest} is above the NPU's {LIMITS.max_sequence}"
    return None


def check_tensor(rank: int | None, is_float: bool) -> str | None:
    """The generic check for glue ops (element-wise and data movement)."""
    if rank is None:
        return "shape is not static"
    if rank > LIMITS.max_rank:
        return f"rank {rank} is above the NPU's {LIMITS.max_rank}"
    if LIMITS.float_only and not is_float:
        return "integer data: the NPU runs float tensors only"
    return None
