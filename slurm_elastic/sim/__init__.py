"""The trace-driven what-if simulator and its baseline policies."""
