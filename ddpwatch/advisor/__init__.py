"""The bucket-size advisor: backward replayed under other caps, and ``ddpwatch tune``."""
