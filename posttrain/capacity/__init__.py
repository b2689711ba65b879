"""Memory and capacity: will a model train and serve on a GPU (KV cache, training memory, GPU profiles)."""
