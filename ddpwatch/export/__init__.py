"""Files a recorded session leaves behind, and ``ddpwatch compare``."""
