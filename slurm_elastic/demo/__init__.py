"""`slurm-elastic demo`: three elastic jobs on the local cluster, a node lost and one gained, and a report."""
