"""Built-in models and tokenizers the project makes itself (a leaf: imports nothing else of dualrl)."""
