"""ddpwatch: the live dashboard, headless recorder and exporter for instrumented_ddp runs.

It imports nothing from instrumented_ddp but the wire protocol, and never imports torch.
"""
