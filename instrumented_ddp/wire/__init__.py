"""The wire: the messages between ranks and ddpwatch, and what both sides compute alike. Imports neither torch nor ddpwatch."""
