"""Execution: the model side of an engine. The worker (dtype, KV sizing), the runner (a StepInput ->
tensors -> model -> sampler), compiled decode steps and their compiler process, the sampler, and
speculative verification."""
