"""The fusion rules: one op family per module, each a ``Rule`` (match with a reason, rewrite); ``base`` drives
them, and ``attention_masks`` holds what the attention rule does with its scores' masks."""
