"""The GPU tools: the vLLM self-check, the one-command GPU proof and the kit that carries its packages."""
