"""The ``tiered-ops`` command line: parse, call the layers below, print."""
