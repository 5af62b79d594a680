"""``ddpwatch doctor``: ddpwatch's figures held against torch.profiler's kernels on a GPU machine."""
