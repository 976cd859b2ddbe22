"""Policy and critic workers, the worker group that runs them (local or one Ray actor per device), dispatch."""
