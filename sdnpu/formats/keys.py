"""Metadata keys: where one stage leaves a fact on a node, a value or a model for another stage to read (so the
report never recounts op types to guess what the compiler did, and the runtime never guesses a model's form).
Every ``sdnpu.*`` key is spelled here and nowhere else."""

# On nodes (``node.metadata_props``), written by the passes, read by the report and the specializer.
RULE_TAG = "sdnpu.rule"  # the rule or pass that created a node
REGION_TAG = "sdnpu.region"  # the NPU region of a dispatch op (partition)
REASON_TAG = "sdnpu.cpu_reason"  # why a node stays on the CPU (partition)
DECLINED_TAG = "sdnpu.declined"  # "<rule>: <reason>" where a rule found its pattern but refused it
ASSUMED_TAG = "sdnpu.assumed"  # comma-separated assumed capabilities a dispatch op relies on
BF16_ONLY_TAG = "sdnpu.bf16_only"  # why a dispatch op keeps its bf16 kernel in bfp16 mode (its _bfp would be wrong)
VIEWS_TAG = "sdnpu.views"  # "<input>:<shape>;..." the tensor shapes of inputs read through a view

# On models (``model.metadata_props``).
TARGET_KEY = "sdnpu.target"  # the target a dispatch model was compiled for
HANDOFF_KEY = "sdnpu.handoff"  # its handoff values and their forms (sdnpu.formats.handoff)
PROLOGUE_KEY = "sdnpu.prologue"  # its step prologue (sdnpu.formats.prologue)
SIZED_CONSTANTS_KEY = "sdnpu.sized_constants"  # constants cut for one image size (the canonical crops; the specializer)
PACKED_KEY = "sdnpu.packed"  # the packer a deployable copy's weights went through (sdnpu pack)
FP16_GUARDS_KEY = "sdnpu.fp16_guards"  # JSON {value name: the rewrite that keeps it in fp16's range} (passes.htp)

# On values while the passes run (``Value.meta``; never serialized).
PROVENANCE_KEY = "sdnpu.provenance"  # a constant's weight-record expression (sdnpu.formats.weights)
