"""Tools offered to the model: the built-ins (report_blocked, clarify) and configured ones."""
