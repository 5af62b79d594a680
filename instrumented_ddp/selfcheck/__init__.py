"""What ``ddpwatch doctor`` runs on the ranks: the GPU probe and the overhead bench."""
