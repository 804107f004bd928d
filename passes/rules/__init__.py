"""The fusion rules: one op family per module, each a ``Rule`` (match with a reason, rewrite)."""
