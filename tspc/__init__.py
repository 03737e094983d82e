"""tspc: Tensor-and-Sequence Parallelism as a torch.compile backend."""
