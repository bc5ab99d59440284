"""Durable state behind one interface (base.py); SQLite is the embedded default."""
