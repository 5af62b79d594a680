"""What a rank holds and what its device does: tensor memory and the device sampler."""
