"""AMD's op signatures as read from its public sources, transcribed by hand for the tests to hold the target's
table against: the DynamicDispatch registry (src/ops/op_registration_db.def at b3051f0) and the ONNX nodes
its test models write (tests/cpp/sd_*/model.py at b3051f0). Facts only."""

from __future__ import annotations

# op -> (registered dtypes, positions): ICreatePolicy::verify (include/ops/op_policy.hpp) requires the node's
# in_dtypes + out_dtypes to hold type i at position pos[i] (-1: any; an empty list: no check).
REGISTRY: dict[str, tuple[list[str], list[int]]] = {
    "SDConv": (["bfloat16", "bfp16ebs8", "float", "bfloat16"], [0, 1, 2, 3]),  # L253-254
    "SDMatMul": (["bfloat16", "bfloat16", "bfloat16"], [0, 1, 2]),  # L256-257
    "SDGelu": (["bfloat16", "bfloat16", "bfloat16"], [0, 1, 2]),  # L259-260
    "SDSilu": (["bfloat16", "bfloat16"], [0, 1]),  # L262-263
    "SDConcat": (["bfloat16", "bfloat16"], [0, 2]),  # L265-266
    "SDAdd": (["bfloat16", "bfloat16", "bfloat16"], []),  # L268-269
    "SDMul": (["bfloat16", "bfloat16", "bfloat16"], []),  # L271-272
    "SDResize": (["bfloat16", "bfloat16"], []),  # L274-275
    "SDLayerNorm": (["bfloat16", "bfloat16", "bfloat16"], [0, 1, 2]),  # L277-278
    "SDMHA": (["bfloat16", "bfloat16", "bfloat16"], [0, 1, 2]),  # L280-281
    "SDSlice": (["bfloat16", "bfloat16"], [0, 1]),  # L283-284
    "SDGroupNorm": (["bfloat16", "bfloat16", "bfloat16"], [0, 1, 2]),  # L286-287
    "SDGemm": (["bfloat16", "bfp16ebs8", "bfloat16", "bfloat16"], [0, 1, 2, 3]),  # L304-305
}

# op -> the node AMD's test model writes: input dtypes (ONNX element types; the packed weight of SDConv and
# SDGemm is one UINT8 blob), attribute name -> ONNX attribute type (make_attribute on a list of ints is INTS,
# on an int or a bool INT, on a list of str STRINGS), in_dtypes, out_dtypes.
TEST_MODELS: dict[str, dict[str, object]] = {
    "SDConv": {  # tests/cpp/sd_conv/model.py:60-87
        "inputs": ["BFLOAT16", "UINT8"],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "weight_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfp16ebs8", "float", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDGemm": {  # tests/cpp/sd_gemm/model.py:63-92
        "inputs": ["BFLOAT16", "UINT8"],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "weight_shape": "INTS", "bias_enable": "INT"},
        "in_dtypes": ["bfloat16", "bfp16ebs8", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDMatMul": {  # tests/cpp/sd_matmul/model.py:101-133
        "inputs": ["BFLOAT16", "UINT16"],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "weight_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDMHA": {  # tests/cpp/sd_mha/model.py:38-66
        "inputs": ["BFLOAT16", "BFLOAT16", "BFLOAT16", "UINT16"],
        "attrs": {"input_shape": "INTS", "num_heads": "INT", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS"},
        "in_dtypes": ["bfloat16", "bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDLayerNorm": {  # tests/cpp/sd_layernorm/model.py:101-128
        "inputs": ["BFLOAT16", "UINT16", "UINT16"],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "gamma_shape": "INTS", "beta_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDGroupNorm": {  # tests/cpp/sd_groupnorm/model.py:40-67
        "inputs": ["BFLOAT16", "BFLOAT16"],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "wts_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDSilu": {  # tests/cpp/sd_silu/model.py:40-66
        "inputs": ["BFLOAT16", "UINT8"], "dummy": [128],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "weight_shape": "INTS"},
        "in_dtypes": ["bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDGelu": {  # tests/cpp/sd_gelu/model.py:19-43
        "inputs": ["BFLOAT16", "UINT16"], "dummy": [64],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDResize": {  # tests/cpp/sd_resize/model.py:38-61
        "inputs": ["BFLOAT16", "FLOAT"], "dummy": [32],
        "attrs": {"a_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "c_shape": "INTS"},
        "in_dtypes": ["bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDAdd": {  # tests/cpp/sd_elwadd/model.py:120-153
        "inputs": ["BFLOAT16", "BFLOAT16"],
        "attrs": {"a_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "c_shape": "INTS",
                  "b_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDMul": {  # tests/cpp/sd_elwmul/model.py:120-153
        "inputs": ["BFLOAT16", "BFLOAT16"],
        "attrs": {"a_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "c_shape": "INTS",
                  "b_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDConcat": {  # tests/cpp/sd_concat/model.py:40-63
        "inputs": ["BFLOAT16", "BFLOAT16"],
        "attrs": {"a_shape": "INTS", "b_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS",
                  "c_shape": "INTS"},
        "in_dtypes": ["bfloat16", "bfloat16"], "out_dtypes": ["bfloat16"]},
    "SDSlice": {  # tests/cpp/sd_slice/model.py:40-66
        "inputs": ["BFLOAT16", "UINT8"], "dummy": [128],
        "attrs": {"input_shape": "INTS", "in_dtypes": "STRINGS", "out_dtypes": "STRINGS", "output_shape": "INTS",
                  "weight_shape": "INTS"},
        "in_dtypes": ["bfloat16"], "out_dtypes": ["bfloat16"]},
}
