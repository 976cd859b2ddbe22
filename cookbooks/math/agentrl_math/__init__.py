"""agentrl cookbook: math word problems (GSM8K format)."""
