"""MultiMax models (DeiT, GPT), checkpoints and their command line (`python -m models`)."""
