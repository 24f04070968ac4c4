"""Routing: which worker a request goes to (the policy) and which worker holds which KV block (the index); the
replicas of `treadle serve` and the standalone router both use it."""
