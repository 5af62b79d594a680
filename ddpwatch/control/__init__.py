"""Commands to a running job: switches relayed to rank 0, ``ddpwatch switch``, and span requests."""
