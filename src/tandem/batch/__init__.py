"""Trajectories and jagged training batches."""
