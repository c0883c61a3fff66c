"""For tests and demos only: the synthetic checkpoint writer, the GPU stand-in and `./scripts/demo`."""
