"""The op declarations, one file per op. Importing this package imports every module here whose name does not start
with ``_`` (in name order), and each declares its op (``registry.register_op``); ``tiered_ops.catalog`` builds their
tiers. Adding an op adds its file here: nothing lists the ops."""

import importlib
import pkgutil

DECLARATIONS: tuple[str, ...] = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                                             if not m.name.startswith("_")))
for _name in DECLARATIONS:
    importlib.import_module(f"{__name__}.{_name}")
