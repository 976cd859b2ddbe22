"""What a run leaves on disk, written and read in one place: rollout files, the metrics history, plots."""
