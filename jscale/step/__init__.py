"""One optimizer step: the train state, the loss, gradient accumulation over micro-batches,
the pipeline's path through the executor, and the jitted train / eval steps that put them
together with a layout's `Comms`."""
