"""Running implementations: the float64 gate, the timings of a call, the machine's fingerprint and whether it was busy,
cost metadata, and the worker processes a sweep measures in."""
