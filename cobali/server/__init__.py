"""`cobali serve`: an OpenAI-compatible HTTP server over the engine."""

from cobali.server.flags import register

__all__ = ["register"]
