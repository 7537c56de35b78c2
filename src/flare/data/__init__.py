"""Datasets held as whole uint8 tensors, and how they are split across federated clients."""
