"""Fused kernels: chains of ops computed in one pass (registered per device)."""
