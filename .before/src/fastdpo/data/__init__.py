"""Data: load preference rows, tokenise them, pack them into micro-batches."""
