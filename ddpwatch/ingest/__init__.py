"""Taking messages in: the receiver, the session file, and the session they feed."""
