"""Checkpoints: Hugging Face safetensors interop (per-rank slice reads) and sharded resume."""
