"""Serving diffusers pipelines: the runtime behind the built-in `diffusion` serve backend.

Imported only when that backend serves or generates (it pulls in torch and diffusers); the `llm` path and
backend detection never import it. `config` is the one torch-free module (the backend's argv and help).
"""
