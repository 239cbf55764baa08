"""The level-triggered controller: reconcile cycles, plans, the requeue protocol and its journal."""
