"""Timing on a rank: the step timeline, and every collective timed where it is issued or completes."""
