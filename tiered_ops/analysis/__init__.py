"""Analysis: winners, decisions, reports, the speed targets and the territory check, read from stored results; nothing
here measures."""
