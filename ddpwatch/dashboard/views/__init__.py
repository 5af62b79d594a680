"""View models: what a widget draws, computed apart from the widget."""
