"""The tiers: a declared op turned into its implementations (eager, torch.compile, Triton, CUDA, the peers) and the
CUDA extension's build; ``catalog`` finds a built op by name."""
