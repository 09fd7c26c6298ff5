"""Using a trained model: sampling, generation with a KV cache (`Generator`), evaluation."""
