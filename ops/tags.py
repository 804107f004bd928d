"""Node and model metadata keys: the contract between the passes that write them and the report that reads
them (so the report never recounts op types to guess what the compiler did)."""

RULE_TAG = "sdnpu.rule"  # the rule or pass that created a node
REGION_TAG = "sdnpu.region"  # the NPU region of a dispatch op (partition)
REASON_TAG = "sdnpu.cpu_reason"  # why a node stays on the CPU (partition)
DECLINED_TAG = "sdnpu.declined"  # "<rule>: <reason>" where a rule found its pattern but refused it
ASSUMED_TAG = "sdnpu.assumed"  # comma-separated assumed capabilities a dispatch op relies on
VIEWS_TAG = "sdnpu.views"  # "<input>:<shape>;..." the tensor shapes of inputs read through a view
TARGET_KEY = "sdnpu.target"  # model metadata: the target a dispatch model was compiled for
