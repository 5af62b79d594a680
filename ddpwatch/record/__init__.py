"""``ddpwatch record``: a session received headless."""
