"""agentrl cookbook: count coloured shapes in pictures drawn at data-preparation time (see README.md)."""
