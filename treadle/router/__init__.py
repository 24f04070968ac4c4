"""The router's side of scale-out (issue 16): where prompts are cached."""
