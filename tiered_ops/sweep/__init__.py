"""Sweeps: bench over cases, worker processes per GPU, shards, and the live measuring of the speed targets; results go
to the store."""
