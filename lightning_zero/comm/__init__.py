"""Communication: the only package that talks to torch.distributed."""
