"""Integrations with trainers: ``overflow_fast.integrations.transformers`` (the Hugging Face
Trainer). Each submodule imports its framework only when it is itself imported."""
