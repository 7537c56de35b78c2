"""Client side: local objectives, λ providers, gradient surgery and the local training loop."""
