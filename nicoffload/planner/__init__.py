"""Placement: which device runs each node, from the topology and measured profiles."""
