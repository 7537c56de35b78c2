"""FLARE: one-shot federated learning with learned global alignment."""
__version__ = "0.1.0"
