"""The API dialects: each module translates its requests into the shared preparation
(server/prepare.py) and a Generation's deltas (server/generation.py) into its own responses,
and registers its routes with `register(app, state)`."""
