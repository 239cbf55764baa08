"""Choosing the allocation: the L1-norm multi-resource MILP on HiGHS, Slurm request shapes, throughput models."""
