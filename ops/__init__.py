"""The dispatch op set (domain ``sdnpu``): contracts, capability table, reference bodies."""
