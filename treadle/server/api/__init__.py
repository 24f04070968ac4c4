"""The API dialects: each module translates its requests into the shared preparation
(server/prepare.py) and the collector's deltas (server/collector.py) into its own responses,
and registers its routes with `register(app, state)`."""
