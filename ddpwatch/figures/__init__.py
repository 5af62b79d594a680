"""The figures, pure: computed one way for the dashboard, the recorder and the exporters."""
