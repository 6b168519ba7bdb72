"""Data pipeline: ingest -> validate -> count -> pack -> write -> load (Megatron-Energon WebDataset)."""
