"""The call path of ``tiered_ops.<op>``: a call's key, the decision table's entry for it, the bound implementation
called; a miss asks the tuner (``decide``) through one function. Never measures and never reads the store."""
