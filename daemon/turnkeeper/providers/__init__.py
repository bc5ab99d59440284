"""Model providers: one small protocol (base.py) and one adapter per wire format."""
