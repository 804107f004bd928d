"""The contracts between the stages: every file format and metadata key that one stage writes and another reads.

Below the stages (it imports nothing of theirs, and neither torch nor onnxruntime): the exporter, the compiler,
the LoRA overlay, the runtime and the reports all read and write these formats through here, so none of them
reaches into another stage to learn a file's shape.

=================== ========================================== =======================================
module              what                                       written by -> read by
=================== ========================================== =======================================
``keys``            node, value and model metadata keys         passes -> reports, specializer, runtime
``weights``         ``dd/weights.json`` and its replay          passes -> LoRA overlay, tests
``parameters``      ``<component>/parameters.json``             export -> LoRA overlay
``overlay``         ``dd/lora/lora.json`` (the LoRA overlay)    LoRA overlay -> runtime, verify
``sizes``           ``sizes.json`` and each size's file names   convert -> runtime, reports, pack
``handoff``         the handoff record and its two forms        passes -> runtime, convert, reports
``prologue``        the step-prologue record                    passes -> runtime, convert, reports, pack
``reference``       whether the fp32 graph was kept             convert -> runtime, LoRA overlay, convert
                    (``--dispatch-only``), the one refusal
=================== ========================================== =======================================
"""
