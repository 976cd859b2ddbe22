"""Built-in tasks small enough for a tiny model on CPU: the default training run uses them."""
