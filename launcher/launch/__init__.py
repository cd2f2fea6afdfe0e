"""Starting workers through torch.distributed.elastic and reporting how they ended."""
