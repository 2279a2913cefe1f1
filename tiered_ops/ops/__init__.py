"""Built-in ops. Importing this package registers every op and its tiers."""

from . import muladd, rms_norm, softmax  # noqa: F401
