"""Checkpoint IO: one read-only mapping per safetensors file, the checkpoint index built from their
headers, and a Hugging Face repo id resolved to a local folder."""
