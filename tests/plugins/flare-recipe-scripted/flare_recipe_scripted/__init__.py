"""A test-only Flare recipe whose model emits a fixed script of tokens after the prompt.

Random-weight models cannot be made to produce reasoning blocks or tool calls; this one can, so
the server's reasoning / tool-call parsing can be tested end to end through a real `flare run`.
Written only against Flare's public API, like any third-party recipe.
"""
