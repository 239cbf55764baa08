"""A real multi-node Slurm on loopback for tests, the demo and newcomers."""
