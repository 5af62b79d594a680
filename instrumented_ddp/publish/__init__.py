"""Sending a rank's figures: the watch a training script holds, its publisher, span policy and stop signals."""
